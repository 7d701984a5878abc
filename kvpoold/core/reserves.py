"""Reserves: blocks an owner holds outside any page table, assigned by the client and claimed in ``extend``."""

from __future__ import annotations

from typing import Iterable

from .errors import InvalidArgument
from .state import ManagerState


class Reserves(ManagerState):
    """Owners' reserves: granted from free memory only, claimed by ``extend``, returned."""

    def grant_reserve(self, owner: int, class_id: int, target: int) -> tuple[int, ...]:
        """Top the owner's reserve up towards ``target`` blocks; returns the blocks added.

        Best effort and cheap: reserves take free memory only, they never evict
        the prefix cache or take memory from other classes.
        """
        pool = self.class_pool(class_id)
        if type(target) is not int or target < 0:
            raise InvalidArgument(f"reserve target must be a non-negative integer, got {target!r}")
        self._check_owner(owner)
        current = self._owners[owner].reserves.get(class_id, {}) if owner in self._owners else {}
        want = min(target, self.max_reserve_blocks) - len(current)
        cheap = len(pool.free) + (self.budget.free // pool.slab_chunks) * pool.blocks_per_slab
        n = min(want, cheap)
        if n <= 0:
            return ()
        ids = pool.allocate(n)
        self._owner(owner).reserves.setdefault(class_id, {}).update(dict.fromkeys(ids))
        return tuple(ids)

    def check_reserve_return(self, owner: int, class_id: int, blocks: Iterable[int] | None = None) -> list[int]:
        """Validate a reserve return without doing it; returns the blocks."""
        self.class_pool(class_id)
        state = self._owners.get(owner)
        reserve = state.reserves.get(class_id, {}) if state else {}
        blocks = list(reserve) if blocks is None else list(blocks)
        if len(set(blocks)) != len(blocks):
            raise InvalidArgument("a block appears twice in one reserve return")
        for b in blocks:
            if b not in reserve:
                raise InvalidArgument(f"block {b!r} is not in this session's reserve")
        return blocks

    def return_reserve(self, owner: int, class_id: int, blocks: Iterable[int] | None = None) -> int:
        """Give reserved blocks back (all of them when ``blocks`` is None)."""
        pool = self.class_pool(class_id)
        blocks = self.check_reserve_return(owner, class_id, blocks)
        reserve = self._owners[owner].reserves[class_id] if blocks else {}
        for b in blocks:
            del reserve[b]
        pool.release(blocks)
        return len(blocks)

