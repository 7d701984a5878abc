"""One device's memory: ``DevicePool``.

A CUDA daemon started with ``--devices 0,1`` owns one ``DevicePool`` per
GPU: its own backend (the device allocations on that GPU), its own
``KVCacheManager``, arenas per layout class and tiers (pinned host memory,
its own disk directory).  Pools share nothing but the session registry, so a
prefix cached on GPU 0 is no hit on GPU 1: its bytes are on the other device.
The CPU backend always has exactly one pool (``--devices`` means nothing there).
Which pool a session uses, and the pools together: ``devices.py``.

A pool is made of parts that each do one job and know only the core (and the
live configuration, through a callable, where they read it): ``Quotas`` and
``Limits`` (checked before the core allocates), ``ClassSessions`` (which
classes are in use), and the tiers: ``Tiers`` (the transfer engine),
``InFlight`` (blocks whose bytes are arriving), ``Pending`` (sequences
waiting for them) and ``RemoteLookups`` (the remote tier).
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from dataclasses import replace

from kvpoold.config import Config
from kvpoold.core import Geometry, InvalidArgument, KVCacheManager
from kvpoold.core.block_pool import choose_slab_chunks
from kvpool.protocol import ArenaDescriptor
from kvpool.protocol.stats import DeviceStats
from kvpoold.memory import Arena, Backend
from kvpoold.transfer.remote import RemoteLink, RemoteStore

from .calls import PoolResize
from .classes import ClassSessions
from .events import EventBus
from .limits import Limits
from .quotas import Quotas
from .tier_inflight import InFlight
from .tier_pending import Pending
from .tier_remote import RemoteLookups
from .tiers import TIER_ALIGN, Tiers, layout_dict

log = logging.getLogger("kvpoold")


def normalize_bus_id(bus: str) -> str:
    """``0000:3b:00.0`` and ``3B:00.0`` -> ``0000:3B:00.0`` (what CUDA calls the device)."""
    bus = bus.strip().upper()
    if bus and bus.count(":") == 1:
        bus = "0000:" + bus
    return bus


def max_pool_bytes(backend: Backend, pool_bytes: int) -> int:
    """How far ``kvpoolctl resize`` may grow the pool: the GPU's memory with VMM, else its size at start."""
    most = getattr(backend, "max_pool_bytes", None)
    return max(pool_bytes, most()) if most is not None else pool_bytes


