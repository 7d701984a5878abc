"""One pool per device, and which pool each session uses.

A CUDA daemon started with ``--devices 0,1`` owns one ``DevicePool`` per
GPU: its own backend (the device allocations on that GPU), its own
``KVCacheManager``, arenas per layout class and tiers (pinned host memory,
its own disk directory).  Pools share nothing but the session registry, so a
prefix cached on GPU 0 is no hit on GPU 1: its bytes are on the other device.
The CPU backend always has exactly one pool (``--devices`` means nothing there).

Sizes are per device: ``--pool-bytes`` / ``--gpu-memory-fraction``,
``--host-bytes`` and ``--disk-bytes`` apply to each pool.  With one pool the
disk tier is ``--disk-dir`` itself (as before there were several); with
several, pool ``N`` keeps it in ``<disk-dir>/gpuN`` (``disk_dir_for``), the
directory the ``kvpoold@N`` unit uses, so a restart finds each device's blocks.

``DevicePools`` binds a session to one pool at attach, by the PCI bus id of
the client's GPU (``choose``): CUDA ordinals differ between processes with
different ``CUDA_VISIBLE_DEVICES``, the bus id does not.  Every later call
of the session goes to that pool, through the ``PoolSession`` made at
attach (``session_pool.py``; ``calls``).
"""

from __future__ import annotations

import logging
import os
from dataclasses import replace

from kvpoold.config import Config
from kvpoold.core import Geometry, InvalidArgument, KVCacheManager
from kvpoold.core.block_pool import choose_slab_chunks
from kvpool.ipc import DeviceMismatch
from kvpool.protocol import ArenaDescriptor
from kvpool.protocol.stats import DeviceStats
from kvpoold.memory import Arena, Backend

from .access import Limits, Quotas
from .classes import ClassSessions
from .session_pool import PoolSession
from .tiers import TIER_ALIGN, Tiers, resolve_disk_dir

log = logging.getLogger("kvpoold")


def disk_dir_for(config: Config, device: int, npools: int) -> str:
    """The disk tier's directory of the pool on ``device``: ``--disk-dir``, or ``<disk-dir>/gpuN`` with several pools."""
    base = resolve_disk_dir(config.disk_dir)
    if npools > 1 and base:
        return os.path.join(base, f"gpu{device}")
    return base


def normalize_bus_id(bus: str) -> str:
    """``0000:3b:00.0`` and ``3B:00.0`` -> ``0000:3B:00.0`` (what CUDA calls the device)."""
    bus = bus.strip().upper()
    if bus and bus.count(":") == 1:
        bus = "0000:" + bus
    return bus


class DevicePool:
    """One device's memory: backend, core, arenas per layout class, tiers.

    Everything is called from the event loop; ``config`` is the daemon's
    live configuration (the service replaces it on SIGHUP).
    """

    def __init__(self, config: Config, backend: Backend, pool_bytes: int, *, index: int = 0,
                 device: int = -1, bus_id: str | None = None, disk_dir: str | None = None) -> None:
        self.config = config
        self.backend = backend
        self.index = index  # position in --devices
        self.device = device  # the daemon's CUDA ordinal; -1 on the CPU backend
        self.bus_id = normalize_bus_id(getattr(backend, "bus_id", "") if bus_id is None else bus_id)
        self.pool_bytes = pool_bytes
        self.manager = KVCacheManager(
            pool_bytes,
            chunk_bytes=config.chunk_bytes,
            host_bytes=config.host_bytes,
            disk_bytes=config.disk_bytes,
            policy=config.eviction_policy,
            max_reserve_blocks=config.max_reserve_blocks,
            tier_align=TIER_ALIGN,
        )
        self.tiers = Tiers(config, self.manager, backend.name, device=device if device >= 0 else None,
                           disk_dir=disk_dir)  # host and disk tiers, transfers
        self.arenas: dict[int, Arena] = {}
        self.models: dict[int, set[str]] = {}
        self.quotas = Quotas(self)  # per-session limits (access.py), checked before the core allocates
        self.limits = Limits(self)  # sequences per session, tokens per call
        self.sessions = 0  # bound to this pool now
        self.classes = ClassSessions(self)  # sessions per class; reclaims unused classes, enforces the caps

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

        started = self.tiers.sync(self._apply_slab_changes)
        if self.classes.idle:
            self.classes.reclaim()
        return started

    def _apply_slab_changes(self) -> None:
        for kind, cls, offset, nbytes in self.manager.drain_slab_changes():
            arena = self.arenas[cls]
            if kind == "take":
                arena.commit(offset, nbytes)
            else:
                arena.release(offset, nbytes)

    def open_class(self, geometry: Geometry) -> tuple[int, ArenaDescriptor, int, int]:
        """The layout class of ``geometry`` with its arena: (class id, descriptor, blocks, block bytes)."""
        if self.manager.class_of(geometry) is None:
            choose_slab_chunks(geometry.block_bytes, self.manager.budget.chunk_bytes, self.manager.budget.total)
            self.classes.make_room(geometry.tenant)  # TooManyClasses, before anything changes
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
            self.arenas[cid] = self.backend.create_arena(f"c{cid}", pool.num_block_ids * pool.block_bytes)
            self.tiers.add_arena(cid, self.arenas[cid], pool)
        return cid, self.arenas[cid].descriptor, pool.num_block_ids, pool.block_bytes

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
        log.debug("%s: class %d reclaimed", self.name, class_id)

    # -- sessions -------------------------------------------------------------------
    def drop_owner(self, owner: int) -> int:
        released = self.manager.drop_owner(owner)
        self.tiers.forget_owner(owner)
        self.sync_memory()
        return released

    # -- operators ------------------------------------------------------------------
    def stats(self) -> DeviceStats:
        """This pool's figures: the core's, the tiers' traffic, and the models attached to each class."""
        self.tiers.poll()
        st = self.tiers.decorate(self.manager.stats())
        return DeviceStats(
            index=self.index, device=self.device, bus_id=self.bus_id, pool_bytes=st.pool_bytes,
            free_bytes=st.free_chunks * st.chunk_bytes, sequences=st.sequences, clients=self.sessions,
            classes=tuple(replace(c, models=tuple(sorted(self.models.get(c.class_id, ())))) for c in st.classes),
            tiers=st.tiers,
        )

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


