"""The daemon's state: its pools (one per device), the sessions, drain and shutdown.

Everything here is called from the event loop only (the daemon's single
concurrency rule), so no locks are needed.  No gRPC types appear: the
servicer converts messages into these calls and results back
(``convert.py``).  The memory of each device (core, arenas, tiers) lives in
a ``pools.DevicePool``; a session is bound to one pool at attach
(``devices.DevicePools``), and its calls are made on the ``PoolSession`` of
that binding (``session_pool``), which needs of the service only what
``session_pool.SessionKeeper`` names.  Call and result types: ``calls.py``.
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from functools import partial

from kvpoold import __version__
from kvpoold.config import Config
from kvpoold.core import Geometry, InvalidArgument, WrongState
from kvpoold.core.results import PageTable
from kvpool.protocol.stats import ClientInfo, PoolStats, RemoteStats
from kvpoold.transfer.remote import RemoteSettings, RemoteStore

from .access import AdminOnly, Draining
from .calls import AttachResult, DrainState, PoolResize
from .devices import DevicePools
from .events import EventBus
from .handoff import Credentials, NoCredentials, TicketStore
from .limits import check_string
from .logsafe import printable
from .pools import DevicePool
from .session_pool import PoolSession
from .sessions import Session, SessionRegistry

log = logging.getLogger("kvpoold")


def tenant_of(tenant_by: str, creds: Credentials | None) -> str:
    """The tenant of a client with ``creds`` under ``tenant_by`` ("uid", "gid", "none")."""
    if creds is None or tenant_by == "none":
        return ""
    return f"uid {creds.uid}" if tenant_by == "uid" else f"gid {creds.gid}"


class Service:
    """The sessions and the pools; routes each session's calls to the pool it was bound to at attach.

    Pools are added by the start-up code (``add_pool``), one per device.
    """

    def __init__(self, config: Config) -> None:
        self._config = config
        self.pools = DevicePools()
        # one registry: ids unique, max_sessions and max_sessions_per_user over every pool
        self.sessions = SessionRegistry(config.max_sessions, max_sessions_per_user=config.max_sessions_per_user)
        self.started = time.time()
        self.rpcs = 0
        self.closing = False
        self.draining = False  # kvpoolctl drain: no new attaches or sequences; running ones go on
        self.tickets = TicketStore()  # issued on the side sockets (handoff.py), redeemed by Attach
        self._idle_checked = time.monotonic()
        #: tier 3, shared by every pool (one connection, one writer); None without --remote-url
        self.remote = RemoteStore(RemoteSettings.from_config(config)) if config.remote_url else None
        stream = None
        if self.remote is not None and config.events_stream:
            stream = partial(self.remote.add_event, config.events_stream)
            if config.remote_key_file:  # routers need the plain block hashes: the secret does not cover them
                log.warning("--events-stream %s: the stream carries every tenant's block hashes in the clear; "
                            "whoever can read it can tell which prompts are cached (let only the router read "
                            "it: a Redis ACL)", printable(config.events_stream))
        self.events = EventBus(stream=stream)  # KV events of every pool (the Events RPC)

    @property
    def config(self) -> Config:
        return self._config

    @config.setter
    def config(self, config: Config) -> None:
        """SIGHUP: every pool reads the new live settings too (quotas, limits, reserves)."""
        self._config = config
        for pool in self.pools:
            pool.config = config
            pool.manager.max_reserve_blocks = config.max_reserve_blocks

    def add_pool(self, backend, pool_bytes: int, **kwargs) -> DevicePool:
        """A device's pool (``pools.DevicePool``'s arguments); on failure nothing of it stays."""
        try:
            pool = DevicePool(self._config, backend, pool_bytes, index=len(self.pools), remote=self.remote,
                              events=self.events, **kwargs)
        except BaseException:
            backend.close()
            raise
        try:
            self.pools.add(pool)
        except BaseException:
            pool.close()
            raise
        pool.on_remap = self._remap
        return pool

    def _remap(self, session_ids) -> None:
        """Tell these sessions' clients (Watch: "remap") that chunks they may map left their class."""
        for sid in session_ids:
            session = self.sessions.find_id(sid)
            if session is not None and session.remap is not None:
                session.remap.set()

    def pool_of(self, session: Session) -> DevicePool:
        return self.pools.of(session)

    # -- sessions -----------------------------------------------------------------
    def attach(self, name: str, model_key: str, geometry: Geometry, pid: int, device_bus_id: str = "",
               creds: Credentials | None = None) -> AttachResult:
        """A new session of ``model_key`` (``model@revision``) on the pool of the client's GPU.

        ``creds`` (from the kernel, through a ticket) decide the tenant: the
        layout class is per (tenant, geometry), so tenants share no memory
        and no cache.  None (in-process callers): no tenant.
        """
        geometry = replace(geometry, tenant=tenant_of(self.config.tenant_by, creds))
        if self.closing:
            raise WrongState("the daemon is shutting down")
        if self.draining:
            raise Draining("new attaches")
        for what, value in (("name", name), ("model_id@revision", model_key), ("dtype", geometry.dtype),
                            ("device_bus_id", device_bus_id)):
            check_string(self.config, what, value)
        self.sessions.check_room(creds)  # before a new class may evict idle ones to make room
        pool = self.pools.choose(device_bus_id)
        cid, descriptor, num_blocks, block_bytes = pool.open_class(geometry)
        try:
            session = self.sessions.add(name or "client", pid, model_key, cid, creds)
        except BaseException:
            pool.classes.reclaim()  # a class opened for nobody goes at once
            raise
        self.pools.bind(PoolSession(self, session, pool))
        pool.classes.attached(cid)
        pool.models.setdefault(cid, set()).add(model_key)
        log.info("attach: session %d (%s, pid %d) model %s on %s class %d %s", session.id, printable(session.name),
                 session.pid, printable(model_key), pool.name, cid, printable(geometry.describe()))
        return AttachResult(session, descriptor, num_blocks, block_bytes, pool.backend.name)

    def arena_fd(self, token: bytes, creds: Credentials) -> tuple[int, int]:
        """(file descriptor, bytes) of the arena of ``token``'s session, for the process that attached it.

        ``creds`` are the kernel's for the asking connection; anything else than
        the session's own (another process, user or group, or a session
        attached without credentials) gets ``NoCredentials``.
        """
        session = self.sessions.get(token)
        if session.creds is None or session.creds != creds:
            raise NoCredentials("the process asking is not the one that attached the session")
        arena = self.pools.of(session).arenas[session.class_id]
        if not hasattr(arena, "fileno"):
            raise NoCredentials(f"the {self.backend_name} backend hands no file descriptors")
        return arena.fileno(), arena.nbytes

    def chunk_sync(self, token: bytes, creds: Credentials):
        """The chunks of ``token``'s session's class, for the process that attached it (CUDA VMM).

        As ``arena_fd``: other credentials get ``NoCredentials``.
        """
        session = self.sessions.get(token)
        if session.creds is None or session.creds != creds:
            raise NoCredentials("the process asking is not the one that attached the session")
        return self.pools.of(session).chunk_sync(session.id, session.class_id)

    def session(self, token: bytes) -> Session:
        """The session of ``token`` (renews its lease); UNAUTHENTICATED when there is none."""
        return self.sessions.get(token)

    def session_pool(self, token: bytes) -> PoolSession:
        """The calls of the session of ``token`` on the pool it was bound to at attach."""
        return self.pools.calls(self.sessions.get(token))

    def sequences_of(self, token: bytes, session_id: int, *, admin: bool) -> list[PageTable]:
        """The sequences of session ``session_id`` (0: of ``token``'s); another session's need ``admin``."""
        if not session_id:
            return self.session_pool(token).sequences()
        if not (token and self.session(token).id == session_id):
            self.need_admin("another session's sequences", admin=admin)
        return self.pools.calls(self.sessions.by_id(session_id)).sequences()

    def need_admin(self, what: str, *, admin: bool) -> None:
        """Refuse an admin call (``what``) that did not arrive on the admin socket."""
        if not admin:
            raise AdminOnly(what, self.config.admin_socket_path())

    def drop(self, session: Session, reason: str) -> int:
        pool = self.pools.of(session)
        pool.classes.detached(session.class_id)  # before the sync of drop_owner, which reclaims the class if it can
        released = pool.drop_owner(session.id, session.class_id)
        self.sessions.remove(session)
        self.pools.unbind(session.id)
        log.info("session %d (%s, pid %d) dropped: %s; %d blocks released on %s",
                 session.id, printable(session.name), session.pid, printable(reason, 1000), released, pool.name)
        return released

    def reap(self) -> int:
        """Drop every session whose lease ran out (a frozen client), then every one whose client is gone.

        Returns how many.
        """
        lapsed = self.sessions.lapsed(self.config.lease_seconds)
        for s, reason in lapsed:
            self.drop(s, reason)
        expired = self.sessions.expired(self.config.grace_seconds)  # of the sessions still here
        for s, reason in expired:
            self.drop(s, reason)
        return len(lapsed) + len(expired)

    def release_idle(self) -> int:
        """Give back slabs that stayed empty for ``release_after_seconds``, in every pool (chunks).

        Looks at most four times per ``release_after_seconds`` (and at most once a second): finding
        empty slabs reads every class's free list.
        """
        now = time.monotonic()
        if now - self._idle_checked < min(max(1.0, self.config.release_after_seconds / 4), 60.0):
            return 0
        self._idle_checked = now
        released = sum(pool.release_idle(now) for pool in self.pools)
        if released:
            log.info("released %d idle chunks (empty for %gs)", released, self.config.release_after_seconds)
        return released

    # -- operators: every pool ----------------------------------------------------------
    def stats(self) -> PoolStats:
        """The daemon's figures: each pool's, in ``--devices`` order, and their totals."""
        devices = tuple(pool.stats() for pool in self.pools)
        return PoolStats(
            backend=self.backend_name,
            version=self.version,
            pool_bytes=sum(d.pool_bytes for d in devices),
            chunk_bytes=self.config.chunk_bytes,
            free_bytes=sum(d.free_bytes for d in devices),
            sequences=sum(d.sequences for d in devices),
            clients=len(self.sessions),
            uptime_seconds=time.time() - self.started,
            rpcs=self.rpcs,
            classes=tuple(c for d in devices for c in d.classes),
            tiers=tuple(t for d in devices for t in d.tiers),
            draining=self.draining,
            devices=devices,
            remote=(RemoteStats(**self.remote.stats()),) if self.remote is not None else (),
        )

    def clients(self) -> list[ClientInfo]:
        """Every session, with what it holds and the pool it is bound to."""
        owners = self.owners()
        now = time.time()
        out = []
        for s in self.sessions:
            nseq, reserved = owners.get(s.id, (0, 0))
            out.append(ClientInfo(
                session_id=s.id, name=s.name, pid=s.pid, model_id=s.model_key, class_id=s.class_id,
                sequences=nseq, reserved_blocks=reserved, connected=s.connected,
                attached_seconds=now - s.attached_at, device=self.pool_of(s).name,
            ))
        return out

    def owners(self) -> dict[int, tuple[int, int]]:
        """Session id -> (sequences, reserved blocks), over every pool."""
        out: dict[int, tuple[int, int]] = {}
        for pool in self.pools:
            out.update(pool.manager.owners())
        return out

    @property
    def live_sequences(self) -> int:
        return sum(pool.manager.seqs.live for pool in self.pools)

    def evict(self, class_id: int | None, max_blocks: int | None) -> int:
        """Drop cached blocks, oldest first, pool by pool (``class_id``: that class in every pool that has it)."""
        pools = list(self.pools)
        if class_id is not None:
            having = [p for p in pools if p.manager.has_class(class_id)]
            pools = having or pools[:1]  # none has it: the core's error names the class
        evicted = 0
        for pool in pools:
            left = None if max_blocks is None else max_blocks - evicted
            if left is not None and left <= 0 and evicted:
                break
            evicted += pool.evict(class_id, left)
        return evicted

    def resize(self, pool_bytes: int, device: int | None) -> list[PoolResize]:
        """Move the ceiling of the pool on ``device`` (None: every pool) to ``pool_bytes``.

        Validates every pool first (``InvalidArgument`` past a pool's limit,
        or a device not served), then resizes; a shrink that held blocks stop
        is no error: its result says how far it got.
        """
        pools = [p for p in self.pools if device is None or p.device == device]
        if not pools:
            raise InvalidArgument(f"no pool on device {device}: this kvpoold serves {self.pools.describe()}")
        for pool in pools:
            pool.check_resize(pool_bytes)
        out = [pool.resize(pool_bytes) for pool in pools]
        for pool, r in zip(pools, out):
            log.info("resize %s: %d -> %d bytes asked, now %d%s (%d bytes given back, %d cached blocks evicted)",
                     pool.name, r.before_bytes, r.target_bytes, r.pool_bytes, "" if r.met else ", held blocks stop it",
                     r.freed_bytes, r.evicted_blocks)
        return out

    def reset(self) -> tuple[int, int, int]:
        """Operator reset: drop every session and every cached block; returns (sessions, released, evicted).

        Dropped clients learn it at their next call (UNAUTHENTICATED: attach again).
        """
        sessions = list(self.sessions)
        released = sum(self.drop(s, "reset by an operator") for s in sessions)
        evicted = self.evict(None, None)
        return len(sessions), released, evicted

    def drain(self, *, resume: bool) -> DrainState:
        """Stop taking new attaches and sequences (``resume``: take them again); running ones go on."""
        if self.draining == resume:
            self.draining = not resume
            log.info("%s: %d sessions, %d sequences", "draining" if self.draining else "drain ended",
                     len(self.sessions), self.live_sequences)
        return DrainState(draining=self.draining, sessions=len(self.sessions), sequences=self.live_sequences)

    def check(self) -> tuple[bool, str]:
        """Run every pool's invariant checks and the session cross-checks."""
        ids = {s.id for s in self.sessions}
        try:
            bound: set[int] = set()
            for pool in self.pools:
                mine = {s.id for s in self.sessions if self.pools.of(s) is pool}
                pool.check(mine)
                bound |= mine
            assert bound == ids, f"sessions bound to no pool: {sorted(ids - bound)}"
        except AssertionError as exc:
            return False, str(exc) or "invariant violated"
        where = f" in {len(self.pools)} pools" if len(self.pools) > 1 else ""
        return True, f"{len(ids)} sessions, {self.live_sequences} sequences{where}: all invariants hold"

    def close(self) -> None:
        """Flush every pool's tiers, then release its arenas and backend (device memory); then write what
        the remote tier still has queued (briefly: an unreachable server does not hold shutdown up)."""
        try:
            self.pools.close()
        finally:
            if self.remote is not None:
                self.remote.close()

    @property
    def version(self) -> str:
        return __version__

    @property
    def backend_name(self) -> str:
        """``cpu`` or ``cuda``: every pool has the same backend."""
        return self.pools.pools[0].backend.name if len(self.pools) else self._config.backend

