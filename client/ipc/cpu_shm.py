"""Client side of the CPU backend: map a daemon's arena, an anonymous memfd.

The daemon creates the memfd (``kvpoold.memory.cpu_shm``) and sends it over
its side socket to the process that attached the session
(``kvpool.handoff.arena_fd``); the client maps it and closes the descriptor.
There is no name to open.
"""

from __future__ import annotations

import mmap
import os
import weakref

from ..protocol.arena import ArenaDescriptor
from .base import MappedArena
from .views import check_range, typed_view


def flat_u8(mm: mmap.mmap, count: int, offset: int):
    """A uint8 torch tensor over ``mm[offset:offset+count]`` that pins the mapping.

    Not ``torch.frombuffer``: it drops its buffer export at once, so a later
    ``mmap.close()`` would unmap under a live tensor (segfault).  A NumPy array
    keeps the export, which makes ``mmap.close()`` raise BufferError instead,
    and the tensor keeps the array alive.
    """
    import numpy as np
    import torch

    return torch.from_numpy(np.frombuffer(mm, dtype=np.uint8, count=count, offset=offset))


def _unmap(state: dict) -> None:
    mm = state.pop("mm", None)
    if mm is not None:
        try:
            mm.close()
        except BufferError:
            pass  # tensors still view it: unmapped when the last one dies


class CpuMappedArena(MappedArena):
    """Client side: maps a daemon's arena read-write from the memfd the daemon handed this process."""

    def __init__(self, descriptor: ArenaDescriptor, fd: int | None = None):
        if descriptor.kind != "memfd":
            raise ValueError(f"not a CPU arena descriptor (kind={descriptor.kind!r})")
        if fd is None:
            raise ValueError("a CPU arena is mapped from the file descriptor the daemon sends (kvpool.connect)")
        raw = descriptor.handle
        self.name = raw.decode(errors="replace") if isinstance(raw, bytes) else str(raw)
        try:
            size = os.fstat(fd).st_size
            if size < descriptor.nbytes:
                raise ValueError(f"arena {self.name} holds {size} bytes, descriptor says {descriptor.nbytes}")
            mm = mmap.mmap(fd, descriptor.nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)  # the mapping keeps the memory alive
        self.nbytes = descriptor.nbytes
        self._state = {"mm": mm}
        self._finalizer = weakref.finalize(self, _unmap, self._state)

    def as_tensor(self, dtype: str, shape, offset: int = 0):
        mm = self._state.get("mm")
        if mm is None:
            raise RuntimeError(f"mapping of {self.name} is closed")
        shape, count = check_range(dtype, shape, offset, self.nbytes)
        return typed_view(flat_u8(mm, count, offset), dtype, shape)

    def close(self) -> None:
        self._finalizer()
