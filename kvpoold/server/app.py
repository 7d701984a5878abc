"""Start, run and stop the daemon: sockets, backend, gRPC servers, reaper, systemd.

Start-up order: take the sockets' lock files (a second daemon on the same
socket stops here with a clear message), remove what a crashed predecessor
left (stale sockets; CPU arenas are anonymous memfds, nothing of them outlives
a daemon), create one pool per device
(``--devices``: a backend, core and tiers each; see ``pools``), bind the
normal socket (``socket_mode``, ``socket_group``: who may attach) and the admin
socket (``admin_socket_mode``: who may evict, drain, look at other sessions),
each served by its own gRPC server over the same ``Service`` and with the
gRPC health and reflection services (``grpc_options``: the message limit,
idle connections closed, connections and streams capped), and beside each
its side socket
(``<socket>.handoff``, ``handoff.py``: kernel credentials, attach tickets,
arena file descriptors); start the Prometheus endpoint
(``metrics_port``); then print one ``ready`` line and tell systemd READY=1
(the sockets accept attaches from then on) and start pinging its watchdog.

SIGHUP reloads the settings that can change live (``LIVE_KEYS``) and logs
those that need a restart.  SIGTERM/SIGINT: refuse new attaches, health
NOT_SERVING, tell the clients through their ``Watch`` streams, wait up to
``shutdown_timeout`` for them to detach (a second signal stops waiting),
drop the rest, flush the tiers (``Service.close``), remove the sockets,
exit 0.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import resource
import signal
import sys
from dataclasses import replace
from typing import Callable

import grpc
from grpc_health.v1 import _async as health_aio
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from kvpool.protocol import kvpool_pb2 as pb
from kvpoold.config import LIVE_KEYS, MAX_MESSAGE_BYTES, Config, ConfigError, changed_keys, receive_limit
from kvpoold.memory import make_backend

from .handoff import HandoffServer, handoff_path
from .devices import check_disk_root, disk_dir_for
from .sd import Notifier
from .service import Service
from .sockpath import BoundSocket, PathRefused, SocketLock, clear_stale_socket
from .tiers import DiskTierError
from .servicer import KVPoolServicer, add_to_server

log = logging.getLogger("kvpoold")

REAP_INTERVAL_S = 0.25
SHUTDOWN_POLL_S = 0.05
# open files kept beyond the gRPC connections: side sockets, the admin socket, arenas, the disk tier, logs
SPARE_FILES = 256


class StartupError(RuntimeError):
    """The daemon cannot start; the message says why and what to do."""


def pool_bytes_for(config: Config, device: int | None = None) -> int:
    """One pool's size: ``--pool-bytes``, else (cuda) ``--gpu-memory-fraction`` of what ``device`` has free."""
    if config.pool_bytes:
        return config.pool_bytes
    if config.backend == "cuda":
        from kvpoold.memory.cuda_ipc import pool_bytes_for_fraction

        device = config.devices[0] if device is None else device
        return pool_bytes_for_fraction(device, config.gpu_memory_fraction, align=config.chunk_bytes)
    return config.effective_pool_bytes()


def check_cpu_room(config: Config, pool_bytes: int) -> None:
    """Refuse a CPU pool larger than the shared-memory file system can hold."""
    try:
        st = os.statvfs(config.shm_dir)
    except OSError as exc:
        raise StartupError(f"shared-memory directory {config.shm_dir} is not usable: {exc}") from None
    free = st.f_bavail * st.f_frsize
    if pool_bytes > free:
        raise StartupError(
            f"a pool of {pool_bytes} bytes does not fit in {config.shm_dir} ({free} bytes free); "
            "use a smaller --pool-bytes or a larger shared-memory file system"
        )


def check_gpu_room(config: Config, pool_bytes: int, device: int | None = None, elastic: bool = False) -> None:
    """Refuse a GPU pool larger than the device's free memory (``elastic``, a ceiling: its total), at start."""
    from kvpoold.memory.cuda_ipc import device_memory

    device = config.devices[0] if device is None else device
    free, total = device_memory(device)
    if elastic and pool_bytes > total:
        raise StartupError(
            f"a pool ceiling of {pool_bytes} bytes is more than GPU {device} has ({total} bytes); "
            "use a smaller --pool-bytes"
        )
    if not elastic and pool_bytes > free:
        raise StartupError(
            f"a pool of {pool_bytes} bytes does not fit on GPU {device} ({free} of {total} bytes free); "
            "use a smaller --pool-bytes or --gpu-memory-fraction (both are per GPU)"
        )


