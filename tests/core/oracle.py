"""Single-key reference versions of the core's batch paths, for the tests only.

The daemon only ever moves keys in batches (``TierPlacement.demote_many``,
``place_pinned_many``, ``pin_many``, ``take_many``, ``drop_many``).  These
classes do the same one key at a time, the obviously correct way; the tests
hold the batch paths to them.
"""

from __future__ import annotations

from kvpoold.core.block_pool import LayoutClass
from kvpoold.core.tiers import DROP, Key, MovePlan, Tier, TierIndex, TierPlacement


def refcount(pool: LayoutClass, block: int) -> int:
    """Holders of a block (0 for free or cached)."""
    if block in pool.cached or block in pool.free:
        return 0
    return 1 + pool.extra.get(block, 0)


def tier_keys(index: TierIndex) -> list:
    """Evictable keys oldest first, then the pinned ones."""
    out = list(index._order)
    out.extend(k for k in index._sizes if k not in index._order)
    return out


class OracleTierIndex(TierIndex):
    def add(self, key: Key, nbytes: int, pinned: bool = False) -> None:
        c = self.charge(nbytes)
        assert key not in self._sizes and self.used + c <= self.capacity
        self._sizes[key] = nbytes
        self._count(nbytes, 1)
        self.used += c
        if pinned:
            self.pinned += c
        else:
            self._order.insert(key)
        self.blocks_in += 1

    def remove(self, key: Key) -> int:
        nbytes = self._sizes.pop(key)
        self._count(nbytes, -1)
        c = self.charge(nbytes)
        self.used -= c
        if key in self._order:
            self._order.remove(key)
        else:
            self.pinned -= c
        return nbytes

    def pin(self, key: Key) -> None:
        if key in self._order:
            self._order.remove(key)
            self.pinned += self.charge(self._sizes[key])

    def pop_victim(self) -> tuple[Key, int]:
        key = self._order.victim()
        nbytes = self._sizes.pop(key)
        self._count(nbytes, -1)
        self.used -= self.charge(nbytes)
        return key, nbytes


class OraclePlacement(TierPlacement):
    """``TierPlacement`` with the key-by-key methods."""

    def __init__(self, host_bytes: int = 0, disk_bytes: int = 0, policy: str = "lru", align: int = 1) -> None:
        super().__init__(host_bytes, disk_bytes, policy, align)
        self.lower = [OracleTierIndex(Tier.HOST, host_bytes, policy, align),
                      OracleTierIndex(Tier.DISK, disk_bytes, policy, align)]

    def demote(self, plan: MovePlan, key: Key, nbytes: int, block: int = -1) -> bool:
        """Record a cached block the device evicts; True if it was placed in a lower tier."""
        for index in self.lower:
            if key in index:
                index.touch(key)
                return False
        return self._place(plan, key, nbytes, Tier.DEVICE, 0, block, pinned=False) != DROP

    def can_pin(self, sizes: list[int]) -> bool:
        return self.can_pin_runs(self.runs(sizes))

    def place_pinned(self, plan: MovePlan, key: Key, nbytes: int, block: int) -> Tier:
        dst = self._place(plan, key, nbytes, Tier.DEVICE, 0, block, pinned=True)
        assert dst != DROP, "place_pinned without room: check can_pin first"
        return Tier(dst)

    def _place(self, plan: MovePlan, key: Key, nbytes: int, src: Tier, level: int, block: int,
               pinned: bool) -> int:
        """Place ``key`` at ``level`` or below, making room first; returns the tier (or ``DROP``)."""
        lower = self.lower
        while level < len(lower) and lower[level].room() < lower[level].charge(nbytes):
            level += 1
        if level == len(lower):
            if src != Tier.DEVICE:
                self.index(src).dropped += 1
            plan.add(key, src, DROP, block, nbytes)
            return DROP
        index = lower[level]
        c = index.charge(nbytes)
        while index.used + c > index.capacity:
            victim, vbytes = index.pop_victim()
            self._place(plan, victim, vbytes, index.tier, level + 1, -1, pinned=False)
        index.add(key, nbytes, pinned)
        plan.add(key, src, index.tier, block, nbytes)
        return index.tier

    def pin(self, key: Key) -> None:
        for index in self.lower:
            if key in index:
                index.pin(key)
                return

    def take(self, plan: MovePlan, key: Key, block: int) -> Tier:
        """Take ``key`` out of its lower tier into device block ``block``."""
        for index in self.lower:
            if key in index:
                nbytes = index.remove(key)
                index.blocks_out += 1
                plan.add(key, index.tier, Tier.DEVICE, block, nbytes)
                return index.tier
        raise KeyError(key)

    def drop(self, plan: MovePlan | None, key: Key) -> Tier:
        for index in self.lower:
            if key in index:
                nbytes = index.remove(key)
                if plan is not None:
                    plan.add(key, index.tier, DROP, -1, nbytes)
                return index.tier
        raise KeyError(key)


def prefix_state(pool: LayoutClass) -> tuple[dict, dict, dict]:
    """(hash -> block, block -> hash, unwritten block -> writer) of a pool's prefix index."""
    p = pool.prefix
    return dict(p._by_hash), dict(p._hash_of), dict(p._unwritten)
