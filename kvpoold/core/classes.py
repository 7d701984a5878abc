"""Layout classes' lifecycle: dropping a class nobody uses, and reusing its id.

A daemon that sees many distinct geometries over its life (models come and go)
must not keep a class, its id space and its memory for each one forever.  A
class may be *dropped* once nothing of it is left: no owner holds anything in
it (sequence, reserve, transfer hold) and no block of it is cached in any tier.
Its slabs go back to the budget (reported as "release" by ``drain_slab_changes``)
and its id becomes *vacant*; the next new geometry takes the lowest vacant id,
so ``classes`` never grows beyond the most classes alive at once.

A vacant id's slot in ``classes`` holds a ``VacantClass``: an empty class (no
slabs, no blocks, no hashes) rather than None, so that every loop over
``classes`` (slab changes, eviction, invariants, elastic resizing) stays
correct without a check; ``class_pool`` refuses it like an unknown id and
``stats`` leaves it out.  An id is reused only after its releases were
drained, so a release of the old class is never applied to the new one's memory.
"""

from __future__ import annotations

from functools import partial

import numpy as np

from .block_pool import ChunkBudget, LayoutClass
from .errors import InvalidArgument, WrongState
from .events import PoolEvents
from .layout import Geometry
from .prefix_index import PrefixIndex
from .policy import make_policy
from .seq_table import SeqTable
from .state import Counters, Owners
from .tiers import MovePlan, TierPlacement


class VacantClass:
    """What a dropped class leaves in ``classes`` until its id is reused: no memory, no blocks.

    It still reports, once, the slabs the dropped class gave back (``drain_slab_changes``).
    """

    geometry = None
    block_size = 0
    slab_chunks = 0
    num_block_ids = 0
    total_blocks = 0
    held_blocks = 0
    evictions = 0

    def __init__(self, class_id: int, released: list[int], dropped: LayoutClass) -> None:
        self.class_id = class_id
        # the offsets of the released slots are the dropped class's: ``drain_slab_changes`` computes them
        self.blocks_per_slab = dropped.blocks_per_slab
        self.block_bytes = dropped.block_bytes
        self.slab_bytes = dropped.slab_bytes
        self.span = dropped.span
        self.num_block_ids = dropped.num_block_ids  # the released ranges lie in the dropped class's id space
        self.released_slabs = 0
        self.released = released
        self.free: list[int] = []
        self.cached = make_policy("lru")
        self.extra: dict[int, int] = {}
        self.prefix = PrefixIndex()
        self.slots: set[int] = set()

    @property
    def drained(self) -> bool:
        return not self.released

    def drain_slab_changes(self) -> tuple[list[int], list[int]]:
        out, self.released = self.released, []
        return [], out

    def drop_cached(self, max_blocks: int | None = None) -> int:
        return 0

    def slabs_to_give(self, evict: bool) -> int:
        return 0

    def check(self) -> dict[int, int]:
        assert not (self.free or len(self.cached) or self.extra or len(self.prefix) or self.slots), (
            f"vacant class {self.class_id} holds blocks")
        return {}


class ClassRegistry:
    """The layout classes by id: the one writer of ``classes``, their counters, ids and block sizes.

    A new geometry takes the lowest drained vacant id, else the next one; ``vacate`` leaves a
    ``VacantClass`` in a dropped class's place.
    """

    def __init__(self, budget: ChunkBudget, policy: str, seqs: SeqTable, events: PoolEvents) -> None:
        self._budget = budget
        self._policy = policy
        self._seqs = seqs
        self._events = events
        self.classes: list[LayoutClass] = []
        self.counters: list[Counters] = []
        self._ids: dict[Geometry, int] = {}
        self.block_size = np.zeros(0, np.int64)  # class id -> block size

    def register(self, geometry: Geometry) -> int:
        """The class id of ``geometry``, creating the class on first use (in the lowest drained vacant id).

        Args:
            geometry: the layout (with its tenant).
        Returns:
            The class id.
        """
        if not isinstance(geometry, Geometry):
            raise InvalidArgument(f"expected a Geometry, got {type(geometry).__name__}")
        cid = self._ids.get(geometry)
        if cid is not None:
            return cid
        cid = self._reusable_id()
        new_id = cid is None
        if new_id:
            cid = len(self.classes)
        pool = LayoutClass(cid, geometry, self._budget, self._policy, self._evicted)  # may refuse: nothing changed
        if self._events.follows_confirmations:
            pool.prefix.on_confirm = partial(self._events.confirmed, pool)
        if new_id:
            self.classes.append(pool)
            self.counters.append(Counters())
            self.block_size = np.append(self.block_size, geometry.block_size)
        else:
            self.classes[cid] = pool
            self.counters[cid] = Counters()
            self.block_size[cid] = geometry.block_size
        self._ids[geometry] = cid
        self._seqs.ensure_tail_width(geometry.block_size)
        return cid

    def _evicted(self, class_id: int, blocks: list[int], digests: list[bytes]) -> None:
        self._events.evicted(self.classes[class_id], self.counters[class_id], blocks, digests)

    def _reusable_id(self) -> int | None:
        ids = [c for c, pool in enumerate(self.classes) if isinstance(pool, VacantClass) and pool.drained]
        return ids[0] if ids else None

    def vacate(self, class_id: int) -> None:
        """Drop the class: its slabs go back to the budget, its id becomes vacant (reused once drained)."""
        pool = self.classes[class_id]
        released = pool.released + sorted(pool.slots)  # slabs taken and not yet committed need no release
        self._budget.free += len(pool.slots) * pool.slab_chunks
        self._budget.classes.remove(pool)
        del self._ids[pool.geometry]
        self.classes[class_id] = VacantClass(class_id, released, pool)
        self.counters[class_id] = Counters()

    # -- queries -------------------------------------------------------------------------------
    def class_of(self, geometry: Geometry) -> int | None:
        """The class id of ``geometry`` if registered, else None."""
        return self._ids.get(geometry)

    def pool(self, class_id: int) -> LayoutClass:
        """The live class ``class_id``; ``InvalidArgument`` for any other id."""
        if type(class_id) is not int or not 0 <= class_id < len(self.classes) \
                or self.classes[class_id].geometry is None:  # a dropped class's placeholder (``VacantClass``)
            raise InvalidArgument(f"unknown layout class {class_id!r}")
        return self.classes[class_id]

    def live(self) -> list[int]:
        """The ids of the classes that exist (not dropped), in order."""
        return [c for c, pool in enumerate(self.classes) if not isinstance(pool, VacantClass)]

    def has(self, class_id: int) -> bool:
        """Whether ``class_id`` names a live class (not dropped, not never made)."""
        return type(class_id) is int and 0 <= class_id < len(self.classes) and \
            not isinstance(self.classes[class_id], VacantClass)

    def check(self) -> None:
        """Assert that ids, geometries and vacancies agree."""
        live = self.live()
        assert sorted(self._ids.values()) == live, "class ids and live classes differ"
        for cid in live:
            pool = self.classes[cid]
            assert pool.class_id == cid and self._ids[pool.geometry] == cid, f"class {cid} is misfiled"
        assert len(self.classes) == len(self.counters) == len(self.block_size)
        assert sorted(map(id, self._budget.classes)) == sorted(id(self.classes[c]) for c in live), (
            "the budget's classes differ from the live ones")