class DevicePool:
    """One device's memory: backend, core, arenas per layout class, tiers.

    Everything is called from the event loop; ``config`` is the daemon's
    live configuration (the service replaces it on SIGHUP).
    """

    def __init__(self, config: Config, backend: Backend, pool_bytes: int, *, index: int = 0,
                 device: int = -1, bus_id: str | None = None, disk_dir: str | None = None,
                 remote: RemoteStore | None = None, events: EventBus | None = None) -> None:
        """``remote``: the daemon's ``RemoteStore`` (tier 3, shared by its pools), or None; ``events``:
        the daemon's KV events, which this pool reports its blocks' changes to."""
        self.config = config
        self.backend = backend
        self.index = index  # position in --devices
        self.device = device  # the daemon's CUDA ordinal; -1 on the CPU backend
        self.bus_id = normalize_bus_id(getattr(backend, "bus_id", "") if bus_id is None else bus_id)
        self.pool_bytes = pool_bytes
        self.manager = KVCacheManager(
            pool_bytes,
            chunk_bytes=getattr(backend, "chunk_bytes", config.chunk_bytes),
            host_bytes=config.host_bytes,
            disk_bytes=config.disk_bytes,
            policy=config.eviction_policy,
            max_reserve_blocks=config.max_reserve_blocks,
            tier_align=TIER_ALIGN,
            exact_slabs=backend.exact_slabs,
            max_pool_bytes=max_pool_bytes(backend, pool_bytes),
            remote_write=config.remote_write if remote is not None else "",
            journal=events is not None,
        )
        link = RemoteLink(remote) if remote is not None else None  # this pool's classes in the remote tier
        inflight = InFlight(self.manager)  # device blocks whose bytes are still arriving
        self.tiers = Tiers(config, self.manager, inflight, backend.name, device=device if device >= 0 else None,
                           disk_dir=disk_dir, remote=link)  # host, disk and remote tiers, transfers
        self.pending = Pending(self.manager, inflight)  # sequences returned while their bytes arrive
        self.remote = RemoteLookups(self.manager, link)
        self.events = events
        if events is not None:
            self.tiers.on_moves = self._report
        self.arenas: dict[int, Arena] = {}
        #: class id -> {"commit": s, "release": s}: the time its slabs took to back and to let go (stats)
        self.slab_seconds: dict[int, dict[str, float]] = defaultdict(lambda: {"commit": 0.0, "release": 0.0})
        self.free_seconds = 0.0  # giving memory no class uses back (vmm: to the GPU), for the stats
        self.models: dict[int, set[str]] = {}
        # per-session quota, per-user share, checked before the core allocates
        self.quotas = Quotas(self.manager, self._live_config)
        self.limits = Limits(self.manager, self._live_config)  # sequences per session, tokens per call
        self.sessions = 0  # bound to this pool now
        # sessions per class; reclaims unused classes, enforces the caps
        self.classes = ClassSessions(self.manager, self.name, close_class=self.close_class,
                                     sync_memory=self.sync_memory)
        self.on_remap = lambda session_ids: None  # the service tells those clients to sync their chunks
        if hasattr(backend, "ledger"):
            backend.notify = lambda viewers: self.on_remap(viewers)

    def _live_config(self) -> Config:
        """The configuration now: SIGHUP replaces it, so the parts that check live settings ask each time."""
        return self.config

    @property
    def name(self) -> str:
        """For operators: ``cuda:1 (0000:3B:00.0)``, or ``cpu``."""
        if self.device < 0:
            return self.backend.name
        return f"cuda:{self.device}" + (f" ({self.bus_id})" if self.bus_id else "")

    # -- memory -----------------------------------------------------------------
    def sync_memory(self) -> list:
        """After every state change: run the planned tier copies and commit/release slabs.

        Device reads (demotions, swap-outs) finish first, then slabs are
        committed and released, then device writes (promotions, swap-ins)
        start; those still in flight are returned (``tiers.Tiers.sync``).
        """

        try:
            started = self.tiers.sync(self._apply_slab_changes)
        finally:
            if self.events is not None:
                journal = self.manager.drain_journal()
                if journal:
                    self.events.report(journal, None, self._describe, self.index)
        if self.classes.idle:
            self.classes.reclaim()
        return started

    def _apply_slab_changes(self) -> None:
        changes = self.manager.drain_slab_changes()
        # releases first: the memory a class gives up backs what another takes in the same round
        for kind, cls, offset, nbytes in changes:
            if kind == "release":
                t0 = time.perf_counter()
                self.arenas[cls].release(offset, nbytes)
                self.slab_seconds[cls]["release"] += time.perf_counter() - t0
        for kind, cls, offset, nbytes in changes:
            if kind == "take":
                t0 = time.perf_counter()
                self.arenas[cls].commit(offset, nbytes)
                self.slab_seconds[cls]["commit"] += time.perf_counter() - t0
        t0 = time.perf_counter()
        self.backend.settle()
        self.free_seconds += time.perf_counter() - t0

    def _report(self, plan) -> None:
        """The moves the core planned, as KV events (the journal follows in ``sync_memory``)."""
        self.events.report(self.manager.drain_journal(), plan, self._describe, self.index)

    def _describe(self, class_id: int) -> tuple[set[str], str]:
        """(model ids, layout) of a class, for events."""
        return self.models.get(class_id, ()), self.manager.classes[class_id].geometry.describe()

    def open_class(self, geometry: Geometry) -> tuple[int, ArenaDescriptor, int, int]:
        """The layout class of ``geometry`` with its arena: (class id, descriptor, blocks, block bytes)."""
        if self.manager.class_of(geometry) is None:
            choose_slab_chunks(geometry.block_bytes, self.manager.budget.chunk_bytes, self.manager.budget.total)
            # TooManyClasses, before anything changes
            self.classes.make_room(geometry.tenant, max_classes=self.config.max_classes,
                                   max_classes_per_tenant=self.config.max_classes_per_tenant)
        known = self.manager.class_of(geometry) in self.arenas  # classes of the disk tier have no arena
        if not known and self.arenas and not self.backend.supports_many_classes:
            raise InvalidArgument(
                f"the {self.backend.name} backend serves one layout class per device; {self.name} already "
                f"serves {self.manager.classes[next(iter(self.arenas))].geometry.describe()}"
            )
        cid = self.manager.register_class(geometry)
        self.classes.opened(cid)
        pool = self.manager.classes[cid]
        if cid not in self.arenas:
            # if this fails, the class stays registered but owns nothing; a later attach retries
            self.arenas[cid] = self.backend.create_arena(f"c{cid}", pool.num_block_ids * pool.block_bytes,
                                                         class_id=cid, tenant=geometry.tenant)
            self.tiers.add_arena(cid, self.arenas[cid], pool)
            self.remote.bind(cid, layout_dict(pool.geometry))
        return cid, self.arenas[cid].descriptor, pool.num_block_ids, pool.block_bytes

    # -- the ceiling ---------------------------------------------------------------------
    def check_resize(self, pool_bytes: int) -> None:
        """``InvalidArgument`` unless ``pool_bytes`` is a ceiling this pool can have."""
        most = self.manager.max_pool_bytes
        if not self.manager.chunk_bytes <= pool_bytes <= most:
            raise InvalidArgument(
                f"{self.name}: pool_bytes must be between one chunk ({self.manager.chunk_bytes}) and {most} bytes "
                f"({'the GPU' + chr(39) + 's memory' if self.backend.exact_slabs else 'its size at start'}); "
                f"got {pool_bytes}")

    def resize(self, pool_bytes: int) -> PoolResize:
        """Move the ceiling; memory given back is released at once (VMM: to the GPU)."""
        before = self.pool_bytes
        r = self.manager.resize(pool_bytes)
        self.sync_memory()
        self.pool_bytes = r.pool_bytes
        return PoolResize(device=self.device, before_bytes=before, target_bytes=r.target_bytes,
                          pool_bytes=r.pool_bytes, met=r.met, freed_bytes=r.freed_chunks * self.manager.chunk_bytes,
                          evicted_blocks=r.evicted_blocks, max_pool_bytes=self.manager.max_pool_bytes)

    def release_idle(self, now: float) -> int:
        """Give back slabs empty for ``release_after_seconds`` (VMM: to the GPU); returns chunks."""
        n = self.manager.release_idle(now, self.config.release_after_seconds)
        if n:
            self.sync_memory()
        return n

    def close_class(self, class_id: int) -> None:
        """Drop a class nothing is left of (``manager.can_drop_class``): its memory, its arena (descriptor and
        mapping) and its tier registrations go, and its id is free for the next new geometry."""
        self.manager.drop_class(class_id)
        self._apply_slab_changes()  # the dropped class's slabs: its id is reusable once they are drained
        self.tiers.remove_arena(class_id)
        arena = self.arenas.pop(class_id, None)
        if arena is not None:
            self.backend.close_arena(arena)
        self.models.pop(class_id, None)
        self.slab_seconds.pop(class_id, None)
        log.debug("%s: class %d reclaimed", self.name, class_id)

    # -- sessions -------------------------------------------------------------------
    def drop_owner(self, owner: int, class_id: int | None = None) -> int:
        """Free what a session held; ``class_id``: its class, whose arena loses the pages no slab owns."""
        released = self.manager.drop_owner(owner)
        self.pending.forget_owner(owner)
        self.sync_memory()
        arena = self.arenas.get(class_id)
        if arena is not None and arena.client_writable:  # what the client wrote outside the class's slabs
            for offset, nbytes in self.manager.classes[class_id].unowned_spans():
                arena.release(offset, nbytes)
        ledger = getattr(self.backend, "ledger", None)
        if ledger is not None:  # its process maps none of our chunks any more (or is gone)
            ledger.forget(owner)
            self.backend.settle()
        return released

    def chunk_sync(self, session_id: int, class_id: int):
        """The chunks of ``class_id`` now, to hand to session ``session_id``'s process (CUDA VMM only)."""
        from .chunk_sync import ChunkSync

        if not hasattr(self.backend, "ledger"):
            raise InvalidArgument(f"the {self.backend.name} backend of {self.name} hands out no chunks")
        return ChunkSync(self.backend, session_id, class_id)

    # -- operators ------------------------------------------------------------------
    def stats(self) -> DeviceStats:
        """This pool's figures: the core's, the tiers' traffic, and the models attached to each class."""
        self.tiers.poll()
        st = self.tiers.decorate(self.manager.stats())
        return DeviceStats(
            index=self.index, device=self.device, bus_id=self.bus_id, pool_bytes=st.pool_bytes,
            free_bytes=st.free_chunks * st.chunk_bytes, sequences=st.sequences, clients=self.sessions,
            classes=tuple(replace(c, models=tuple(sorted(self.models.get(c.class_id, ()))),
                                  reserved_bytes=self._reserved_bytes(c.class_id),
                                  **self._slab_figures(c.class_id)) for c in st.classes),
            tiers=st.tiers, max_pool_bytes=st.max_pool_bytes, **self._memory_figures(st),
        )

    def _slab_figures(self, class_id: int) -> dict:
        took = self.slab_seconds.get(class_id)
        return {"commit_seconds": took["commit"], "release_seconds": took["release"]} if took else {}

    def _reserved_bytes(self, class_id: int) -> int:
        arena = self.arenas.get(class_id)
        return arena.nbytes if arena is not None else 0

    def _memory_figures(self, st) -> dict:
        b = self.backend
        if hasattr(b, "ledger"):  # vmm: what the GPU holds for us, chunk by chunk
            return {"memory": b.memory, "physical_bytes": b.physical_bytes, "draining_bytes": b.draining_bytes,
                    "freed_bytes": b.freed_bytes, "free_seconds": self.free_seconds}
        held = sum(c.mapped_bytes for c in st.classes) if b.supports_many_classes else st.pool_bytes
        return {"memory": b.memory, "physical_bytes": held}

    def evict(self, class_id: int | None, max_blocks: int | None) -> int:
        try:
            return self.manager.evict_cached(class_id, max_blocks)
        finally:
            self.sync_memory()

    def check(self, session_ids: set[int]) -> None:
        """The core's invariants, and no state held by a session that is not bound here (AssertionError)."""
        self.manager.check_invariants()
        stray = set(self.manager.owners()) - session_ids
        assert not stray, f"{self.name}: state held by ended sessions {sorted(stray)}"

    def close(self) -> None:
        """Finish the tiers' copies and flush the disk tier, then free the arenas and the backend."""
        try:
            self.tiers.close()  # finishes the copies in flight, fsyncs the disk tier's data and index
        except Exception:  # noqa: BLE001 - the arenas must still be released
            log.exception("%s: flushing the tiers at shutdown failed", self.name)
        for arena in self.arenas.values():
            arena.close()
        self.arenas.clear()
        self.backend.close()
