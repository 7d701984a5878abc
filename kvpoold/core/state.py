"""The small records the manager's parts share, and the checks they all make.

``KVCacheManager`` owns one part per concern (``sequences``, ``extend``,
``swap``, ``holds``, ``reserves``, ``elastic``, ``classes``, ``events``); each
part is handed only the tables it reads and owns the fields it writes.  The
tables two parts share are objects with one writer per field: ``SeqTable``
(page tables), ``Owners`` below (who holds which sequences and reserves),
``Counters`` (each count has the one part that counts it).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .errors import InvalidArgument, WrongState
from .results import PageTable
from .seq_table import SLOT_MASK, SeqTable

#: how blocks reach the remote tier (``remote_write``); "": there is none
REMOTE_WRITES = frozenset({"", "through", "evict"})


@dataclass
class Counters:
    """Per-class event counts, reported by ``stats``."""

    cow_copies: int = 0
    prefix_queries: int = 0
    prefix_hits: int = 0
    prefix_query_tokens: int = 0
    prefix_hit_tokens: int = 0
    promoted_blocks: int = 0
    demoted_blocks: int = 0
    swapped_out_blocks: int = 0
    swapped_in_blocks: int = 0
    lost_blocks: int = 0
    remote_hit_blocks: int = 0  # prefix hits the remote tier answered (promoted from there)

    def count_prefix_query(self, query_tokens: int, hit_tokens: int) -> None:
        self.prefix_queries += 1
        self.prefix_hits += bool(hit_tokens)
        self.prefix_query_tokens += query_tokens
        self.prefix_hit_tokens += hit_tokens


class Owner:
    __slots__ = ("seqs", "reserves")

    def __init__(self) -> None:
        self.seqs: set[int] = set()  # sequence ids
        self.reserves: dict[int, dict[int, None]] = {}  # class id -> reserved blocks, in grant order


class Owners:
    """Each owner's sequences and reserves: every change to them is a method here."""

    def __init__(self) -> None:
        self._by_id: dict[int, Owner] = {}

    # -- reads ----------------------------------------------------------------------------------
    def __contains__(self, owner) -> bool:
        return owner in self._by_id

    def __len__(self) -> int:
        return len(self._by_id)

    def get(self, owner: int) -> Owner | None:
        return self._by_id.get(owner)

    def items(self):
        return self._by_id.items()

    def values(self):
        return self._by_id.values()

    def reserve(self, owner: int, class_id: int) -> dict[int, None]:
        """``owner``'s reserved blocks of class ``class_id`` (empty if none); not to be changed by the caller."""
        state = self._by_id.get(owner)
        return state.reserves.get(class_id, {}) if state else {}

    # -- changes --------------------------------------------------------------------------------
    def _of(self, owner: int) -> Owner:
        state = self._by_id.get(owner)
        if state is None:
            check_owner(owner)
            state = self._by_id[owner] = Owner()
        return state

    def add_sequence(self, owner: int, seq_id: int) -> None:
        self._of(owner).seqs.add(seq_id)

    def remove_sequences(self, owner: int, seq_ids) -> None:
        self._by_id[owner].seqs.difference_update(map(int, seq_ids))

    def add_reserved(self, owner: int, class_id: int, blocks: list[int]) -> None:
        self._of(owner).reserves.setdefault(class_id, {}).update(dict.fromkeys(blocks))

    def take_reserved(self, owner: int, class_id: int, blocks: list[int]) -> None:
        """The blocks leave ``owner``'s reserve (into a page table, or back to the pool)."""
        if blocks:
            reserve = self._by_id[owner].reserves[class_id]
            for b in blocks:
                del reserve[b]

    def forget_class(self, class_id: int) -> None:
        """A dropped class: the (empty) reserves that returns left behind go."""
        for state in self._by_id.values():
            state.reserves.pop(class_id, None)

    def drop(self, owner: int) -> None:
        del self._by_id[owner]


def check_owner(owner) -> None:
    if type(owner) is not int:
        raise InvalidArgument(f"owner must be an int, got {type(owner).__name__}")


def page_table(seqs: SeqTable, slot: int) -> PageTable:
    """The page table of the sequence in ``slot``, as the caller sees it."""
    return PageTable(
        seqs.seq_id(slot), int(seqs.cls[slot]), tuple(seqs.blocks[slot]), int(seqs.ntok[slot]),
        int(seqs.num_cached[slot]), bool(seqs.swapped[slot]),
    )


def distinct_slots(seqs: SeqTable, owner: int, seq_ids: list) -> np.ndarray:
    """The slots of distinct sequence ids of ``owner``, in order (one vectorised check)."""
    if set(map(type, seq_ids)) <= {int}:
        try:
            ids = np.array(seq_ids, np.int64)
        except OverflowError:
            ids = None
        if ids is not None:
            return seqs.slots_of(owner, ids)
    slots = [seqs.slot_of(owner, i) for i in seq_ids]  # raises the precise error
    if len(set(slots)) != len(slots):
        raise InvalidArgument("a sequence appears twice in one call")
    return np.array(slots, np.int64)


def refuse_swapped(seq_id, what: str) -> None:
    raise WrongState(f"sequence {int(seq_id)} is swapped out: it cannot be {what} until it is swapped in")


def slot_of(seq_id: int) -> int:
    return seq_id & SLOT_MASK