class ClassLifecycle:
    """``can_drop_class`` / ``drop_class`` and ``evict_class``: when a class may go, and its going."""

    def __init__(self, registry: ClassRegistry, *, seqs: SeqTable, owners: Owners, holds, placement: TierPlacement,
                 moves: MovePlan) -> None:
        self._registry = registry
        self._seqs = seqs
        self._owners = owners
        self._holds = holds  # ``holds.TransferHolds``: whether the daemon holds blocks of a class
        self._placement = placement
        self._moves = moves

    def holds_nothing_in(self, class_id: int) -> bool:
        """Whether no owner holds anything in class ``class_id``: no sequence (swapped out or not), reserve
        or transfer hold.  Cheap checks first: the whole-table ones run only when those pass.

        Args:
            class_id: a live class.
        Returns:
            True if the class is idle.
        """
        pool = self._registry.pool(class_id)
        if pool.held_blocks or self._holds.held_in(class_id):
            return False
        if any(state.reserves.get(class_id) for state in self._owners.values()):
            return False
        t = self._seqs
        return not (t.live and bool(np.any(t.cls[t.live_slots()] == class_id)))

    def can_drop_class(self, class_id: int) -> bool:
        """Whether class ``class_id`` may be dropped: idle (``holds_nothing_in``) and nothing of it cached in any tier.

        Args:
            class_id: a live class.
        Returns:
            True if ``drop_class`` would succeed.
        """
        pool = self._registry.pool(class_id)
        if len(pool.prefix) or len(pool.cached) or self._placement.entries_of(class_id):
            return False
        return self.holds_nothing_in(class_id)

    def drop_class(self, class_id: int) -> None:
        """Drop class ``class_id``: its slabs go back to the budget, its id becomes vacant.

        The released slabs are reported by the next ``drain_slab_changes``; the id is reused once they were.

        Args:
            class_id: a class for which ``can_drop_class`` is true.
        Raises:
            InvalidArgument: no such class.  WrongState: the class is still used.
        """
        if not self.can_drop_class(class_id):
            raise WrongState(f"layout class {class_id} is still in use (sequences, reserves or cached blocks)")
        self._owners.forget_class(class_id)
        self._registry.vacate(class_id)

    def evict_class(self, class_id: int) -> int:
        """Drop every cached block of an idle class, on the device and in the lower tiers (no demotion):
        what makes it droppable when a cap needs its room.

        Args:
            class_id: a live class that no owner holds anything in.
        Returns:
            How many blocks were dropped.
        Raises:
            InvalidArgument: no such class.  WrongState: an owner still holds something in it.
        """
        if not self.holds_nothing_in(class_id):
            raise WrongState(f"layout class {class_id} is in use: only an idle class's cache is dropped whole")
        pool = self._registry.classes[class_id]
        blocks = pool.cached.victims(len(pool.cached))
        pool.prefix.forget_many(blocks)
        pool.evictions += len(blocks)
        pool.free.extend(blocks)
        dropped = len(blocks)
        for index in self._placement.lower:
            keys = index.keys_of(class_id)
            if keys:
                self._placement.drop_many(self._moves, keys)
                index.dropped += len(keys)
                dropped += len(keys)
        return dropped

    def check(self) -> None:
        """Assert that no vacant class is held or cached (part of ``check_invariants``)."""
        for cid, pool in enumerate(self._registry.classes):
            if isinstance(pool, VacantClass):
                assert not self._holds.held_in(cid) and not self._placement.entries_of(cid), (
                    f"vacant class {cid} is used")


__all__ = ["ClassLifecycle", "ClassRegistry", "VacantClass"]
