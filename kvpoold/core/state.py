"""The state every part of ``KVCacheManager`` works on, and the checks they share.

``KVCacheManager`` is assembled from one class per concern (``extend``,
``swap``, ``holds``, ``reserves``, ``stats``, ``invariants``), each a subclass
of ``ManagerState``: they share these fields, and each concern's methods
live in its own module.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from itertools import repeat

import numpy as np

from .block_pool import DEFAULT_CHUNK_BYTES, ChunkBudget, LayoutClass
from .errors import InvalidArgument, WrongState
from .layout import Geometry
from .results import PageTable
from .seq_table import SLOT_MASK, SeqTable
from .tiers import Key, MovePlan, Tier, TierPlacement

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


class ManagerState:
    """Block bookkeeping for a whole pool of several layout classes: the fields."""

    def __init__(
        self,
        pool_bytes: int,
        *,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        host_bytes: int = 0,
        disk_bytes: int = 0,
        policy: str = "lru",
        max_reserve_blocks: int = 1024,
        tier_align: int = 1,
        max_pool_bytes: int | None = None,
        exact_slabs: bool = False,
        remote_write: str = "",
        journal: bool = False,
    ) -> None:
        for name, value in (("pool_bytes", pool_bytes), ("chunk_bytes", chunk_bytes)):
            if type(value) is not int or value <= 0:
                raise InvalidArgument(f"{name} must be a positive integer, got {value!r}")
        if pool_bytes < chunk_bytes:
            raise InvalidArgument(f"pool_bytes ({pool_bytes}) is smaller than one chunk ({chunk_bytes})")
        if remote_write not in REMOTE_WRITES:
            raise InvalidArgument(f"remote_write must be one of {sorted(REMOTE_WRITES)}, got {remote_write!r}")
        if type(max_reserve_blocks) is not int or max_reserve_blocks < 0:
            raise InvalidArgument(f"max_reserve_blocks must be >= 0, got {max_reserve_blocks!r}")
        limit = pool_bytes if max_pool_bytes is None else max_pool_bytes
        if type(limit) is not int or limit < pool_bytes:
            raise InvalidArgument(f"max_pool_bytes must be an integer >= pool_bytes ({pool_bytes}), got {limit!r}")
        if type(exact_slabs) is not bool:
            raise InvalidArgument(f"exact_slabs must be a bool, got {exact_slabs!r}")
        self.budget = ChunkBudget(pool_bytes // chunk_bytes, chunk_bytes, limit=limit // chunk_bytes,
                                  exact_slabs=exact_slabs)
        #: "" (no remote tier), "through" (every confirmed block is copied there) or "evict" (blocks
        #: leaving the last local tier go there)
        self.remote_write = remote_write
        #: (kind, tier, class id, hashes) of what the plan does not say: device blocks stored (confirmed)
        #: and removed (evicted); drained with ``drain_journal`` (KV events).  None: not kept.
        self._journal: list | None = [] if journal else None
        self.placement = TierPlacement(host_bytes, disk_bytes, policy, tier_align,
                                       spill_remote=remote_write == "evict")
        self._track_moves = host_bytes > 0 or disk_bytes > 0 or remote_write == "evict"
        self.policy = policy
        self.max_reserve_blocks = max_reserve_blocks
        self.classes: list[LayoutClass] = []
        self._counters: list[Counters] = []
        self._class_ids: dict[Geometry, int] = {}
        self._block_size = np.zeros(0, np.int64)  # class id -> block size
        self.seqs = SeqTable()
        self._owners: dict[int, Owner] = {}
        self._moves = MovePlan()  # planned tier moves, as columns (drained by the daemon after each call)
        #: swapped-out sequences: slot -> (tier keys, block hashes or None), one each per logical block
        self._swapped: dict[int, tuple[list[Key], list[bytes | None]]] = {}
        self._next_swap = 0
        #: per class, block -> holds taken by the daemon while bytes are in flight into the block
        self._holds: list[dict[int, int]] = []

    def register_class(self, geometry: Geometry) -> int:
        """The class id of ``geometry``, creating the class on first use."""
        if not isinstance(geometry, Geometry):
            raise InvalidArgument(f"expected a Geometry, got {type(geometry).__name__}")
        cid = self._class_ids.get(geometry)
        if cid is None:
            cid = len(self.classes)
            pool = LayoutClass(cid, geometry, self.budget, self.policy, self._on_evict)
            self.classes.append(pool)
            self._counters.append(Counters())
            self._holds.append({})
            self._class_ids[geometry] = cid
            self._block_size = np.append(self._block_size, geometry.block_size)
            self.seqs.ensure_tail_width(geometry.block_size)
            if self.remote_write == "through" or self._journal is not None:
                pool.prefix.on_confirm = partial(self._confirmed, cid)
        return cid

    def _confirmed(self, class_id: int, blocks: list[int], digests: list[bytes]) -> None:
        """Blocks whose writer confirmed their KV: journaled, and copied to the remote tier (``through``)."""
        if self._journal is not None:
            self._journal.append(("stored", Tier.DEVICE, class_id, digests))
        if self.remote_write == "through":
            keys = list(zip(repeat(class_id), digests))
            self._moves.add_many(keys, Tier.DEVICE, Tier.REMOTE, blocks, self.classes[class_id].block_bytes)

    def drain_journal(self) -> list:
        """(kind, tier, class id, hashes) since the last call: device blocks "stored" and "removed"."""
        if not self._journal:
            return []
        out, self._journal = self._journal, []
        return out

    def _on_evict(self, class_id: int, blocks: list[int], digests: list[bytes]) -> None:
        """A batch of cached blocks was evicted, oldest first: demote them (one plan for the batch)."""
        if self._journal is not None:
            self._journal.append(("removed", Tier.DEVICE, class_id, digests))
        if self._track_moves:
            keys = list(zip(repeat(class_id), digests))
            placed = self.placement.demote_many(self._moves, keys, self.classes[class_id].block_bytes, blocks)
            self._counters[class_id].demoted_blocks += placed

    def class_pool(self, class_id: int) -> LayoutClass:
        if type(class_id) is not int or not 0 <= class_id < len(self.classes) \
                or self.classes[class_id].geometry is None:  # a dropped class's placeholder (``classes.VacantClass``)
            raise InvalidArgument(f"unknown layout class {class_id!r}")
        return self.classes[class_id]

    @staticmethod
    def _check_owner(owner) -> None:
        if type(owner) is not int:
            raise InvalidArgument(f"owner must be an int, got {type(owner).__name__}")

    def _owner(self, owner: int) -> Owner:
        state = self._owners.get(owner)
        if state is None:
            self._check_owner(owner)
            state = self._owners[owner] = Owner()
        return state

    def _info(self, slot: int) -> PageTable:
        t = self.seqs
        return PageTable(
            t.seq_id(slot), int(t.cls[slot]), tuple(t.blocks[slot]), int(t.ntok[slot]), int(t.num_cached[slot]),
            bool(t.swapped[slot]),
        )

    def sequence(self, owner: int, seq_id: int) -> PageTable:
        return self._info(self.seqs.slot_of(owner, seq_id))

    def _slots(self, owner: int, seq_ids: list) -> np.ndarray:
        """The slots of distinct sequence ids of ``owner``, in order (one vectorised check)."""
        if set(map(type, seq_ids)) <= {int}:
            try:
                ids = np.array(seq_ids, np.int64)
            except OverflowError:
                ids = None
            if ids is not None:
                return self.seqs.slots_of(owner, ids)
        slots = [self.seqs.slot_of(owner, i) for i in seq_ids]  # raises the precise error
        if len(set(slots)) != len(slots):
            raise InvalidArgument("a sequence appears twice in one call")
        return np.array(slots, np.int64)

    def check_free(self, owner: int, seq_ids) -> list[int]:
        """Validate a free (or another call on whole sequences) without doing it; returns the slots."""
        return self._slots(owner, list(seq_ids)).tolist()

    @staticmethod
    def _refuse_swapped(seq_id, what: str) -> None:
        raise WrongState(f"sequence {int(seq_id)} is swapped out: it cannot be {what} until it is swapped in")

    @staticmethod
    def _slot(seq_id: int) -> int:
        return seq_id & SLOT_MASK