def open_pools(config: Config, service: Service, instance: str, backend_kwargs: dict) -> None:
    """One pool per device of ``--devices`` (cuda), or the one CPU pool.

    Sizes apply per device.  Any failure raises ``StartupError``; the caller
    closes the service, which releases the pools made so far (their device
    memory and pinned host memory).
    """
    devices = config.devices if config.backend == "cuda" else (-1,)
    if config.backend != "cuda" and config.devices != (0,):
        log.warning("devices %s: ignored by the %s backend, which has one pool", list(config.devices), config.backend)
    try:
        check_disk_root(config, len(devices))
    except DiskTierError as exc:
        raise StartupError(str(exc)) from None
    for device in devices:
        where = f" on GPU {device}" if device >= 0 else ""
        try:
            backend = make_backend(config.backend, instance=instance, device=max(device, 0), **backend_kwargs)
        except Exception as exc:  # noqa: BLE001 - turned into one clear start-up line
            raise StartupError(f"{exc}" if len(devices) == 1 else f"GPU {device}: {exc}") from None
        try:
            pool_bytes = pool_bytes_for(config, device if device >= 0 else None)
            if config.backend == "cpu":
                check_cpu_room(config, pool_bytes)
            else:
                check_gpu_room(config, pool_bytes, device, elastic=backend.memory == "vmm")
        except BaseException:
            backend.close()
            raise
        try:
            service.add_pool(backend, pool_bytes, device=device,
                             disk_dir=disk_dir_for(config, device, len(devices)))
        except DiskTierError as exc:  # a disk tier directory that cannot be used
            raise StartupError(f"{exc}{where}" if len(devices) > 1 else str(exc)) from None
        except (MemoryError, OSError) as exc:
            # the host tier passed validation (at most the machine's memory) but the kernel refused it
            if isinstance(exc, OSError) and exc.errno != errno.ENOMEM:
                raise
            raise StartupError(f"cannot allocate the host tier (host_bytes = {config.host_bytes}){where}: "
                               f"{exc.strerror if isinstance(exc, OSError) else 'out of memory'}; "
                               "use a smaller --host-bytes") from None
        except ValueError as exc:  # the same GPU twice (two ordinals, one bus id)
            raise StartupError(str(exc)) from None


def grpc_options(config: Config) -> list[tuple[str, int]]:
    """A gRPC server's options: what it reads, how long an idle connection lives, how many at once.

    gRPC tells a servicer nothing of the process behind a connection, so these
    bound every user together (the per-user caps are on the side socket and
    the sessions); they keep one user's connections from taking every file
    descriptor, and a request larger than any legitimate call is refused as its
    length arrives, never read whole.
    """
    options = [("grpc.max_receive_message_length", receive_limit(config)),
               ("grpc.max_send_message_length", MAX_MESSAGE_BYTES)]
    if config.grpc_idle_seconds:  # also closes a connection that never completes the HTTP/2 handshake
        options.append(("grpc.max_connection_idle_ms", int(config.grpc_idle_seconds * 1000)))
    if config.max_grpc_connections:
        options.append(("grpc.max_allowed_incoming_connections", config.max_grpc_connections))
    if config.max_grpc_streams:
        options.append(("grpc.max_concurrent_streams", config.max_grpc_streams))
    return options


