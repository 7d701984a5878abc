"""Sequences as a struct of arrays, so that a whole batch is checked at once.

A decode step touches every running sequence; per-sequence Python objects
would make that cost a microsecond or more each.  Here the per-sequence
scalars live in numpy columns indexed by a *slot*, and a batch of sequence
ids is validated and advanced with a handful of vectorised operations.  Only
page tables (``blocks``) and hash-chain heads stay Python objects: they change
once per ``block_size`` tokens.

A sequence id is ``generation << 32 | slot``.  Freeing a sequence bumps its
slot's generation, so a stale id is recognised ("already freed") and can
never name the slot's next tenant.
"""

from __future__ import annotations

from collections import deque
from itertools import chain, repeat

import numpy as np

from .errors import InvalidArgument, NotOwner, UnknownSequence

SLOT_BITS = 32
SLOT_MASK = (1 << SLOT_BITS) - 1
NO_OWNER = -1

_ARANGE = np.arange(4096, dtype=np.int64)


def _arange(n: int) -> np.ndarray:
    return _ARANGE[:n] if n <= len(_ARANGE) else np.arange(n, dtype=np.int64)


class SeqTable:
    def __init__(self, capacity: int = 256, tail_width: int = 16) -> None:
        self.owner = np.full(capacity, NO_OWNER, np.int64)
        self.gen = np.zeros(capacity, np.int64)
        #: the live sequence id of each slot, -1 when free: one compare checks id, slot and generation
        self.current = np.full(capacity, -1, np.int64)
        self.cls = np.zeros(capacity, np.int32)
        self.ntok = np.zeros(capacity, np.int64)
        #: the partly filled last block may be shared (set by fork; cleared lazily)
        self.maybe_shared = np.zeros(capacity, np.bool_)
        self.flagged = 0  # how many slots have maybe_shared set: 0 lets a batch skip the check
        #: tokens of the partly filled last block, little-endian uint32
        self.tail = np.zeros((capacity, tail_width), "<u4")
        self.num_cached = np.zeros(capacity, np.int64)
        #: swapped out (tiers): the page table is empty, the blocks live in a lower tier
        self.swapped = np.zeros(capacity, np.bool_)
        self.nswapped = 0  # how many slots are swapped out: 0 lets a batch skip the check
        self.blocks: list[list[int] | None] = [None] * capacity
        #: blocks this sequence hashed whose KV its owner has not confirmed (its next call does)
        self.unconfirmed: list[list[int] | None] = [None] * capacity
        self.has_unconfirmed = np.zeros(capacity, np.bool_)
        self.n_unconfirmed = 0  # slots with unconfirmed blocks: 0 lets a batch skip the check
        self.last_hash: list[bytes | None] = [None] * capacity
        self._free = list(range(capacity - 1, -1, -1))
        self._mark = np.full(capacity, -1, np.int64)  # scratch for duplicate checks
        self.live = 0

    @property
    def capacity(self) -> int:
        return len(self.owner)

    def ensure_tail_width(self, width: int) -> None:
        if width > self.tail.shape[1]:
            wider = np.zeros((self.capacity, width), "<u4")
            wider[:, : self.tail.shape[1]] = self.tail
            self.tail = wider

    def _grow(self) -> None:
        old = self.capacity
        new = old * 2

        def widen(a, fill):
            out = np.full((new,) + a.shape[1:], fill, a.dtype)
            out[:old] = a
            return out

        self.owner = widen(self.owner, NO_OWNER)
        self.gen = widen(self.gen, 0)
        self.current = widen(self.current, -1)
        self.cls = widen(self.cls, 0)
        self.ntok = widen(self.ntok, 0)
        self.maybe_shared = widen(self.maybe_shared, False)
        self.tail = widen(self.tail, 0)
        self.num_cached = widen(self.num_cached, 0)
        self.swapped = widen(self.swapped, False)
        self._mark = widen(self._mark, -1)
        self.blocks.extend([None] * old)
        self.unconfirmed.extend([None] * old)
        self.has_unconfirmed = widen(self.has_unconfirmed, False)
        self.last_hash.extend([None] * old)
        self._free.extend(range(new - 1, old - 1, -1))

    # -- lifecycle ------------------------------------------------------------------
    def add(self, owner: int, cls: int, blocks: list[int], ntok: int, last_hash: bytes, num_cached: int = 0) -> int:
        """Place a new sequence; returns its id.  The caller fills the tail row."""
        if not self._free:
            self._grow()
        slot = self._free.pop()
        self.owner[slot] = owner
        self.cls[slot] = cls
        self.ntok[slot] = ntok
        self.maybe_shared[slot] = False
        self.num_cached[slot] = num_cached
        self.blocks[slot] = blocks
        self.last_hash[slot] = last_hash
        self.live += 1
        seq_id = int(self.gen[slot]) << SLOT_BITS | slot
        self.current[slot] = seq_id
        return seq_id

    def flag_shared(self, slot: int) -> None:
        if not self.maybe_shared[slot]:
            self.maybe_shared[slot] = True
            self.flagged += 1

    def unflag_shared(self, slots: np.ndarray) -> None:
        if self.flagged:
            self.flagged -= int(np.count_nonzero(self.maybe_shared[slots]))
            self.maybe_shared[slots] = False

    def set_swapped(self, slot: int, swapped: bool) -> None:
        if bool(self.swapped[slot]) != swapped:
            self.swapped[slot] = swapped
            self.nswapped += 1 if swapped else -1

    def add_unconfirmed(self, slot: int, block: int) -> None:
        lst = self.unconfirmed[slot]
        if lst is None:
            self.unconfirmed[slot] = [block]
            self.has_unconfirmed[slot] = True
            self.n_unconfirmed += 1
        else:
            lst.append(block)

    def add_unconfirmed_many(self, slot: int, blocks: list[int]) -> None:
        """``add_unconfirmed`` of each block, in order."""
        if not blocks:
            return
        lst = self.unconfirmed[slot]
        if lst is None:
            self.unconfirmed[slot] = list(blocks)
            self.has_unconfirmed[slot] = True
            self.n_unconfirmed += 1
        else:
            lst.extend(blocks)

    def add_unconfirmed_each(self, slots: list[int], blocks: list[int]) -> None:
        """``add_unconfirmed`` of each (slot, block) pair, in order."""
        unconfirmed, newly = self.unconfirmed, []
        for slot, b in zip(slots, blocks):
            lst = unconfirmed[slot]
            if lst is None:
                unconfirmed[slot] = [b]
                newly.append(slot)
            else:
                lst.append(b)
        if newly:
            self.has_unconfirmed[newly] = True
            self.n_unconfirmed += len(newly)

    def take_unconfirmed_many(self, slots: np.ndarray) -> list[int]:
        """The slots' unconfirmed blocks (slot by slot, in order), now cleared."""
        if not self.n_unconfirmed:
            return []
        pending = slots[self.has_unconfirmed[slots]].tolist()
        if not pending:
            return []
        unconfirmed = self.unconfirmed
        out = list(chain.from_iterable(map(unconfirmed.__getitem__, pending)))
        deque(map(unconfirmed.__setitem__, pending, repeat(None)), 0)
        self.has_unconfirmed[pending] = False
        self.n_unconfirmed -= len(pending)
        return out

    def blocks_tail_first(self, slots: list[int]) -> list[int]:
        """The slots' page tables, each reversed, one after the other."""
        return list(chain.from_iterable(map(reversed, map(self.blocks.__getitem__, slots))))

    def take_unconfirmed(self, slot: int) -> list[int]:
        """The slot's unconfirmed blocks, now cleared."""
        lst = self.unconfirmed[slot]
        if lst is None:
            return []
        self.unconfirmed[slot] = None
        self.has_unconfirmed[slot] = False
        self.n_unconfirmed -= 1
        return lst

    def remove(self, slot: int) -> None:
        self.take_unconfirmed(slot)  # the manager confirmed or forgot them first
        self.unflag_shared(np.array([slot]))
        self.set_swapped(slot, swapped=False)
        self.owner[slot] = NO_OWNER
        self.current[slot] = -1
        self.gen[slot] += 1
        self.blocks[slot] = None
        self.last_hash[slot] = None
        self._free.append(slot)
        self.live -= 1

    def remove_many(self, slots: np.ndarray) -> None:
        """``remove`` of each slot (distinct live slots), in order."""
        self.take_unconfirmed_many(slots)  # the manager confirmed or forgot them first
        self.unflag_shared(slots)
        if self.nswapped:
            self.nswapped -= int(np.count_nonzero(self.swapped[slots]))
            self.swapped[slots] = False
        self.owner[slots] = NO_OWNER
        self.current[slots] = -1
        self.gen[slots] += 1
        listed = slots.tolist()
        deque(map(self.blocks.__setitem__, listed, repeat(None)), 0)
        deque(map(self.last_hash.__setitem__, listed, repeat(None)), 0)
        self._free.extend(listed)
        self.live -= len(listed)

    # -- resolving ids ------------------------------------------------------------------
    def slot_of(self, owner: int, seq_id) -> int:
        """The slot of one sequence id, or a typed error naming what is wrong."""
        if type(seq_id) is not int:
            if isinstance(seq_id, np.integer):
                seq_id = int(seq_id)
            else:
                raise InvalidArgument(f"sequence ids are integers, got {type(seq_id).__name__}")
        if seq_id < 0:
            raise UnknownSequence(f"sequence {seq_id} does not exist")
        slot, gen = seq_id & SLOT_MASK, seq_id >> SLOT_BITS
        if slot >= self.capacity or gen > self.gen[slot] or (
            gen == self.gen[slot] and self.owner[slot] == NO_OWNER
        ):
            raise UnknownSequence(f"sequence {seq_id} does not exist")
        if gen < self.gen[slot]:
            raise UnknownSequence(f"sequence {seq_id} was already freed")
        if self.owner[slot] != owner:
            raise NotOwner(f"sequence {seq_id} belongs to another session")
        return slot

    def slots_of(self, owner: int, seq_ids: np.ndarray) -> np.ndarray:
        """Slots of a batch of ids: all valid, all the owner's, no duplicates."""
        slots = seq_ids & SLOT_MASK
        # an out-of-range slot is clipped to another slot, whose id cannot match
        ok = self.current.take(slots, mode="clip") == seq_ids
        ok &= self.owner.take(slots, mode="clip") == owner
        if not ok.all():
            self.slot_of(owner, int(seq_ids[np.flatnonzero(~ok)[0]]))  # raises the precise error
            raise AssertionError("unreachable")  # pragma: no cover
        order = _arange(len(slots))
        mark = self._mark
        mark[slots] = order  # with a duplicate, the later position wins...
        if not (mark[slots] == order).all():  # ...and the earlier one sees it
            first = int(np.flatnonzero(mark[slots] != order)[0])
            raise InvalidArgument(f"sequence {int(seq_ids[first])} appears twice in one call")
        return slots

    def seq_id(self, slot: int) -> int:
        return int(self.gen[slot]) << SLOT_BITS | slot

    def live_slots(self) -> np.ndarray:
        return np.flatnonzero(self.owner != NO_OWNER)
