"""Where blocks live below the device, and what to demote next.

Tier 0 is the device pool itself (``LayoutClass``).  Tiers 1 (pinned host) and 2
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

Moves are recorded as columns (``MovePlan``: one row per block, no object per
block), because a demotion, promotion or swap batch is tens of thousands of
blocks and the transfer engine works on whole columns (numpy masks and
gathers); ``Move`` objects are made only when someone iterates a plan.

The bulk paths (``demote_many``, ``place_pinned_many``, ``take_many``,
``drop_many``, ``pin_many``) do the same as single-key placement applied key
by key (the reference the tests hold them to, in ``tests/core/oracle.py``),
with a few C-level dict operations and one row append per batch instead of
Python work per block: a batch of blocks of one class has one
size, so bytes are charged per batch, and the victims that make room are the
same oldest-first prefix of the LRU order that key-by-key placement would pop.
Only the row order inside a plan may differ (victims' moves come before the
batch that takes their room), and it stays an executable order.
"""

from __future__ import annotations

from array import array
from collections import Counter
from dataclasses import dataclass
from enum import IntEnum
from itertools import groupby
from operator import itemgetter

import numpy as np

from kvpool.protocol.sizes import cdiv

from .policy import DictLRU, make_policy

Key = tuple  # (class id, block hash) or (class id, swap entry number)

#: what the daemon rounds block sizes up to in the lower tiers (the disk's and O_DIRECT's unit)
TIER_ALIGN = 4096


class Tier(IntEnum):
    DEVICE = 0
    HOST = 1
    DISK = 2
    #: shared by the daemons of several machines (``kvpoold.transfer.remote``); not indexed here, since
    #: other daemons fill it: its rows are copies (device -> remote after a writer confirmed a block,
    #: a block leaving the last local tier; remote -> device on a prefix hit it answered)
    REMOTE = 3


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


#: ``MovePlan.dst`` of a drop (the bytes are freed, not moved)
DROP = -1