class DevicePools:
    """The daemon's pools, in ``--devices`` order, and the pool each session is bound to."""

    def __init__(self) -> None:
        self.pools: list[DevicePool] = []
        self._of: dict[int, PoolSession] = {}  # session id -> its calls on its pool

    def add(self, pool: DevicePool) -> DevicePool:
        if pool.bus_id and any(p.bus_id == pool.bus_id for p in self.pools):
            raise ValueError(f"GPU {pool.bus_id} is listed twice in --devices")
        self.pools.append(pool)
        return pool

    def __iter__(self):
        return iter(self.pools)

    def __len__(self) -> int:
        return len(self.pools)

    def describe(self) -> str:
        return ", ".join(p.name for p in self.pools)

    def choose(self, bus_id: str) -> DevicePool:
        """The pool of the client's GPU (its PCI bus id); ``""``: the only pool.

        A client on a GPU no pool is on, or one that names no GPU while the
        daemon serves several, gets ``DeviceMismatch`` (FAILED_PRECONDITION)
        naming the devices served.
        """
        bus = normalize_bus_id(bus_id)
        if len(self.pools) == 1 and (not bus or not self.pools[0].bus_id):
            return self.pools[0]  # one pool (or the CPU backend): a client without a GPU is no ambiguity
        if not bus:
            raise DeviceMismatch(
                f"this kvpoold serves several GPUs ({self.describe()}) and the client named none: "
                "run it on one of them (kvpool.connect(device=...), or torch.cuda.set_device before connecting)"
            )
        for p in self.pools:
            if p.bus_id == bus:
                return p
        raise DeviceMismatch(
            f"the client runs on GPU {bus}, which this kvpoold does not serve; it serves {self.describe()}: "
            "run the client on one of those GPUs, or attach to the daemon of its GPU"
        )

    def bind(self, calls: PoolSession) -> None:
        self._of[calls.session.id] = calls
        calls.pool.sessions += 1

    def unbind(self, session_id: int) -> DevicePool | None:
        calls = self._of.pop(session_id, None)
        if calls is None:
            return None
        calls.pool.sessions -= 1
        return calls.pool

    def of(self, session) -> DevicePool:
        """The pool a session was bound to at attach."""
        return self._of[session.id].pool

    def calls(self, session) -> PoolSession:
        """The session's calls on its pool (bound at attach)."""
        return self._of[session.id]

    def close(self) -> None:
        """Close every pool (each releases its device memory even if another fails)."""
        while self.pools:
            pool = self.pools.pop()
            try:
                pool.close()
            except Exception:  # noqa: BLE001 - the other pools must still be released
                log.exception("%s: closing the pool failed", pool.name)
        self._of.clear()
