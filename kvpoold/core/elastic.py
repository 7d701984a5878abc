"""An elastic pool: its size moves up to its limit, and slabs nobody uses give their memory back.

Every class's id space is sized for the pool's limit (``max_pool_bytes``),
so growing or shrinking the pool never changes a block id: only how many
chunks the classes may own.  A shrink takes unassigned chunks first, then
empty slabs, then slabs holding only cached blocks (evicted, so demoted to
the lower tiers); it never touches a held block, so it may stop short.

``release_idle`` gives back slabs that stayed empty for a while, so their
memory is released (``drain_slab_changes``) while the pool keeps its size:
the chunks go back to unassigned memory, for any class to take.
"""

from __future__ import annotations

import math

import numpy as np

from .block_pool import ChunkBudget, LayoutClass
from .errors import InvalidArgument
from .results import ResizeResult


def empty_slots(pool: LayoutClass) -> list[int]:
    """The owned slots of ``pool`` whose every block is free (no hash, no holder)."""
    bps = pool.blocks_per_slab
    if len(pool.free) < bps:  # no slab can be empty: skip the pass over the free list
        return []
    per_slot = np.bincount(np.asarray(pool.free, np.int64) // bps)
    return np.flatnonzero(per_slot == bps).tolist()


def _seconds(name: str, value, minimum: float | None = None) -> float:
    if type(value) not in (int, float) or not math.isfinite(value) or (minimum is not None and value < minimum):
        bound = "" if minimum is None else f" >= {minimum}"
        raise InvalidArgument(f"{name} must be a finite number{bound}, got {value!r}")
    return float(value)


class Elastic:
    """``resize`` the pool within its limit, and ``release_idle`` slabs that stay empty."""

    def __init__(self, budget: ChunkBudget, classes: list[LayoutClass]) -> None:
        self._budget = budget  # this part writes its size (``total``)
        self._classes = classes  # the registry's list, by class id (read only here)
        #: per class, slot -> when a ``release_idle`` call first saw it empty (and every call since)
        self.empty_since: dict[LayoutClass, dict[int, float]] = {}

    def resize(self, pool_bytes: int) -> ResizeResult:
        """Grow or shrink the pool to ``pool_bytes`` (whole chunks), never past its limit.

        A shrink takes unassigned chunks, then empty slabs of any class, then
        slabs whose blocks are only cached (evicting them); never a held or
        reserved block.  When that is not enough it stops at the lowest size
        it reached, and the result says the target was not met.

        Args:
            pool_bytes: the new size, from 0 up to ``max_pool_bytes``; rounded down to whole chunks.

        Returns:
            The size reached, chunks the classes gave back and cached blocks evicted for it.

        Raises:
            InvalidArgument: ``pool_bytes`` is not a non-negative integer, or exceeds the limit.
        """
        budget = self._budget
        if type(pool_bytes) is not int or pool_bytes < 0:
            raise InvalidArgument(f"pool_bytes must be a non-negative integer, got {pool_bytes!r}")
        target = pool_bytes // budget.chunk_bytes
        if target > budget.limit:
            raise InvalidArgument(
                f"pool_bytes {pool_bytes} exceeds the pool's limit of {budget.limit * budget.chunk_bytes} bytes "
                "(max_pool_bytes)"
            )
        # -- apply --
        freed = evicted = 0
        if target < budget.total:
            released_before = self._released_chunks()
            evictions_before = sum(pool.evictions for pool in self._classes)
            excess = budget.total - target
            for evict in (False, True):  # empty slabs cost nothing; cached ones cost their cache
                if budget.free < excess:
                    budget.reclaim(None, excess, evict=evict)
            freed = self._released_chunks() - released_before
            evicted = sum(pool.evictions for pool in self._classes) - evictions_before
            target = budget.total - min(excess, budget.free)
        budget.free += target - budget.total
        budget.total = target
        met = target == pool_bytes // budget.chunk_bytes
        return ResizeResult(pool_bytes, target * budget.chunk_bytes, freed, evicted, met)

    def _released_chunks(self) -> int:
        return sum(pool.released_slabs * pool.slab_chunks for pool in self._classes)

    def release_idle(self, now: float, after_seconds: float) -> int:
        """Give back every slab that has been empty since at least ``after_seconds`` before ``now``.

        A slab counts as empty since the first call that found it empty, as
        long as every call since did; a call that finds it in use starts it
        over.  The daemon calls this periodically with its clock; the chunks
        stay in the pool, unassigned, and the slabs' memory is released.

        Args:
            now: the caller's clock, in seconds (monotone across calls).
            after_seconds: how long a slab must stay empty; 0 gives back every empty slab now.

        Returns:
            The chunks given back.

        Raises:
            InvalidArgument: ``now`` or ``after_seconds`` is not a finite number, or ``after_seconds`` < 0.
        """
        now = _seconds("now", now)
        after_seconds = _seconds("after_seconds", after_seconds, minimum=0)
        # -- apply --
        chunks = 0
        still_empty: dict[LayoutClass, dict[int, float]] = {}
        for pool in self._classes:
            empty = empty_slots(pool)
            if not empty:
                continue
            seen = self.empty_since.get(pool, {})
            since = {slot: seen.get(slot, now) for slot in empty}
            due = {slot for slot, t in since.items() if now - t >= after_seconds}
            if due:
                pool.give_back(due)
                chunks += len(due) * pool.slab_chunks
            waiting = {slot: t for slot, t in since.items() if slot not in due}
            if waiting:
                still_empty[pool] = waiting
        self.empty_since = still_empty
        return chunks
