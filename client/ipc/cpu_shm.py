"""Client side of the CPU backend: map a daemon's POSIX shared-memory segment.

The daemon creates the segment (``kvpoold.memory.cpu_shm``, which also says
why the files are opened by hand rather than with
``multiprocessing.shared_memory``); a client only maps it, and never unlinks it.
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
    """Client side: maps a daemon's segment read-write."""

    def __init__(self, descriptor: ArenaDescriptor):
        if descriptor.kind != "cpu":
            raise ValueError(f"not a CPU arena descriptor (kind={descriptor.kind!r})")
        raw = descriptor.handle
        path = raw.decode() if isinstance(raw, bytes) else str(raw)
        name = os.path.basename(path)
        if not os.path.isabs(path) or not name.startswith("kvpool-"):
            raise ValueError(f"bad shared-memory segment path {path!r}")
        try:
            fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        except FileNotFoundError:
            raise FileNotFoundError(f"shared-memory segment {path} is gone: has the daemon exited?") from None
        except PermissionError:
            raise PermissionError(
                f"no read-write access to {path}: run as the daemon's user or a group it grants"
            ) from None
        try:
            size = os.fstat(fd).st_size
            if size < descriptor.nbytes:
                raise ValueError(f"segment {path} holds {size} bytes, descriptor says {descriptor.nbytes}")
            mm = mmap.mmap(fd, descriptor.nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)  # the mapping keeps the file alive
        self.name = name
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
