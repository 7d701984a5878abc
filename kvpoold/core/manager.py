"""The core's one entry point: sequences, page tables, prefix cache, reserves.

``KVCacheManager`` is pure bookkeeping: integers, token ids and hashes, no
I/O.  Every public call validates everything first and then applies, so an
error (a ``KvpoolError``) always leaves the state exactly as it was.  It is
not thread-safe: the daemon calls it under one lock.

Owners are opaque integers (the daemon's session ids).  A sequence belongs to
the owner that created or forked it; any other owner naming it gets
``NotOwner``.  A *reserve* is a set of blocks an owner holds outside any page
table: the client assigns them to its sequences locally and reports the
assignment with its next ``extend`` (claims), which is how a decode loop
calls the daemon far less than once per step.

The manager owns one part per concern and delegates each public call to it:

* ``classes.ClassRegistry``: the layout classes by id (the one writer of ``classes``);
  ``classes.ClassLifecycle``: dropping an idle class;
* ``sequences.Sequences``: create, fork, free, prefix lookups;
* ``extend.Extending``: appending tokens, copy-on-write, reserve claims;
* ``swap.Swapping``: whole sequences to the lower tiers and back (owns the swap records);
* ``holds.TransferHolds``: the daemon's holds while bytes are in flight (owns the holds);
* ``reserves.Reserves``; ``elastic.Elastic``: the pool's size (owns the idle-slab clocks);
* ``events.PoolEvents``: evictions and confirmations as tier moves and journal entries;
* ``quotas.Quotas``: what owners hold (read only);
* ``stats.collect`` and ``invariants.check_all``: read only, over the parts.

The tables parts share (page tables, owners, the tier placement, the move plan)
are objects handed to each part that needs them; ``state`` says who writes what.
"""

from __future__ import annotations

from collections import Counter
from typing import Callable, Iterable, Mapping

from . import invariants, stats
from .block_pool import DEFAULT_CHUNK_BYTES, ChunkBudget, LayoutClass
from .classes import ClassLifecycle, ClassRegistry
from .elastic import Elastic
from .errors import InvalidArgument
from .events import PoolEvents
from .extend import Extending
from .holds import TransferHolds
from .layout import Geometry
from .quotas import Quotas
from .reserves import Reserves
from .results import ExtendDeltas, ExtendItem, LookupResult, ManagerStats, PageTable, ResizeResult
from .seq_table import SeqTable
from .sequences import Sequences
from .state import REMOTE_WRITES, Owners, distinct_slots, page_table
from .swap import Swapping
from .tiers import Key, MovePlan, Tier, TierPlacement


def _check_settings(pool_bytes, chunk_bytes, max_reserve_blocks, max_pool_bytes, exact_slabs, remote_write) -> int:
    """Validate the manager's settings; returns the pool's limit in bytes."""
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
    return limit


