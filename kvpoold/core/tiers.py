"""Where blocks live below the device, and what to demote next.

Tier 0 is the device pool itself (``ClassPool``).  Tiers 1 (pinned host) and 2
(disk) are byte budgets with an index of keys -> bytes and an eviction policy
each.  The core only *records* placement and *chooses*; the transfer engine
(``kvpoold.transfer``) moves the bytes, in the order the moves were planned.

Keys are ``(class id, digest)`` for prefix-cache blocks (``digest`` is the
16-byte chained block hash, the same in every process and across restarts)
and ``(class id, n)`` with an integer ``n`` for the blocks of a swapped-out
sequence.  A lower tier holds two kinds of entries:

* **evictable** ones (prefix-cache blocks), in LRU order: when the tier needs
  room its oldest entry moves one tier down, and the disk tier drops its
  oldest entry last;
* **pinned** ones (swapped-out sequences; prefix blocks chosen for promotion
  while the same call allocates device blocks): never victims.

The tiers are exclusive for a key that moves: demotion places a key in one
lower tier, promotion takes it out.  A device block whose hash a lower tier
already holds (computed again on the device since) is simply dropped when the
device evicts it.

Every move names the device block it reads or writes (``block``), so that the
transfer engine needs nothing else; the plan order is an executable order:
room is made (victims moved down or dropped) before a key is placed.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum

from .policy import make_policy

Key = tuple  # (class id, block hash) or (class id, swap entry number)

#: what the daemon rounds block sizes up to in the lower tiers (the disk's and O_DIRECT's unit)
TIER_ALIGN = 4096


class Tier(IntEnum):
    DEVICE = 0
    HOST = 1
    DISK = 2


@dataclass(frozen=True)
class Move:
    """Move the bytes of ``key`` from tier ``src`` to tier ``dst`` (``dst`` None: drop them).

    ``block`` is the device block read (``src`` DEVICE) or written (``dst``
    DEVICE), -1 otherwise; ``nbytes`` the block's size.
    """

    key: Key
    src: Tier
    dst: Tier | None
    block: int = -1
    nbytes: int = 0


class TierIndex:
    """One lower tier: a byte budget and an index of resident blocks."""

    def __init__(self, tier: Tier, capacity_bytes: int, policy: str = "lru", align: int = 1) -> None:
        if capacity_bytes < 0:
            raise ValueError(f"tier {tier.name} capacity must be >= 0, got {capacity_bytes}")
        if align < 1:
            raise ValueError(f"align must be >= 1, got {align}")
        self.align = align  # a block of n bytes takes n rounded up to this
        self.tier = tier
        self.capacity = capacity_bytes
        self.used = 0  # charged bytes of every entry
        self.pinned = 0  # charged bytes of pinned entries
        self._sizes: dict[Key, int] = {}  # key -> block bytes (uncharged)
        self._order = make_policy(policy)  # evictable keys only
        # counters (blocks): placed here (from the device or the tier above), taken back
        # towards the device, dropped (the disk's LRU tail, or nowhere left to go)
        self.blocks_in = 0
        self.blocks_out = 0
        self.dropped = 0

    def __contains__(self, key: object) -> bool:
        return key in self._sizes

    def __len__(self) -> int:
        return len(self._sizes)

    def charge(self, nbytes: int) -> int:
        """Bytes a block of ``nbytes`` takes here."""
        return -(-nbytes // self.align) * self.align

    def nbytes(self, key: Key) -> int:
        return self._sizes[key]

    def room(self) -> int:
        """Charged bytes this tier could hold after evicting every evictable entry."""
        return self.capacity - self.pinned

    def is_pinned(self, key: Key) -> bool:
        return key in self._sizes and key not in self._order

    def add(self, key: Key, nbytes: int, pinned: bool = False) -> None:
        c = self.charge(nbytes)
        assert key not in self._sizes and self.used + c <= self.capacity
        self._sizes[key] = nbytes
        self.used += c
        if pinned:
            self.pinned += c
        else:
            self._order.insert(key)
        self.blocks_in += 1

    def remove(self, key: Key) -> int:
        nbytes = self._sizes.pop(key)
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

    def unpin(self, key: Key) -> None:
        if key in self._sizes and key not in self._order:
            self._order.insert(key)
            self.pinned -= self.charge(self._sizes[key])

    def touch(self, key: Key) -> None:
        if key in self._order:
            self._order.touch(key)

    def pop_victim(self) -> tuple[Key, int]:
        key = self._order.victim()
        nbytes = self._sizes.pop(key)
        self.used -= self.charge(nbytes)
        return key, nbytes

    def keys(self):
        """Evictable keys oldest first, then the pinned ones."""
        out = list(self._order)
        out.extend(k for k in self._sizes if k not in self._order)
        return out

    def pinned_keys(self) -> set:
        return {k for k in self._sizes if k not in self._order}

    def keys_by_class(self, class_id: int) -> int:
        return sum(1 for k in self._sizes if k[0] == class_id)

    def check(self) -> None:
        assert self.used == sum(self.charge(n) for n in self._sizes.values()) <= self.capacity, "tier bytes are off"
        assert set(self._order) <= set(self._sizes)
        assert self.pinned == sum(self.charge(n) for k, n in self._sizes.items() if k not in self._order)


class TierPlacement:
    """Placement of blocks over the lower tiers (pure bookkeeping)."""

    def __init__(self, host_bytes: int = 0, disk_bytes: int = 0, policy: str = "lru", align: int = 1) -> None:
        self.lower = [
            TierIndex(Tier.HOST, host_bytes, policy, align),
            TierIndex(Tier.DISK, disk_bytes, policy, align),
        ]

    @property
    def enabled(self) -> bool:
        return any(t.capacity for t in self.lower)

    def index(self, tier: Tier) -> TierIndex:
        return self.lower[tier - 1]

    def locate(self, key: Key) -> Tier | None:
        """The lower tier holding ``key``, or None."""
        for index in self.lower:
            if key in index:
                return index.tier
        return None

    def demote(self, key: Key, nbytes: int, block: int = -1) -> list[Move]:
        """Plan the moves for a cached block the device evicts; the plan is already recorded."""
        for index in self.lower:
            if key in index:
                index.touch(key)
                return []
        return self._place(key, nbytes, Tier.DEVICE, 0, block, pinned=False)

    def can_pin(self, sizes: list[int]) -> bool:
        """Whether blocks of these sizes could all be placed pinned (e.g. a swap-out)."""
        room = [index.room() for index in self.lower]
        for nbytes in sizes:
            for level in range(len(room)):
                c = self.lower[level].charge(nbytes)
                if room[level] >= c:
                    room[level] -= c
                    break
            else:
                return False
        return True

    def charge_pinned(self, sizes: list[int]) -> int:
        """Bytes blocks of these sizes take in the host tier (for messages)."""
        return sum(self.lower[0].charge(n) for n in sizes)

    def pinned_room(self) -> int:
        return sum(max(0, index.room()) for index in self.lower)

    def place_pinned(self, key: Key, nbytes: int, block: int) -> list[Move]:
        """Copy a device block into the highest tier with room, pinned (callers check ``can_pin``)."""
        moves = self._place(key, nbytes, Tier.DEVICE, 0, block, pinned=True)
        assert moves[-1].dst is not None, "place_pinned without room: check can_pin first"
        return moves

    def _place(self, key: Key, nbytes: int, src: Tier, level: int, block: int, pinned: bool) -> list[Move]:
        while level < len(self.lower) and self.lower[level].room() < self.lower[level].charge(nbytes):
            level += 1
        if level == len(self.lower):
            if src != Tier.DEVICE:
                self.index(src).dropped += 1
            return [Move(key, src, None, block, nbytes)]
        index = self.lower[level]
        c = index.charge(nbytes)
        moves: list[Move] = []
        while index.used + c > index.capacity:
            victim, vbytes = index.pop_victim()
            moves.extend(self._place(victim, vbytes, index.tier, level + 1, -1, pinned=False))
        index.add(key, nbytes, pinned)
        moves.append(Move(key, src, index.tier, block, nbytes))
        return moves

    def pin(self, key: Key) -> None:
        for index in self.lower:
            if key in index:
                index.pin(key)
                return

    def unpin(self, key: Key) -> None:
        for index in self.lower:
            if key in index:
                index.unpin(key)
                return

    def take(self, key: Key, block: int) -> Move:
        """Take ``key`` out of its lower tier into device block ``block`` (promotion, swap-in)."""
        for index in self.lower:
            if key in index:
                nbytes = index.remove(key)
                index.blocks_out += 1
                return Move(key, index.tier, Tier.DEVICE, block, nbytes)
        raise KeyError(key)

    def promote(self, key: Key, block: int = -1) -> Tier:
        """Forget ``key`` in its lower tier (its bytes are going back up)."""
        return self.take(key, block).src

    def drop(self, key: Key) -> Move:
        """Forget ``key`` and free its bytes (a freed swapped sequence, a lost block)."""
        for index in self.lower:
            if key in index:
                nbytes = index.remove(key)
                return Move(key, index.tier, None, -1, nbytes)
        raise KeyError(key)

    def check(self) -> None:
        seen: set = set()
        for index in self.lower:
            index.check()
            keys = set(index._sizes)
            assert not (keys & seen), "a block is resident in two lower tiers"
            seen |= keys
