"""Start, run and stop the daemon: socket ownership, backend, gRPC server, reaper.

Start-up order: take the socket's lock file (a second daemon on the same
socket stops here with a clear message), remove what a crashed predecessor
left (stale socket, shared-memory segments), create the backend, bind the
socket with the configured mode, then print one ``ready`` line.  SIGTERM and
SIGINT stop accepting calls, tell connected clients, close the arenas (which
unlinks shared memory) and remove the socket.
"""

from __future__ import annotations

import asyncio
import fcntl
import logging
import os
import signal
import sys

import grpc

from kvpool._generated import kvpool_pb2_grpc as pb_grpc
from kvpoold.config import Config
from kvpoold.memory import make_backend
from kvpoold.memory.base import Backend

from .service import PoolService
from .servicer import KVPoolServicer

log = logging.getLogger("kvpoold")

MAX_MESSAGE_BYTES = 256 << 20
REAP_INTERVAL_S = 0.25


class StartupError(RuntimeError):
    """The daemon cannot start; the message says why and what to do."""


class SocketLock:
    """An exclusive lock beside the socket: one daemon per socket path."""

    def __init__(self, socket_path: str) -> None:
        self.path = socket_path + ".lock"
        self._fd: int | None = None

    def acquire(self) -> None:
        directory = os.path.dirname(self.path) or "."
        if not os.path.isdir(directory):
            try:
                os.makedirs(directory, exist_ok=True)
            except OSError as exc:
                raise StartupError(f"cannot create the socket's directory {directory}: {exc}") from None
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            raise StartupError(f"cannot open lock file {self.path}: {exc}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            owner = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise StartupError(
                f"another kvpoold (pid {owner}) is already serving {self.path[:-5]}; "
                "stop it first or choose another --socket"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass
            os.close(self._fd)
            self._fd = None


def pool_bytes_for(config: Config, backend: Backend) -> int:
    if config.pool_bytes:
        return config.pool_bytes
    if config.backend == "cuda":
        from kvpoold.memory.cuda_ipc import pool_bytes_for_fraction

        return pool_bytes_for_fraction(config.devices[0], config.gpu_memory_fraction, align=config.chunk_bytes)
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


def check_gpu_room(config: Config, pool_bytes: int) -> None:
    """Refuse a GPU pool larger than the device's free memory, before any client attaches."""
    from kvpoold.memory.cuda_ipc import device_memory

    free, total = device_memory(config.devices[0])
    if pool_bytes > free:
        raise StartupError(
            f"a pool of {pool_bytes} bytes does not fit on GPU {config.devices[0]} ({free} of {total} bytes free); "
            "use a smaller --pool-bytes or --gpu-memory-fraction"
        )


async def serve(config: Config, ready=None) -> int:
    """Run until SIGTERM/SIGINT; returns the exit code."""
    if len(config.devices) > 1:
        raise StartupError(
            f"one kvpoold serves one GPU; run one daemon per GPU (devices {list(config.devices)}), "
            "each with its own --socket (e.g. the kvpoold@N systemd template)"
        )
    lock = SocketLock(config.socket)
    lock.acquire()
    service = None
    try:
        if os.path.exists(config.socket):
            os.unlink(config.socket)  # stale: we hold the lock, so nobody serves it
        instance = _instance(config.socket)
        kwargs = {"shm_dir": config.shm_dir, "mode": config.socket_mode & 0o666} if config.backend == "cpu" else {}
        if config.backend == "cpu":
            from kvpoold.memory.cpu_shm import remove_stale_segments

            for name in remove_stale_segments(instance, config.shm_dir):
                log.warning("removed shared memory left by a previous daemon: %s", name)
        try:
            backend = make_backend(config.backend, instance=instance, device=config.devices[0], **kwargs)
        except Exception as exc:  # noqa: BLE001 - turned into one clear start-up line
            raise StartupError(str(exc)) from None
        pool_bytes = pool_bytes_for(config, backend)
        if config.backend == "cpu":
            check_cpu_room(config, pool_bytes)
        else:
            check_gpu_room(config, pool_bytes)
        service = PoolService(config, backend, pool_bytes)

        shutdown = asyncio.Event()
        server = grpc.aio.server(options=[
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ])
        pb_grpc.add_KVPoolServicer_to_server(KVPoolServicer(service, shutdown), server)
        address = "unix://" + config.socket
        if server.add_insecure_port(address) == 0:
            raise StartupError(f"cannot listen on {address}")
        await server.start()
        os.chmod(config.socket, config.socket_mode)

        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        reaper = asyncio.create_task(_reap_forever(service))
        log.info("kvpoold %s ready: socket=%s backend=%s pool=%d bytes", service.version, config.socket,
                 config.backend, pool_bytes)
        print(f"kvpoold ready socket={config.socket} backend={config.backend} pool_bytes={pool_bytes}", flush=True)
        if ready is not None:
            ready()
        await stop.wait()
        log.info("stopping: telling %d clients", len(service.sessions))
        service.closing = True
        shutdown.set()
        await asyncio.sleep(0.05)  # let the Watch streams deliver the shutdown event
        reaper.cancel()
        await server.stop(grace=2.0)
        return 0
    finally:
        if service is not None:
            service.close()
        try:
            os.unlink(config.socket)
        except FileNotFoundError:
            pass
        lock.release()


async def _reap_forever(service: PoolService) -> None:
    while True:
        await asyncio.sleep(REAP_INTERVAL_S)
        try:
            service.reap()
        except Exception:  # noqa: BLE001 - the reaper must survive a bad session
            log.exception("reaper failed")


def _instance(socket_path: str) -> str:
    from kvpoold.memory.cpu_shm import instance_id

    return instance_id(os.path.abspath(socket_path))


def run(config: Config) -> int:
    logging.basicConfig(
        level=getattr(logging, config.log_level.upper()),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stdout,
    )
    try:
        return asyncio.run(serve(config))
    except StartupError as exc:
        print(f"kvpoold: {exc}", file=sys.stderr)
        return 2