class KVCacheManager:
    """Block bookkeeping for a whole pool of several layout classes."""

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
        limit = _check_settings(pool_bytes, chunk_bytes, max_reserve_blocks, max_pool_bytes, exact_slabs,
                                remote_write)
        self.budget = ChunkBudget(pool_bytes // chunk_bytes, chunk_bytes, limit=limit // chunk_bytes,
                                  exact_slabs=exact_slabs)
        self.remote_write = remote_write
        self.placement = TierPlacement(host_bytes, disk_bytes, policy, tier_align,
                                       spill_remote=remote_write == "evict")
        self.policy = policy
        self.seqs = SeqTable()
        self._owners = Owners()
        self._moves = MovePlan()  # planned tier moves, as columns (drained by the daemon after each call)
        self._events = PoolEvents(self.placement, self._moves, remote_write=remote_write, journal=journal,
                                  track_moves=host_bytes > 0 or disk_bytes > 0 or remote_write == "evict")
        self._registry = ClassRegistry(self.budget, policy, self.seqs, self._events)
        self.classes: list[LayoutClass] = self._registry.classes
        self._holds = TransferHolds(self._registry, self.seqs, self.placement)
        self._swaps = Swapping(self._registry, self.seqs, self.placement, self._moves)
        self._reserves = Reserves(self._registry, self._owners, max_reserve_blocks)
        self._lifecycle = ClassLifecycle(self._registry, seqs=self.seqs, owners=self._owners, holds=self._holds,
                                         placement=self.placement, moves=self._moves)
        self._sequences = Sequences(self._registry, seqs=self.seqs, owners=self._owners, placement=self.placement,
                                    moves=self._moves, events=self._events, swaps=self._swaps,
                                    reserves=self._reserves)
        self._extending = Extending(self._registry, self.seqs, self._owners)
        self._elastic = Elastic(self.budget, self.classes)
        self._quotas = Quotas(self._registry, self.seqs, self._owners)

    @property
    def max_reserve_blocks(self) -> int:
        return self._reserves.max_blocks

    @max_reserve_blocks.setter
    def max_reserve_blocks(self, blocks: int) -> None:  # the daemon's config, applied to a running pool
        self._reserves.max_blocks = blocks

    # -- classes ----------------------------------------------------------------
    def register_class(self, geometry: Geometry) -> int:
        """The class id of ``geometry``, creating the class on first use (in the lowest drained vacant id)."""
        return self._registry.register(geometry)

    def class_of(self, geometry: Geometry) -> int | None:
        """The class id of ``geometry`` if registered, else None."""
        return self._registry.class_of(geometry)

    def class_pool(self, class_id: int) -> LayoutClass:
        return self._registry.pool(class_id)

    def live_classes(self) -> list[int]:
        """The ids of the classes that exist (not dropped), in order."""
        return self._registry.live()

    def has_class(self, class_id: int) -> bool:
        """Whether ``class_id`` names a live class (not dropped, not never made)."""
        return self._registry.has(class_id)

    def holds_nothing_in(self, class_id: int) -> bool:
        """Whether no owner holds anything in class ``class_id`` (sequence, reserve or transfer hold)."""
        return self._lifecycle.holds_nothing_in(class_id)

    def can_drop_class(self, class_id: int) -> bool:
        """Whether class ``class_id`` is idle and nothing of it is cached in any tier."""
        return self._lifecycle.can_drop_class(class_id)

    def drop_class(self, class_id: int) -> None:
        """Drop an idle, uncached class: its slabs go back to the budget, its id becomes vacant."""
        self._lifecycle.drop_class(class_id)

    def evict_class(self, class_id: int) -> int:
        """Drop every cached block of an idle class on every tier; returns how many."""
        return self._lifecycle.evict_class(class_id)

    def drain_moves(self) -> MovePlan:
        """Tier moves planned since the last call, as columns (for the transfer engine)."""
        return self._moves.drain()

    def drain_journal(self) -> list:
        """(kind, tier, class id, hashes) since the last call: device blocks "stored" and "removed"."""
        return self._events.drain_journal()

    def drain_slab_changes(self) -> list[tuple[str, int, int, int]]:
        """("take" | "release", class id, byte offset, bytes) of slabs since the last call.

        The daemon commits the memory of taken slabs and releases that of
        returned ones.  A slab's range is its blocks' bytes, ``[slot * span,
        (slot + 1) * span)``: never the tail a slab's chunks hold past its last
        block, which is the next slab's first block.  A slab taken and given
        back (or the reverse) since the last call appears once, as the net
        change, so a backend never maps a slab twice nor keeps an unowned one.
        """
        out = []
        for pool in self.classes:
            taken, released = pool.drain_slab_changes()
            if not taken and not released:
                continue
            net = Counter(taken)
            net.subtract(released)
            span = pool.span
            out.extend(("release", pool.class_id, slot * span, span) for slot, n in net.items() if n < 0)
            out.extend(("take", pool.class_id, slot * span, span) for slot, n in net.items() if n > 0)
        return out

    # -- owners and sequence lookups ----------------------------------------------
    def sequence(self, owner: int, seq_id: int) -> PageTable:
        return page_table(self.seqs, self.seqs.slot_of(owner, seq_id))

    def sequences(self, owner: int) -> list[PageTable]:
        state = self._owners.get(owner)
        return [self.sequence(owner, i) for i in sorted(state.seqs)] if state else []

    def owners(self) -> dict[int, tuple[int, int]]:
        """owner -> (sequences, reserved blocks)."""
        return {
            o: (len(s.seqs), sum(len(r) for r in s.reserves.values())) for o, s in self._owners.items()
        }

    def reserve(self, owner: int, class_id: int) -> tuple[int, ...]:
        return tuple(self._owners.reserve(owner, class_id))

    def check_free(self, owner: int, seq_ids) -> list[int]:
        """Validate a free (or another call on whole sequences) without doing it; returns the slots."""
        return distinct_slots(self.seqs, owner, list(seq_ids)).tolist()

    # -- sequences --------------------------------------------------------------
    def create(
        self, owner: int, class_id: int, model_id: str, tokens, extra_key: str = "", remote=None,
        counted: bool = True,
    ) -> PageTable:
        """A new sequence holding ``tokens``; reuses the longest cached prefix (``Sequences.create``)."""
        return self._sequences.create(owner, class_id, model_id, tokens, extra_key, remote, counted=counted)

    def remote_candidates(self, class_id: int, model_id: str, tokens, extra_key: str = "",
                          owner: int | None = None) -> list[bytes]:
        """The hashes of the full blocks of ``tokens`` past its longest prefix cached on the local tiers."""
        return self._sequences.remote_candidates(class_id, model_id, tokens, extra_key, owner)

    def lookup(
        self, class_id: int, model_id: str, tokens, extra_key: str = "", owner: int | None = None, remote=None,
        known: int = 0,
    ) -> LookupResult:
        """Longest cached prefix of ``tokens`` over every tier that ``owner`` may use; allocates nothing."""
        return self._sequences.lookup(class_id, model_id, tokens, extra_key, owner, remote, known)

    def fork(self, owner: int, seq_id: int) -> PageTable:
        """A new sequence sharing every block of ``seq_id`` (copy-on-write later)."""
        return self._sequences.fork(owner, seq_id)

    def mark_written(self, owner: int, seq_ids: Iterable[int]) -> None:
        """The owner says these sequences' KV is written: their full blocks become everyone's hits."""
        self._sequences.mark_written(owner, seq_ids)

    def free(self, owner: int, seq_ids: Iterable[int], *, written: bool = True) -> int:
        """Free sequences (tail blocks first); returns how many blocks were released."""
        return self._sequences.free(owner, seq_ids, written=written)

    def drop_owner(self, owner: int) -> int:
        """Free everything an owner holds (a session ended); returns blocks released."""
        return self._sequences.drop_owner(owner)

    def extend(self, owner: int, items: Mapping[int, object] | Iterable[ExtendItem]) -> ExtendDeltas:
        """Append tokens to many sequences in one call; returns only what changed."""
        return self._extending.extend(owner, items)

    def extend_columns(self, owner: int, seq_ids, counts, tokens, claim_counts=None, claims=None, *,
                       admit: Callable[[int], None] | None = None) -> ExtendDeltas:
        """``extend`` for a batch given as flat arrays (the wire format); ``admit`` may refuse its growth."""
        return self._extending.extend_columns(owner, seq_ids, counts, tokens, claim_counts, claims, admit=admit)

    def swap_out(self, owner: int, seq_ids: Iterable[int]) -> tuple[int, int]:
        """Copy the sequences' blocks into the lower tiers and give their device blocks back."""
        return self._swaps.swap_out(owner, seq_ids)

    def swap_in(self, owner: int, seq_ids: Iterable[int]) -> list[PageTable]:
        """Bring swapped-out sequences back onto the device, possibly into other blocks."""
        return self._swaps.swap_in(owner, seq_ids)

    # -- reserves -----------------------------------------------------------------
    def grant_reserve(self, owner: int, class_id: int, target: int) -> tuple[int, ...]:
        """Top the owner's reserve up towards ``target`` blocks; returns the blocks added."""
        return self._reserves.grant_reserve(owner, class_id, target)

    def check_reserve_return(self, owner: int, class_id: int, blocks: Iterable[int] | None = None) -> list[int]:
        """Validate a reserve return without doing it; returns the blocks."""
        return self._reserves.check_reserve_return(owner, class_id, blocks)

    def return_reserve(self, owner: int, class_id: int, blocks: Iterable[int] | None = None) -> int:
        """Give reserved blocks back (all of them when ``blocks`` is None)."""
        return self._reserves.return_reserve(owner, class_id, blocks)

    # -- transfers ------------------------------------------------------------------
    def hold_blocks(self, class_id: int, blocks: Iterable[int]) -> None:
        """One more holder on each (held) block while bytes are copied into it."""
        self._holds.hold_blocks(class_id, blocks)

    def release_holds(self, class_id: int, blocks: Iterable[int]) -> None:
        self._holds.release_holds(class_id, blocks)

    def invalidate_block(self, class_id: int, block: int) -> bytes | None:
        """The bytes meant for ``block`` never arrived: its hash is forgotten; returns it."""
        return self._holds.invalidate_block(class_id, block)

    def register_block(self, owner: int, seq_id: int, block: int, digest: bytes) -> bool:
        """Give a block of ``seq_id`` its hash back: its owner was told to rewrite it."""
        return self._holds.register_block(owner, seq_id, block, digest)

    def forget_lower(self, key: Key) -> bool:
        """A lower-tier copy was lost (its write failed): forget it unless it is pinned."""
        return self._holds.forget_lower(key)

    def load_lower(self, tier: Tier, class_id: int, digest: bytes, nbytes: int) -> bool:
        """Record a prefix block found in a lower tier at start (a restart); False if it has no room."""
        return self._holds.load_lower(tier, class_id, digest, nbytes)

    # -- the pool's size --------------------------------------------------------------
    @property
    def chunk_bytes(self) -> int:
        return self.budget.chunk_bytes

    @property
    def max_pool_bytes(self) -> int:
        """The most ``resize`` may grow the pool to."""
        return self.budget.limit * self.budget.chunk_bytes

    def resize(self, pool_bytes: int) -> ResizeResult:
        """Grow or shrink the pool to ``pool_bytes`` (whole chunks), never past its limit."""
        return self._elastic.resize(pool_bytes)

    def release_idle(self, now: float, after_seconds: float) -> int:
        """Give back every slab that has been empty since at least ``after_seconds`` before ``now``."""
        return self._elastic.release_idle(now, after_seconds)

    # -- admin --------------------------------------------------------------------
    def evict_cached(self, class_id: int | None = None, max_blocks: int | None = None) -> int:
        """Drop cached (unheld) blocks, oldest first; returns how many."""
        return self._sequences.evict_cached(class_id, max_blocks)

    def stats(self) -> ManagerStats:
        return stats.collect(registry=self._registry, seqs=self.seqs, owners=self._owners,
                             swapped_slots=self._swaps.swapped, placement=self.placement, budget=self.budget)

    def check_invariants(self) -> None:
        """Assert every invariant of the bookkeeping (for tests and ``kvpoolctl check``)."""
        invariants.check_all(seqs=self.seqs, classes=self.classes, owners=self._owners, swapped=self._swaps.swapped,
                             holds=self._holds, placement=self.placement, budget=self.budget)
        self.check_class_registry()

    def check_class_registry(self) -> None:
        """Assert that ids, geometries and vacancies agree (part of ``check_invariants``)."""
        self._registry.check()
        self._lifecycle.check()

    # -- queries for quotas ----------------------------------------------------------
    def block_size(self, class_id: int) -> int:
        """Tokens per block of a layout class."""
        return self._quotas.block_size(class_id)

    def held_device_blocks(self, owner: int) -> int:
        """Device blocks in ``owner``'s page tables (ceil(tokens / block size) per sequence)."""
        return self._quotas.held_device_blocks(owner)

    def held_bytes(self, owners: Iterable[int]) -> int:
        """Device bytes ``owners`` hold: their page tables' blocks and reserves."""
        return self._quotas.held_bytes(owners)

    def device_blocks_of(self, owner: int, seq_ids: Iterable[int]) -> int:
        """Device blocks the sequences' tokens fill (what a swap-in brings back, what a free gives back)."""
        return self._quotas.device_blocks_of(owner, seq_ids)
