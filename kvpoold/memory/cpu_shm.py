"""CPU backend, daemon side: one sparse POSIX shared-memory file per arena under /dev/shm.

Clients map the segments with ``kvpool.ipc.cpu_shm.CpuMappedArena``.

Why files opened by hand (``os.open`` + ``ftruncate`` + ``mmap``) and not
``multiprocessing.shared_memory``: that module registers every segment with a
resource tracker, which unlinks (and warns about) segments that a *client*
merely attached to when the client exits.  Here only the daemon unlinks.

Memory accounting: ``ftruncate`` reserves nothing; a page is committed when it
is first touched, or eagerly by ``commit`` (``posix_fallocate``, so a full
/dev/shm is reported to the daemon as ``PoolDoesNotFit`` instead of killing a
client with SIGBUS).  ``release`` punches the pages out again with
``madvise(MADV_REMOVE)``; every process that maps the file sees zeros there
afterwards.  tmpfs pages are charged to the memory cgroup of the process that
first touched them.

Names: ``kvpool-<uid>-<instance>-<tag>``.  ``instance`` identifies one daemon
(``instance_id(socket_path)``), so ``remove_stale_segments(instance)`` can
remove what a crashed daemon left behind without touching other daemons'.
"""

from __future__ import annotations

import errno
import hashlib
import mmap
import os
import re
import weakref

from kvpool.ipc.base import BackendUnavailable
from kvpool.ipc.cpu_shm import flat_u8
from kvpool.ipc.views import check_range, typed_view
from kvpool.protocol import ArenaDescriptor

from .base import Arena, Backend, PoolDoesNotFit

SHM_DIR = "/dev/shm"
PAGE = mmap.PAGESIZE
_NAME_MAX = 255
_INSTANCE_RE = re.compile(r"^[A-Za-z0-9_]{1,64}$")


def instance_id(socket_path: str) -> str:
    """A short, stable id of the daemon that owns ``socket_path``."""
    real = os.path.realpath(os.path.abspath(socket_path))
    return hashlib.sha256(real.encode()).hexdigest()[:12]


def _prefix(instance: str) -> str:
    if not _INSTANCE_RE.match(instance):
        # '-' is the separator: an instance containing it could make one
        # daemon's prefix match another daemon's segments.
        raise ValueError(f"instance {instance!r} must be 1-64 of [A-Za-z0-9_]")
    return f"kvpool-{os.getuid()}-{instance}-"


def segment_name(instance: str, tag: str) -> str:
    """``kvpool-<uid>-<instance>-<tag>``, tag made filename-safe."""
    safe = re.sub(r"[^A-Za-z0-9_.-]", "_", tag) or "arena"
    name = _prefix(instance) + safe
    if len(name) > _NAME_MAX:
        raise ValueError(f"segment name too long ({len(name)} > {_NAME_MAX}): shorten the tag")
    return name


def remove_stale_segments(instance: str, shm_dir: str = SHM_DIR) -> list[str]:
    """Unlink this user's segments of daemon ``instance``; returns their names.

    Call only after making sure no live daemon owns the instance (the socket
    is not answering): this removes live segments just as well.
    """
    prefix = _prefix(instance)
    removed = []
    try:
        entries = list(os.scandir(shm_dir))
    except FileNotFoundError:
        return removed
    for e in entries:
        if not e.name.startswith(prefix):
            continue
        try:
            if e.stat(follow_symlinks=False).st_uid != os.getuid():
                continue
            os.unlink(e.path)
            removed.append(e.name)
        except FileNotFoundError:
            pass
    return removed