def raise_open_files_limit(config: Config) -> None:
    """Raise the soft limit on open files to the hard one (epoll has no use for 1024), and warn when
    even that leaves too few beside ``max_grpc_connections``: out of descriptors, every socket stops
    accepting, the admin socket too."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError) as exc:
            log.warning("cannot raise the open files limit from %d to %d: %s", soft, target, exc)
    if config.max_grpc_connections and soft != resource.RLIM_INFINITY \
            and soft < config.max_grpc_connections + SPARE_FILES:
        log.warning("kvpoold may open %d files, too few for max_grpc_connections = %d and %d more (side sockets, "
                    "admin socket, arenas): raise LimitNOFILE or lower max_grpc_connections", soft,
                    config.max_grpc_connections, SPARE_FILES)


class _Listener:
    """One gRPC server on one Unix socket: the normal socket, or the admin socket."""

    def __init__(self, path: str, mode: int, service: Service, shutdown: asyncio.Event, health, interceptors, *,
                 admin: bool) -> None:
        self.path, self.mode, self.admin = path, mode, admin
        self.bound: BoundSocket | None = None  # once bound
        # kernel credentials, attach tickets, arena fds
        self.handoff = HandoffServer(handoff_path(path), mode, service.tickets, service.arena_fd,
                                     service.chunk_sync, settings=lambda: service.config)
        self.server = grpc.aio.server(interceptors=interceptors, options=grpc_options(service.config))
        add_to_server(KVPoolServicer(service, shutdown, admin=admin), self.server)  # undecodable: INVALID_ARGUMENT
        health_pb2_grpc.add_HealthServicer_to_server(health, self.server)
        reflection.enable_server_reflection(REFLECTED_SERVICES, self.server)

    async def start(self, gid: int | None) -> None:
        what = "--admin-socket" if self.admin else "--socket"
        clear_stale_socket(self.path, what)  # a stale socket only: we hold the lock, so nobody serves it
        address = "unix://" + self.path
        old = os.umask(0o077)  # nobody can connect in the moment between bind and chmod
        try:
            if self.server.add_insecure_port(address) == 0:
                raise StartupError(f"cannot listen on {address}")
            await self.server.start()
        finally:
            os.umask(old)
        self.bound = BoundSocket(self.path, what)
        try:
            self.bound.set_access(self.mode, gid)
        except OSError as exc:
            raise StartupError(f"cannot give {self.path} mode {self.mode:o}, group {gid} (socket_group): "
                               f"{exc.strerror}") from None
        try:
            await self.handoff.start(gid)
        except OSError as exc:
            raise StartupError(f"cannot serve the side socket {self.handoff.path}: {exc.strerror}") from None

    def remove(self) -> None:
        if self.bound is not None:
            self.bound.remove()


REFLECTED_SERVICES = (
    pb.DESCRIPTOR.services_by_name["KVPool"].full_name,
    health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
    reflection.SERVICE_NAME,
)


async def serve(config: Config, ready=None, reload: Callable[[], Config] | None = None) -> int:
    """Run until SIGTERM/SIGINT; returns the exit code.

    ``reload`` gives the configuration anew (file, environment, flags) on
    SIGHUP; the settings in ``LIVE_KEYS`` change at once, the others are
    logged as needing a restart.
    """
    admin_path = config.admin_socket_path()
    locks = [SocketLock(config.socket)] + ([SocketLock(admin_path)] if admin_path else [])
    service = None
    listeners: list[_Listener] = []
    metrics = None
    listeners_stopped = False
    notifier = Notifier()
    try:
        for lock in locks:
            lock.acquire()
        raise_open_files_limit(config)
        gid = config.socket_gid()
        instance = _instance(config.socket)
        if config.backend == "cpu":
            kwargs = {"shm_dir": config.shm_dir}  # arenas are anonymous memfds: no names, nothing left by a crash
        else:
            kwargs = {"memory": config.cuda_memory, "chunk_bytes": config.chunk_bytes}
        service = Service(config)
        open_pools(config, service, instance, kwargs)  # one per GPU of --devices; closed below on failure
        pool_bytes = sum(p.pool_bytes for p in service.pools)
        loop = asyncio.get_running_loop()

        if config.metrics_port:
            from .metrics import Metrics

            metrics = Metrics()
        shutdown = asyncio.Event()
        health = health_aio.HealthServicer()
        for path, mode, admin in ((config.socket, config.socket_mode, False),
                                  (admin_path, config.admin_socket_mode, True)):
            if path:  # each server its own interceptor: handlers must never cross between the two
                interceptors = [metrics.rpc.interceptor()] if metrics is not None else None
                listeners.append(_Listener(path, mode, service, shutdown, health, interceptors, admin=admin))
        for listener in listeners:
            await listener.start(gid if not listener.admin else None)
        if metrics is not None:
            try:
                metrics.serve(service, loop, config.metrics_address, config.metrics_port)
            except OSError as exc:
                raise StartupError(
                    f"cannot serve metrics on {config.metrics_address}:{config.metrics_port}: {exc}"
                ) from None
        for name in ("", REFLECTED_SERVICES[0]):
            await health.set(name, health_pb2.HealthCheckResponse.SERVING)

        stop, force = asyncio.Event(), asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, lambda: (force if stop.is_set() else stop).set())
        if reload is not None:
            loop.add_signal_handler(signal.SIGHUP, lambda: _reload(service, listeners, reload, notifier))
        tasks = [asyncio.create_task(_reap_forever(service))]
        if notifier.watchdog_interval:
            tasks.append(asyncio.create_task(_watchdog(notifier)))
        extra = (f" admin_socket={admin_path}" if admin_path else "") + \
                (f" metrics=http://{config.metrics_address}:{metrics.port}/metrics" if metrics else "")
        if len(service.pools) > 1:
            extra += " devices=" + ",".join(f"{p.device}@{p.bus_id}" for p in service.pools)  # ordinal@bus id
            for p in service.pools:
                log.info("pool %d: %s, %d bytes", p.index, p.name, p.pool_bytes)
        elif config.backend == "cuda":
            only = service.pools.pools[0]
            extra += f" devices={only.device}@{only.bus_id}"
        if config.backend == "cuda":
            extra += f" memory={service.pools.pools[0].backend.memory}"
        log.info("kvpoold %s ready: socket=%s backend=%s pool=%d bytes%s", service.version, config.socket,
                 config.backend, pool_bytes, extra)
        print(f"kvpoold ready socket={config.socket} backend={config.backend} pool_bytes={pool_bytes}{extra}",
              flush=True)
        what = f"{len(service.pools)} {config.backend} pools of {pool_bytes // len(service.pools)} bytes" \
            if len(service.pools) > 1 else f"{config.backend} pool of {pool_bytes} bytes"
        notifier.ready(f"serving {what} on {config.socket}")
        if ready is not None:
            ready()
        await stop.wait()

        # -- graceful shutdown: no new attaches, tell the clients, give them time to detach --
        service.closing = True
        await health.enter_graceful_shutdown()
        waiting = len(service.sessions)
        timeout = service.config.shutdown_timeout
        log.info("stopping: telling %d clients, waiting up to %gs for them to detach", waiting, timeout)
        notifier.stopping(f"stopping: waiting for {waiting} clients to detach")
        shutdown.set()
        deadline = loop.time() + timeout
        while len(service.sessions) and loop.time() < deadline and not force.is_set():
            await asyncio.sleep(SHUTDOWN_POLL_S)
        left = list(service.sessions)
        if left:
            why = "a second signal" if force.is_set() else f"{timeout:g}s"
            log.warning("stopping after %s with %d sessions still attached: %s", why, len(left),
                        ", ".join(f"{s.id} ({s.name}, pid {s.pid})" for s in left))
            for s in left:
                service.drop(s, "the daemon stopped")
        elif waiting:
            log.info("all clients detached")
        for task in tasks:
            task.cancel()
        await asyncio.gather(*(listener.server.stop(grace=0.5) for listener in listeners))
        listeners_stopped = True
        log.info("stopped")
        return 0
    finally:
        if not listeners_stopped:  # a start-up failure after some server started
            await asyncio.gather(*(listener.server.stop(None) for listener in listeners))
        if metrics is not None:
            metrics.close()
        if service is not None:
            service.close()  # every pool: flushes its tiers, then releases its arenas and device memory
        for listener in listeners:
            await listener.handoff.stop()
            listener.remove()
        for lock in reversed(locks):
            lock.release()


def _reload(service: Service, listeners: list[_Listener], reload: Callable[[], Config],
            notifier: Notifier) -> None:
    """SIGHUP: apply the settings that can change live; say which ones need a restart."""
    notifier.reloading()
    try:
        try:
            new = reload()
        except ConfigError as exc:
            log.error("reload failed, keeping the running configuration: %s", exc)
            return
        old = service.config
        changed = changed_keys(old, new)
        live = [k for k in changed if k in LIVE_KEYS]
        fixed = [k for k in changed if k not in LIVE_KEYS]
        for key in fixed:
            log.warning("reload: %s cannot change while kvpoold runs (running %r, configured %r); "
                        "restart kvpoold to apply it", key, getattr(old, key), getattr(new, key))
        applied = replace(new, **{k: getattr(old, k) for k in fixed})
        if receive_limit(applied) != receive_limit(old):
            log.warning("reload: the gRPC servers keep reading requests of up to %d bytes (max_message_bytes); "
                        "restart kvpoold for the %d bytes the new limits need", receive_limit(old),
                        receive_limit(applied))
        if "log_level" in live:
            logging.getLogger().setLevel(getattr(logging, new.log_level.upper()))
        if "max_sessions" in live:
            service.sessions.max_sessions = new.max_sessions
        if "max_sessions_per_user" in live:
            service.sessions.max_sessions_per_user = new.max_sessions_per_user
        if "admin_socket_mode" in live:
            for listener in listeners:
                if listener.admin:
                    for bound in (listener.bound, listener.handoff.bound):
                        if bound is not None:
                            bound.set_access(new.admin_socket_mode)
        service.config = applied  # every pool reads it (max_reserve_blocks, quotas, limits)
        if live:
            log.warning("reload: changed %s", ", ".join(f"{k} {getattr(old, k)!r} -> {getattr(new, k)!r}"
                                                       for k in live))
        else:
            log.warning("reload: no setting changed that can change live")
    except Exception:  # noqa: BLE001 - a reload must never stop the daemon
        log.exception("reload failed")
    finally:
        notifier.ready("reloaded")


async def _watchdog(notifier: Notifier) -> None:
    """Pinged from the event loop itself: a stuck loop misses pings and systemd restarts us."""
    while True:
        notifier.watchdog()
        await asyncio.sleep(notifier.watchdog_interval)


async def _reap_forever(service: Service) -> None:
    """Every REAP_INTERVAL_S: drop sessions whose lease ran out (frozen clients), then vanished ones."""
    while True:
        await asyncio.sleep(REAP_INTERVAL_S)
        try:
            service.reap()
        except Exception:  # noqa: BLE001 - the reaper must survive a bad session
            log.exception("reaper failed")
        try:
            service.release_idle()
        except Exception:  # noqa: BLE001 - serving goes on; the next round tries again
            log.exception("releasing idle memory failed")


def _instance(socket_path: str) -> str:
    from kvpoold.memory.cpu_shm import instance_id

    return instance_id(os.path.abspath(socket_path))


class _JournalFormatter(logging.Formatter):
    """Under systemd: a ``<priority>`` prefix journald reads as the level, no timestamp (journald adds one)."""

    PRIORITY = {logging.DEBUG: 7, logging.INFO: 6, logging.WARNING: 4, logging.ERROR: 3, logging.CRITICAL: 2}

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record).replace("\n", "\n ")
        return f"<{self.PRIORITY.get(record.levelno, 6)}>{text}"


def _stdout_is_journal() -> bool:
    """True when stdout is the journal stream systemd gave us ($JOURNAL_STREAM is dev:inode)."""
    want = os.environ.get("JOURNAL_STREAM", "")
    try:
        st = os.fstat(sys.stdout.fileno())
    except (OSError, ValueError):
        return False
    return want == f"{st.st_dev}:{st.st_ino}"


def setup_logging(level: str) -> None:
    handler = logging.StreamHandler(sys.stdout)
    if _stdout_is_journal():
        handler.setFormatter(_JournalFormatter("%(name)s: %(message)s"))
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(getattr(logging, level.upper()))


def run(config: Config, reload: Callable[[], Config] | None = None) -> int:
    setup_logging(config.log_level)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)  # a reload before the handler is installed must not kill us
    try:
        return asyncio.run(serve(config, reload=reload))
    except (StartupError, PathRefused) as exc:
        print(f"kvpoold: {exc}", file=sys.stderr)
        return 2
