"""CPU backend, daemon side: one sparse anonymous shared-memory file (memfd) per arena.

Clients map an arena with ``kvpool.ipc.cpu_shm.CpuMappedArena`` from a file
descriptor the daemon hands them over its side socket (``SCM_RIGHTS``,
``kvpoold/server/handoff.py``) once the kernel's credentials of the asking
process match those of the session.  The memory has no name anywhere in a
file system: nobody can squat it before the daemon starts, open it by path,
or find it left behind after a crash (the kernel frees it with the last
descriptor or mapping).

Sealing: a client holds the very same file, so before its descriptor can
leave the daemon its size is sealed (``ARENA_SEALS``: no shrinking, no
growing, no further seals).  A client that could shrink it would make the
daemon's next read of the arena (a swap-out, a demotion, a remote write)
fault with SIGBUS and kill it for every tenant; one that could grow it would
hold memory no budget counts, after it exits too.  Writing, punching holes
and ``posix_fallocate`` inside the size stay possible (the daemon commits and
releases with them); none of them can fault a reader.

Memory accounting: ``ftruncate`` reserves nothing; a page is committed when it
is first touched, or eagerly by ``commit`` (``posix_fallocate``, so memory that
cannot be had is reported to the daemon as ``PoolDoesNotFit`` instead of
killing a client with SIGBUS).  ``release`` punches the pages out again with
``madvise(MADV_REMOVE)``; every process that maps the file sees zeros there
afterwards.  shmem pages are charged to the memory cgroup of the process that
first touched them.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import mmap
import os
import re
import weakref

from kvpool.ipc.base import BackendUnavailable
from kvpool.ipc.cpu_shm import flat_u8
from kvpool.ipc.views import check_range, typed_view
from kvpool.protocol import ArenaDescriptor
from kvpool.protocol.sizes import cdiv

from .base import Arena, Backend, PoolDoesNotFit

SHM_DIR = "/dev/shm"
PAGE = mmap.PAGESIZE
_INSTANCE_RE = re.compile(r"^[A-Za-z0-9_]{1,64}$")
#: seals of every arena before its fd is handed out: its size is fixed and no one can add F_SEAL_WRITE
ARENA_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL


def instance_id(socket_path: str) -> str:
    """A short, stable id of the daemon that owns ``socket_path`` (labels its memory in /proc/<pid>/maps)."""
    real = os.path.realpath(os.path.abspath(socket_path))
    return hashlib.sha256(real.encode()).hexdigest()[:12]


def _page_inward(offset: int, nbytes: int) -> tuple[int, int]:
    """Largest page-aligned range inside [offset, offset+nbytes)."""
    start = cdiv(offset, PAGE) * PAGE
    end = (offset + nbytes) // PAGE * PAGE
    return start, max(0, end - start)


def _check_span(offset: int, nbytes: int, total: int) -> None:
    if offset < 0 or nbytes < 0 or offset + nbytes > total:
        raise ValueError(f"range [{offset}, {offset + nbytes}) outside the arena's {total} bytes")


def _close_arena(state: dict) -> None:
    """Release an arena's mapping and descriptor; each exactly once.

    ``dict.pop`` is a single C call, so a signal handler that runs ``close``
    while another ``close`` is half done cannot release anything twice (an fd
    number closed twice could belong to another file by then).
    """
    if state.get("pid") != os.getpid():  # a forked child must not close the parent's
        return
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
    """Daemon side: creates, maps, commits/releases and finally closes an anonymous memfd."""

    def __init__(self, name: str, nbytes: int, shm_dir: str = SHM_DIR):
        if nbytes <= 0:
            raise ValueError(f"arena size must be positive, got {nbytes}")
        # the name is a label only (/proc/<pid>/maps shows "memfd:<name>"): nothing can be opened by it
        fd = os.memfd_create(name[:200], os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        self._state = {"pid": os.getpid(), "fd": fd}
        self._finalizer = weakref.finalize(self, _close_arena, self._state)
        try:
            os.ftruncate(fd, nbytes)
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, ARENA_SEALS)
            mm = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            self._state["mm"] = mm
            if hasattr(mmap, "MADV_DONTDUMP"):
                mm.madvise(mmap.MADV_DONTDUMP)  # keep a core dump from holding the pool
        except BaseException:
            self.close()
            raise
        self.name = name
        self.nbytes = nbytes
        self.shm_dir = shm_dir
        self._descriptor = ArenaDescriptor(kind="memfd", nbytes=nbytes, handle=name.encode())

    @property
    def descriptor(self) -> ArenaDescriptor:
        return self._descriptor

    def fileno(self) -> int:
        """The memfd: the side socket sends it to the processes of the sessions of this arena only."""
        fd = self._state.get("fd")
        if fd is None:
            raise RuntimeError(f"arena {self.name} is closed")
        return fd

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
        fd = self.fileno()
        start = offset // PAGE * PAGE
        end = min(self.nbytes, cdiv(offset + nbytes, PAGE) * PAGE)
        try:
            os.posix_fallocate(fd, start, end - start)
        except OSError as e:
            if e.errno != errno.ENOSPC:
                raise
            raise PoolDoesNotFit(
                f"no memory left: committing {end - start} bytes of arena {self.name} failed; "
                "lower --pool-bytes"
            ) from None

    client_writable = True

    def release(self, offset: int, nbytes: int) -> None:
        _check_span(offset, nbytes, self.nbytes)
        start, length = _page_inward(offset, nbytes)
        if length:
            self._mm().madvise(mmap.MADV_REMOVE, start, length)

    def resident_bytes(self) -> int:
        """Bytes of physical memory the arena holds now (for stats)."""
        return os.fstat(self.fileno()).st_blocks * 512

    def close(self) -> None:
        self._finalizer()


class CpuShmBackend(Backend):
    """Makes ``CpuShmArena``s for one daemon instance (the instance only labels them)."""

    name = "cpu"
    memory = "shm"

    def __init__(self, instance: str, shm_dir: str = SHM_DIR):
        if not _INSTANCE_RE.match(instance):
            raise ValueError(f"instance {instance!r} must be 1-64 of [A-Za-z0-9_]")
        if not hasattr(os, "memfd_create"):
            raise BackendUnavailable("the CPU backend needs memfd_create (Linux)")
        self.instance = instance
        self.shm_dir = shm_dir  # only where start-up looks for room (check_cpu_room)
        self._arenas: list[CpuShmArena] = []

    def create_arena(self, tag: str, nbytes: int, class_id: int = 0, tenant: str = "") -> CpuShmArena:
        safe = re.sub(r"[^A-Za-z0-9_.-]", "_", tag) or "arena"
        arena = CpuShmArena(f"kvpool-{self.instance}-{safe}", nbytes, self.shm_dir)
        self._arenas.append(arena)
        return arena

    def close(self) -> None:
        while self._arenas:
            try:
                arena = self._arenas.pop()
            except IndexError:  # emptied by a signal handler meanwhile
                break
            arena.close()