def _page_inward(offset: int, nbytes: int) -> tuple[int, int]:
    """Largest page-aligned range inside [offset, offset+nbytes)."""
    start = -(-offset // PAGE) * PAGE
    end = (offset + nbytes) // PAGE * PAGE
    return start, max(0, end - start)


def _check_span(offset: int, nbytes: int, total: int) -> None:
    if offset < 0 or nbytes < 0 or offset + nbytes > total:
        raise ValueError(f"range [{offset}, {offset + nbytes}) outside the arena's {total} bytes")


def _close_segment(state: dict) -> None:
    """Release a segment's resources; each one exactly once.

    ``dict.pop`` is a single C call, so a signal handler that runs ``close``
    while another ``close`` is half done cannot release anything twice (an fd
    number closed twice could belong to another file by then).
    """
    if state.get("pid") != os.getpid():  # a forked child must not unlink the parent's
        return
    path = state.pop("path", None)
    if path is not None:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
    mm = state.pop("mm", None)
    if mm is not None:
        try:
            mm.close()
        except BufferError:
            pass  # tensors still view it: it is unmapped when the last one dies
    fd = state.pop("fd", None)
    if fd is not None:
        try:
            os.close(fd)
        except OSError:
            pass


class CpuShmArena(Arena):
    """Daemon side: creates, maps, commits/releases and finally unlinks a segment."""

    def __init__(self, name: str, nbytes: int, shm_dir: str = SHM_DIR, mode: int = 0o600, group: int = -1):
        if nbytes <= 0:
            raise ValueError(f"arena size must be positive, got {nbytes}")
        path = os.path.join(shm_dir, name)
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, mode)
        except FileExistsError:
            raise FileExistsError(
                f"shared-memory segment {path} already exists: another kvpoold with the "
                "same socket is running, or a crashed one left it (remove_stale_segments)"
            ) from None
        self._state = {"pid": os.getpid(), "path": path, "fd": fd}
        self._finalizer = weakref.finalize(self, _close_segment, self._state)
        try:
            if group >= 0:
                os.fchown(fd, -1, group)  # socket_group: the group that may attach may map it too
            os.fchmod(fd, mode)  # umask must not narrow what the operator asked for
            os.ftruncate(fd, nbytes)
            mm = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            self._state["mm"] = mm
            if hasattr(mmap, "MADV_DONTDUMP"):
                mm.madvise(mmap.MADV_DONTDUMP)  # keep a core dump from holding the pool
        except BaseException:
            self.close()
            raise
        self.name = name
        self.path = path
        self.nbytes = nbytes
        self.shm_dir = shm_dir
        self._descriptor = ArenaDescriptor(kind="cpu", nbytes=nbytes, handle=os.path.abspath(path).encode())

    @property
    def descriptor(self) -> ArenaDescriptor:
        return self._descriptor

    def _mm(self) -> mmap.mmap:
        mm = self._state.get("mm")
        if mm is None:
            raise RuntimeError(f"arena {self.name} is closed")
        return mm

    def as_tensor(self, dtype: str, shape, offset: int = 0):
        shape, count = check_range(dtype, shape, offset, self.nbytes)
        return typed_view(flat_u8(self._mm(), count, offset), dtype, shape)

    def commit(self, offset: int, nbytes: int) -> None:
        _check_span(offset, nbytes, self.nbytes)
        fd = self._state.get("fd")
        if fd is None:
            raise RuntimeError(f"arena {self.name} is closed")
        start = offset // PAGE * PAGE
        end = min(self.nbytes, -(-(offset + nbytes) // PAGE) * PAGE)
        try:
            os.posix_fallocate(fd, start, end - start)
        except OSError as e:
            if e.errno != errno.ENOSPC:
                raise
            st = os.statvfs(self.shm_dir)
            free = st.f_bavail * st.f_frsize
            raise PoolDoesNotFit(
                f"{self.shm_dir} is full: committing {end - start} bytes of arena {self.name} "
                f"failed with {free} bytes free; lower --pool-bytes or enlarge {self.shm_dir}"
            ) from None

    def release(self, offset: int, nbytes: int) -> None:
        _check_span(offset, nbytes, self.nbytes)
        start, length = _page_inward(offset, nbytes)
        if length:
            self._mm().madvise(mmap.MADV_REMOVE, start, length)

    def resident_bytes(self) -> int:
        """Bytes of physical memory the segment holds now (for stats)."""
        return os.stat(self.path).st_blocks * 512

    def close(self) -> None:
        self._finalizer()


class CpuShmBackend(Backend):
    """Makes ``CpuShmArena``s named for one daemon instance."""

    name = "cpu"

    def __init__(self, instance: str, shm_dir: str = SHM_DIR, mode: int = 0o600, group: int = -1):
        _prefix(instance)  # validate early
        if not os.path.isdir(shm_dir) or not os.access(shm_dir, os.W_OK | os.X_OK):
            raise BackendUnavailable(f"{shm_dir} is missing or not writable: the CPU backend needs a tmpfs there")
        self.instance = instance
        self.shm_dir = shm_dir
        self.mode = mode
        self.group = group
        self._arenas: list[CpuShmArena] = []

    def create_arena(self, tag: str, nbytes: int) -> CpuShmArena:
        arena = CpuShmArena(segment_name(self.instance, tag), nbytes, self.shm_dir, self.mode, self.group)
        self._arenas.append(arena)
        return arena

    def close(self) -> None:
        while self._arenas:
            try:
                arena = self._arenas.pop()
            except IndexError:  # emptied by a signal handler meanwhile
                break
            arena.close()
