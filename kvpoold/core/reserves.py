"""Reserves: blocks an owner holds outside any page table, assigned by the client and claimed in ``extend``."""

from __future__ import annotations

from typing import Iterable

from .errors import InvalidArgument
from .state import Owners, check_owner


class Reserves:
    """Owners' reserves: granted from free memory only, claimed by ``extend``, returned."""

    def __init__(self, registry, owners: Owners, max_blocks: int) -> None:
        self._registry = registry  # ``classes.ClassRegistry``
        self._owners = owners
        self.max_blocks = max_blocks  # the most one owner may reserve in one class

    def grant_reserve(self, owner: int, class_id: int, target: int) -> tuple[int, ...]:
        """Top the owner's reserve up towards ``target`` blocks; returns the blocks added.

        Best effort and cheap: reserves take free memory only, they never evict
        the prefix cache or take memory from other classes.
        """
        pool = self._registry.pool(class_id)
        if type(target) is not int or target < 0:
            raise InvalidArgument(f"reserve target must be a non-negative integer, got {target!r}")
        check_owner(owner)
        want = min(target, self.max_blocks) - len(self._owners.reserve(owner, class_id))
        cheap = len(pool.free) + (pool.budget.free // pool.slab_chunks) * pool.blocks_per_slab
        n = min(want, cheap)
        if n <= 0:
            return ()
        ids = pool.allocate(n)
        self._owners.add_reserved(owner, class_id, ids)
        return tuple(ids)

    def check_reserve_return(self, owner: int, class_id: int, blocks: Iterable[int] | None = None) -> list[int]:
        """Validate a reserve return without doing it; returns the blocks."""
        self._registry.pool(class_id)
        reserve = self._owners.reserve(owner, class_id)
        blocks = list(reserve) if blocks is None else list(blocks)
        if len(set(blocks)) != len(blocks):
            raise InvalidArgument("a block appears twice in one reserve return")
        for b in blocks:
            if b not in reserve:
                raise InvalidArgument(f"block {b!r} is not in this session's reserve")
        return blocks

    def return_reserve(self, owner: int, class_id: int, blocks: Iterable[int] | None = None) -> int:
        """Give reserved blocks back (all of them when ``blocks`` is None)."""
        pool = self._registry.pool(class_id)
        blocks = self.check_reserve_return(owner, class_id, blocks)
        self._owners.take_reserved(owner, class_id, blocks)
        pool.release(blocks)
        return len(blocks)
