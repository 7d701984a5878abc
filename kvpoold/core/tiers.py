"""Where cached blocks live below the device, and what to demote next.

Tier 0 is the device pool itself (``ClassPool``).  Tiers 1 (pinned host) and 2
(disk) are byte budgets with an index of (class id, block hash) -> bytes and
an eviction policy each.  The core only *records* placement and *chooses*;
the transfer engine moves the bytes and reports completion.

When the device evicts a cached block, :meth:`TierPlacement.demote` plans the
moves: into tier 1 if it has room (making room by pushing tier 1's victims
down to tier 2), else straight to tier 2; whatever tier 2 evicts is dropped.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum

from .policy import make_policy

Key = tuple  # (class id, block hash)


class Tier(IntEnum):
    DEVICE = 0
    HOST = 1
    DISK = 2


@dataclass(frozen=True)
class Move:
    """Move the bytes of ``key`` from tier ``src`` to tier ``dst`` (dst None = drop)."""

    key: Key
    src: Tier
    dst: Tier | None


class TierIndex:
    """One lower tier: a byte budget and an ordered index of resident blocks."""

    def __init__(self, tier: Tier, capacity_bytes: int, policy: str = "lru") -> None:
        if capacity_bytes < 0:
            raise ValueError(f"tier {tier.name} capacity must be >= 0, got {capacity_bytes}")
        self.tier = tier
        self.capacity = capacity_bytes
        self.used = 0
        self._sizes: dict[Key, int] = {}
        self._order = make_policy(policy)

    def __contains__(self, key: object) -> bool:
        return key in self._sizes

    def __len__(self) -> int:
        return len(self._sizes)

    def fits(self, nbytes: int) -> bool:
        return nbytes <= self.capacity

    def add(self, key: Key, nbytes: int) -> None:
        assert key not in self._sizes and self.used + nbytes <= self.capacity
        self._sizes[key] = nbytes
        self._order.insert(key)
        self.used += nbytes

    def remove(self, key: Key) -> int:
        nbytes = self._sizes.pop(key)
        self._order.remove(key)
        self.used -= nbytes
        return nbytes

    def touch(self, key: Key) -> None:
        self._order.touch(key)

    def pop_victim(self) -> tuple[Key, int]:
        key = self._order.victim()
        nbytes = self._sizes.pop(key)
        self.used -= nbytes
        return key, nbytes

    def keys_by_class(self, class_id: int) -> int:
        return sum(1 for k in self._sizes if k[0] == class_id)

    def check(self) -> None:
        assert self.used == sum(self._sizes.values()) <= self.capacity
        assert set(self._order) == set(self._sizes)


class TierPlacement:
    """Placement of cached blocks over the lower tiers (pure bookkeeping)."""

    def __init__(self, host_bytes: int = 0, disk_bytes: int = 0, policy: str = "lru") -> None:
        self.lower = [
            TierIndex(Tier.HOST, host_bytes, policy),
            TierIndex(Tier.DISK, disk_bytes, policy),
        ]

    def locate(self, key: Key) -> Tier | None:
        """The lower tier holding ``key``, or None."""
        for index in self.lower:
            if key in index:
                return index.tier
        return None

    def demote(self, key: Key, nbytes: int) -> list[Move]:
        """Plan the moves for a block the device evicts; the plan is already recorded.

        A block whose hash a lower tier already holds (it was demoted before and
        computed again on the device since) needs no move: the tiers are
        inclusive, so the device copy is simply dropped.
        """
        for index in self.lower:
            if key in index:
                index.touch(key)
                return []
        return self._place(key, nbytes, Tier.DEVICE, 0)

    def _place(self, key: Key, nbytes: int, src: Tier, level: int) -> list[Move]:
        while level < len(self.lower) and not self.lower[level].fits(nbytes):
            level += 1
        if level == len(self.lower):
            return [Move(key, src, None)]
        index = self.lower[level]
        moves: list[Move] = []
        while index.used + nbytes > index.capacity:
            victim, vbytes = index.pop_victim()
            moves.extend(self._place(victim, vbytes, index.tier, level + 1))
        index.add(key, nbytes)
        moves.append(Move(key, src, index.tier))
        return moves

    def promote(self, key: Key) -> Tier:
        """Forget ``key`` in its lower tier (its bytes are going back up)."""
        for index in self.lower:
            if key in index:
                index.remove(key)
                return index.tier
        raise KeyError(key)

    def check(self) -> None:
        seen: set = set()
        for index in self.lower:
            index.check()
            keys = set(index._sizes)
            assert not (keys & seen), "a block is resident in two lower tiers"
            seen |= keys