class MovePlan:
    """Planned moves as columns: row ``i`` moves ``keys[i]`` from ``src[i]`` to ``dst[i]``.

    ``dst`` is ``DROP`` (-1) for a drop, ``block`` the device block read or
    written (-1 otherwise), ``nbytes`` the block's size.  Rows are appended
    in plan order (an executable order); ``columns`` gives them as numpy
    arrays for the transfer engine (the numbers are kept in one
    ``array.array``, so that costs no conversion per row).  Iterating yields ``Move`` objects (made
    then: tests and tools, not the daemon's path).
    """

    __slots__ = ("keys", "_nums")

    def __init__(self) -> None:
        self.keys: list = []
        self._nums = array("q")  # src, dst, block, nbytes per row: one ``extend`` per row

    def add(self, key: Key, src: int, dst: int, block: int, nbytes: int) -> None:
        self.keys.append(key)
        self._nums.extend((src, dst, block, nbytes))

    def add_many(self, keys: list, src: int, dst: int, blocks, nbytes) -> None:
        """Rows for ``keys`` (``blocks``, ``nbytes``: a number for every row, or one per row)."""
        m = len(keys)
        if not m:
            return
        rows = np.empty((m, 4), np.int64)
        rows[:, 0] = src
        rows[:, 1] = dst
        rows[:, 2] = blocks
        rows[:, 3] = nbytes
        self.keys.extend(keys)
        self._nums.frombytes(rows.tobytes())

    @classmethod
    def of(cls, moves) -> "MovePlan":
        """A plan from ``Move`` objects (or another plan, returned as it is)."""
        if isinstance(moves, MovePlan):
            return moves
        plan = cls()
        for mv in moves:
            plan.add(mv.key, int(mv.src), DROP if mv.dst is None else int(mv.dst), mv.block, mv.nbytes)
        return plan

    def drain(self) -> "MovePlan":
        """The rows so far, as a plan of their own; this plan (which its planners keep) starts over empty."""
        out = MovePlan()
        out.keys, out._nums = self.keys, self._nums
        self.keys, self._nums = [], array("q")
        return out

    def columns(self) -> tuple[list, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(keys, src, dst, block, nbytes), the four numeric columns as int64 arrays."""
        nums = np.frombuffer(self._nums, np.int64).reshape(-1, 4) if self.keys else np.zeros((0, 4), np.int64)
        return self.keys, nums[:, 0].copy(), nums[:, 1].copy(), nums[:, 2].copy(), nums[:, 3].copy()

    def __len__(self) -> int:
        return len(self.keys)

    def __iter__(self):
        nums = self._nums
        for i, key in enumerate(self.keys):
            src, dst, block, nbytes = nums[4 * i:4 * i + 4]
            yield Move(key, Tier(src), None if dst == DROP else Tier(dst), block, nbytes)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return list(self)[i]
        i = range(len(self.keys))[i]
        src, dst, block, nbytes = self._nums[4 * i:4 * i + 4]
        return Move(self.keys[i], Tier(src), None if dst == DROP else Tier(dst), block, nbytes)

    def __repr__(self) -> str:
        return f"MovePlan({len(self)} moves)"


def _tier_policy(name: str):
    """The tier indexes' eviction order: ``DictLRU`` for LRU, else the named policy."""
    return DictLRU() if name == "lru" else make_policy(name)


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
        #: block bytes -> how many entries have that size: with one size (one layout class, the usual
        #: case) a batch's bytes are a multiplication, with no pass over its keys
        self._counts: dict[int, int] = {}
        self._order = _tier_policy(policy)  # evictable keys only
        #: class id -> entries of that class here: whether a class still has blocks is one lookup (a class
        #: with none may be dropped, ``ClassLifecycle``); kept with C-level counts per batch
        self._per_class: dict[int, int] = {}
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
        return cdiv(nbytes, self.align) * self.align

    def _one_size(self) -> int | None:
        """The size every entry has, if they all have one."""
        if len(self._counts) == 1:
            return next(iter(self._counts))
        return None

    def _count(self, nbytes: int, m: int) -> None:
        left = self._counts.get(nbytes, 0) + m
        if left:
            self._counts[nbytes] = left
        else:
            del self._counts[nbytes]

    def _count_classes(self, keys: list, sign: int) -> None:
        per = self._per_class
        for cid, m in Counter(map(itemgetter(0), keys)).items():
            left = per.get(cid, 0) + sign * m
            if left:
                per[cid] = left
            else:
                del per[cid]

    def entries_of(self, class_id: int) -> int:
        """Entries of class ``class_id`` here."""
        return self._per_class.get(class_id, 0)

    def keys_of(self, class_id: int) -> list:
        """Every key of class ``class_id`` here (a pass over the tier: for reclaiming a class, not per call)."""
        if not self._per_class.get(class_id):
            return []
        return [k for k in self._sizes if k[0] == class_id]

    def _uncount(self, sizes: list[int]) -> None:
        if not sizes:
            return
        if sizes.count(sizes[0]) == len(sizes):
            self._count(sizes[0], -len(sizes))
            return
        for n, g in groupby(sorted(sizes)):
            self._count(n, -sum(1 for _ in g))

    def room(self) -> int:
        """Charged bytes this tier could hold after evicting every evictable entry."""
        return self.capacity - self.pinned

    def is_pinned(self, key: Key) -> bool:
        return key in self._sizes and key not in self._order

    def has_all(self, keys) -> bool:
        return all(map(self._sizes.__contains__, keys))

    def has_none(self, keys) -> bool:
        return not self._sizes or self._sizes.keys().isdisjoint(keys)

    def resident(self):
        """Every key here."""
        return self._sizes.keys()

    def has_many(self, keys: list) -> np.ndarray:
        """Whether each key is here (one C-level pass)."""
        return np.fromiter(map(self._sizes.__contains__, keys), np.bool_, len(keys))

    def load(self, key: Key, nbytes: int) -> bool:
        """Record a block found here at start (a restart): not placed, so ``blocks_in`` does not count it.

        False if it is here already or there is no room.
        """
        if key in self._sizes or self.used + self.charge(nbytes) > self.capacity:
            return False
        self.add_many([key], nbytes)
        self.blocks_in -= 1
        return True

    def add_many(self, keys: list, nbytes: int, pinned: bool = False) -> None:
        """``add`` of each key, in order: blocks of one size, charged once for the batch."""
        m = len(keys)
        c = self.charge(nbytes) * m
        assert self.used + c <= self.capacity
        new = dict.fromkeys(keys, nbytes)
        before = len(self._sizes)
        self._sizes.update(new)  # the stored hashes: no key is hashed again
        assert len(new) == m and len(self._sizes) == before + m, "a key added twice"
        self._count(nbytes, m)
        self._count_classes(keys, 1)
        self.used += c
        if pinned:
            self.pinned += c
        else:
            self._order.insert_many(new)
        self.blocks_in += m

    def remove_many(self, keys: list, pinned: bool | None = None) -> list[int]:
        """``remove`` of each key (distinct keys); returns their sizes.

        ``pinned`` True: the caller knows every key is pinned (a swapped sequence's copies, blocks pinned
        for promotion), which saves a pass over the keys; None: found out here.
        """
        sizes = list(map(self._sizes.pop, keys))
        self._uncount(sizes)
        self._count_classes(keys, -1)
        total = self._charges(sizes)
        self.used -= total
        if pinned:
            self.pinned -= total
            return sizes
        evictable = self._order.present(keys)
        self._order.remove_many(evictable)
        if len(evictable) < len(keys):
            if evictable:
                size_of = dict(zip(keys, sizes))
                total -= self._charges(list(map(size_of.__getitem__, evictable)))
            self.pinned -= total
        return sizes

    def _charges(self, sizes: list[int]) -> int:
        """Bytes blocks of these sizes take here (one multiplication when they share a size)."""
        if not sizes:
            return 0
        if sizes.count(sizes[0]) == len(sizes):
            return self.charge(sizes[0]) * len(sizes)
        return sum(map(self.charge, sizes))

    def pin_many(self, keys: list) -> None:
        """``pin`` of each key (of this tier)."""
        order = self._order
        before = len(order)
        try:
            order.remove_many(keys)  # the common case: every one is evictable
            evictable = keys
        except KeyError:  # some were pinned already: the ones before the first of those went
            gone = before - len(order)
            rest = order.present(keys[gone:])
            order.remove_many(rest)
            evictable = keys[:gone] + rest
        size = self._one_size()
        if size is not None:
            self.pinned += self.charge(size) * len(evictable)
        else:
            self.pinned += self._charges(list(map(self._sizes.__getitem__, evictable)))

    def touch(self, key: Key) -> None:
        if key in self._order:
            self._order.touch(key)

    def pop_victims(self, need: int) -> tuple[list, list[int]]:
        """Pop the fewest oldest evictable entries whose charges reach ``need`` bytes: (keys, sizes).

        The same entries, in the same order, as popping the oldest one at a time until ``need`` bytes are free.
        """
        sizes, charge = self._sizes, self.charge
        got = count = 0
        one = self._one_size()
        if one is not None:  # one size: no pass over the keys to count them
            count = min(len(self._order), cdiv(need, charge(one)))
            got = count * charge(one)
        else:
            for key in self._order:
                if got >= need:
                    break
                got += charge(sizes[key])
                count += 1
        keys = self._order.victims(count)
        self.used -= got
        out = list(map(sizes.pop, keys))
        self._uncount(out)
        self._count_classes(keys, -1)
        return keys, out

    def pinned_keys(self) -> set:
        return {k for k in self._sizes if k not in self._order}

    def check(self) -> None:
        assert self.used == sum(self.charge(n) for n in self._sizes.values()) <= self.capacity, "tier bytes are off"
        assert set(self._order) <= set(self._sizes)
        assert self.pinned == sum(self.charge(n) for k, n in self._sizes.items() if k not in self._order)
        counts: dict[int, int] = {}
        for n in self._sizes.values():
            counts[n] = counts.get(n, 0) + 1
        assert counts == self._counts, "tier size counts are off"
        assert Counter(k[0] for k in self._sizes) == Counter(self._per_class), "tier class counts are off"


class TierPlacement:
    """Placement of blocks over the lower tiers (pure bookkeeping)."""

    def __init__(self, host_bytes: int = 0, disk_bytes: int = 0, policy: str = "lru", align: int = 1,
                 spill_remote: bool = False) -> None:
        #: blocks with nowhere lower to go leave the device or host tier for the remote tier, not nowhere
        self.spill_remote = spill_remote
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

    def demote_many(self, plan: MovePlan, keys: list, nbytes: int, blocks) -> int:
        """``demote`` of each key in order (blocks of one size); returns how many were placed."""
        lower = self.lower
        if all(index.has_none(keys) for index in lower):  # all new
            return self._place_many(plan, keys, nbytes, Tier.DEVICE, 0, blocks, pinned=False)
        placed = 0
        run_keys: list = []
        run_blocks: list = []
        for key, b in zip(keys, blocks):
            if run_keys and any(key in index for index in lower):
                # the keys before this one are placed first: that may push it out of the tiers
                placed += self._place_many(plan, run_keys, nbytes, Tier.DEVICE, 0, run_blocks, pinned=False)
                run_keys, run_blocks = [], []
            for index in lower:
                if key in index:
                    index.touch(key)
                    break
            else:
                run_keys.append(key)
                run_blocks.append(b)
        if run_keys:
            placed += self._place_many(plan, run_keys, nbytes, Tier.DEVICE, 0, run_blocks, pinned=False)
        return placed

    @staticmethod
    def runs(sizes) -> list[tuple[int, int]]:
        """(size, count) of each run of equal sizes, in order."""
        if isinstance(sizes, list) and sizes and sizes.count(sizes[0]) == len(sizes):
            return [(sizes[0], len(sizes))]  # one size: no Python step per block
        return [(n, sum(1 for _ in g)) for n, g in groupby(sizes)]

    def can_pin_runs(self, runs: list[tuple[int, int]]) -> bool:
        """Whether ``count`` blocks of ``nbytes`` for each (nbytes, count), in order, could all be placed pinned."""
        room = [index.room() for index in self.lower]
        for nbytes, count in runs:
            for level, index in enumerate(self.lower):  # the highest tier first, as placement goes
                c = index.charge(nbytes)
                k = min(count, max(0, room[level]) // c)
                room[level] -= k * c
                count -= k
            if count:
                return False
        return True

    def charge_pinned_runs(self, runs: list[tuple[int, int]]) -> int:
        return sum(self.lower[0].charge(n) * count for n, count in runs)

    def pinned_room(self) -> int:
        return sum(max(0, index.room()) for index in self.lower)

    def place_pinned_many(self, plan: MovePlan, keys: list, nbytes: int, blocks) -> list[int]:
        """Copy device blocks (of one size) into the highest tiers with room, pinned, in order (callers check
        ``can_pin_runs``); returns blocks placed per lower tier."""
        tally = [0] * len(self.lower)
        placed = self._place_many(plan, keys, nbytes, Tier.DEVICE, 0, blocks, pinned=True, tally=tally)
        assert placed == len(keys), "place_pinned_many without room: check can_pin_runs first"
        return tally

    def _place_many(self, plan: MovePlan, keys: list, nbytes: int, src: Tier, level: int, blocks, pinned: bool,
                    tally: list[int] | None = None) -> int:
        """Place each key (one size; ``blocks`` a list or one number) at ``level`` or below, in order, moving
        victims one tier down to make room; returns how many were placed (not dropped).

        A chunk of ``room // charge`` keys fits in one tier once every evictable entry there is gone, so the
        victims that key-by-key placement pops for it are a prefix of the entries present before the chunk:
        they are popped at once, placed below (in runs of one size), and the chunk added at once.
        """
        lower = self.lower
        m = len(keys)
        start = placed = 0
        one = not isinstance(blocks, list)
        while start < m:
            while level < len(lower) and lower[level].room() < lower[level].charge(nbytes):
                level += 1
            if level == len(lower):
                rest = keys[start:] if start else keys
                if src != Tier.DEVICE:
                    self.index(src).dropped += len(rest)
                dst = Tier.REMOTE if self.spill_remote and src in (Tier.DEVICE, Tier.HOST) else DROP
                plan.add_many(rest, src, dst, blocks if one else blocks[start:], nbytes)
                return placed
            index = lower[level]
            c = index.charge(nbytes)
            k = min(m - start, index.room() // c)
            need = index.used + k * c - index.capacity
            if need > 0:
                vkeys, vsizes = index.pop_victims(need)
                i = 0
                for vbytes, count in self.runs(vsizes):
                    self._place_many(plan, vkeys[i:i + count], vbytes, index.tier, level + 1, -1, pinned=False)
                    i += count
            chunk = keys if k == m else keys[start:start + k]
            index.add_many(chunk, nbytes, pinned=pinned)
            plan.add_many(chunk, src, index.tier, blocks if one or k == m else blocks[start:start + k], nbytes)
            if tally is not None:
                tally[level] += k
            placed += k
            start += k
        return placed

    def _by_index(self, keys: list) -> list[tuple[TierIndex, list]]:
        """The keys in runs of one lower tier each, in order (KeyError for a key in none)."""
        for index in self.lower:  # the common case: all in one tier
            if index.has_all(keys):
                return [(index, keys)] if keys else []
        out: list[tuple[TierIndex, list]] = []
        for key in keys:
            for index in self.lower:
                if key in index:
                    break
            else:
                raise KeyError(key)
            if out and out[-1][0] is index:
                out[-1][1].append(key)
            else:
                out.append((index, [key]))
        return out

    def pin_many(self, keys: list, holder: TierIndex | None = None) -> list[tuple[TierIndex, list]]:
        """``pin`` of each key (every one in a lower tier); returns them in runs of one tier (for ``take_many``).

        ``holder``: the lower tier the caller found every key in (it looked them up already).
        """
        runs = self._by_index(keys) if holder is None else [(holder, keys)] if keys else []
        for index, run in runs:
            index.pin_many(run)
        return runs

    def take_many(self, plan: MovePlan, keys: list, blocks: list[int], pinned: bool | None = None,
                  runs: list[tuple[TierIndex, list]] | None = None) -> None:
        """``take`` of each key into the device block at the same position.

        ``pinned`` True: every key is pinned (see ``TierIndex.remove_many``); ``runs``: ``pin_many``'s answer
        for these keys.
        """
        i = 0
        for index, run in self._by_index(keys) if runs is None else runs:
            sizes = index.remove_many(run, pinned=pinned)
            index.blocks_out += len(run)
            plan.add_many(run, index.tier, Tier.DEVICE, blocks[i:i + len(run)], sizes)
            i += len(run)

    def drop_many(self, plan: MovePlan | None, keys: list, pinned: bool | None = None) -> None:
        """``drop`` of each key (``pinned`` as for ``take_many``)."""
        for index, run in self._by_index(keys):
            sizes = index.remove_many(run, pinned=pinned)
            if plan is not None:
                plan.add_many(run, index.tier, DROP, -1, sizes)

    def entries_of(self, class_id: int) -> int:
        """Entries of class ``class_id`` in every lower tier (one lookup per tier)."""
        return sum(index.entries_of(class_id) for index in self.lower)

    def forget(self, key: Key) -> bool:
        """Forget an evictable key whose bytes were lost (counted as dropped); False if pinned or absent."""
        tier = self.locate(key)
        if tier is None or self.index(tier).is_pinned(key):
            return False
        index = self.index(tier)
        index.remove_many([key])
        index.dropped += 1
        return True

    def check(self) -> None:
        seen: set = set()
        for index in self.lower:
            index.check()
            keys = set(index.resident())
            assert not (keys & seen), "a block is resident in two lower tiers"
            seen |= keys
