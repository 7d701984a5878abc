"""Tier 1: block copies in host memory (pinned when the pool is on a GPU).

One buffer of ``capacity + staging`` bytes, page-aligned, cut into slots by a
``SlotAllocator`` (slot sizes are block sizes rounded up to 4 KiB, so every
slot can be the buffer of an ``O_DIRECT`` read or write).  ``capacity`` is
what the core's host tier accounts; ``staging`` is room for copies in flight
that the core no longer counts: a block being written to disk after the core
pushed it down, a block on its way from disk to the GPU.  When no slot is
free the transfer engine waits for copies in flight to finish.

Slots are plain byte offsets, handled a batch at a time (``alloc_array``,
``put_many``, ``pop_many``, ``free_many``): taking and freeing slots are a few
numpy operations per batch (``SlotAllocator``), and a batch's keys are
recorded and forgotten with one C-level dict call each; the batch's offsets,
mostly consecutive, are what the copier turns into a few large DMAs.  A
slot's key is forgotten (``pop_many``) before a copy reads it for a lower
tier or the device; the copy then owns the slot and
frees it when it is done, so a slot is never reused while a copy reads or
writes it.  Only the daemon's event loop calls this class (worker threads
touch the bytes of slots they were handed, never the bookkeeping).

On the GPU backend the buffer is page-locked (``cudaHostAlloc`` through CuPy),
so host <-> device copies are DMA transfers that run asynchronously on a
stream; on the CPU backend it is plain anonymous memory, committed as it is
touched.
"""

from __future__ import annotations

import mmap
from itertools import repeat

import numpy as np

from kvpool.protocol.sizes import cdiv

from .slots import SlotAllocator

ALIGN = 4096


def aligned_empty(nbytes: int, align: int = ALIGN) -> np.ndarray:
    """A page-aligned uint8 array (for O_DIRECT buffers outside the host store)."""
    raw = np.empty(nbytes + align, np.uint8)
    start = (-raw.ctypes.data) % align
    return raw[start:start + nbytes]


class _PinnedAlloc:
    """Page-locked host memory from ``cudaHostAlloc`` (exact size), freed by ``close``."""

    def __init__(self, nbytes: int, device: int) -> None:
        import ctypes

        import cupy

        self._rt = cupy.cuda.runtime
        with cupy.cuda.Device(device):
            self.ptr = self._rt.hostAlloc(nbytes, 0)
        self.array = np.frombuffer((ctypes.c_uint8 * nbytes).from_address(self.ptr), np.uint8, nbytes)

    def close(self) -> None:
        ptr, self.ptr = self.ptr, 0
        if ptr:
            self._rt.freeHost(ptr)


def _pinned_buffer(nbytes: int, device: int):
    """(numpy view, owner) of page-locked host memory: CuPy's cudaHostAlloc, else torch's."""
    try:
        owner = _PinnedAlloc(nbytes, device)
        return owner.array, owner
    except ImportError:
        import torch

        t = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)  # rounds up to a power of two
        return t.numpy(), t


class HostStore:
    def __init__(self, capacity: int, staging: int, cuda_device: int | None = None) -> None:
        if capacity < 0 or staging < 0:
            raise ValueError("host capacity and staging must be >= 0")
        self.capacity = capacity
        self.nbytes = cdiv(capacity + staging, ALIGN) * ALIGN
        self.cuda_device = cuda_device
        self._keep = None
        if self.nbytes == 0:
            self.buf = np.zeros(0, np.uint8)
        elif cuda_device is not None:
            self.buf, self._keep = _pinned_buffer(self.nbytes, cuda_device)
        else:
            self._keep = mmap.mmap(-1, self.nbytes, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            self.buf = np.frombuffer(self._keep, np.uint8, self.nbytes)
        self.slots = SlotAllocator(self.nbytes, ALIGN)
        self.entries: dict[tuple, int] = {}  # key -> slot offset
        self._tensor = None

    @property
    def pinned(self) -> bool:
        return self.cuda_device is not None

    @property
    def tensor(self):
        """The whole buffer as a torch uint8 tensor (no copy)."""
        if self._tensor is None:
            import torch

            self._tensor = torch.from_numpy(self.buf)
        return self._tensor

    # -- slots --------------------------------------------------------------------------------
    def stride(self, nbytes: int) -> int:
        """The size of the slot a block of ``nbytes`` takes."""
        return self.slots.round(max(1, nbytes))

    def alloc_many(self, nbytes: int, n: int) -> list[int]:
        """Offsets of up to ``n`` free slots for blocks of ``nbytes`` (fewer when the buffer is full)."""
        return self.slots.alloc_many(nbytes, n)

    def alloc_array(self, nbytes: int, n: int) -> np.ndarray:
        """``alloc_many`` as an int64 array (no list: what the engine hands the copier)."""
        return self.slots.alloc_array(nbytes, n)

    def free_many(self, offsets) -> None:
        """Give slots back (their copies are done, or their keys were dropped); a list or an int64 array."""
        self.slots.free_many(offsets)

    def view(self, offset: int, nbytes: int) -> np.ndarray:
        return self.buf[offset:offset + nbytes]

    @staticmethod
    def temp(nbytes: int, n: int) -> tuple[np.ndarray, int]:
        """(buffer, stride): room for ``n`` blocks outside the store (it is full and nothing will free a slot)."""
        stride = cdiv(max(1, nbytes), ALIGN) * ALIGN
        return aligned_empty(stride * n), stride

    # -- keyed entries --------------------------------------------------------------------------
    def put_many(self, keys: list, offsets: list[int]) -> None:
        """Record ``keys[i]`` in slot ``offsets[i]``."""
        entries = self.entries
        before = len(entries)
        entries.update(zip(keys, offsets))
        assert len(entries) == before + len(keys), "the host tier already holds some of these keys"

    def pop_many(self, keys: list) -> list[int]:
        """Forget the keys; their slots (-1: not held) now belong to the caller, who frees them."""
        return list(map(self.entries.pop, keys, repeat(-1, len(keys))))

    def pop_array(self, keys: list) -> np.ndarray:
        """``pop_many`` as an int64 array (no list in between: what the engine hands the copier)."""
        return np.fromiter(map(self.entries.pop, keys, repeat(-1, len(keys))), np.int64, len(keys))

    def drop_many(self, keys: list) -> int:
        """Forget the keys and free their slots; returns how many were held."""
        offs = [o for o in self.pop_many(keys) if o >= 0]
        self.free_many(offs)
        return len(offs)

    def __contains__(self, key: tuple) -> bool:
        return key in self.entries

    def close(self) -> None:
        self.entries.clear()
        self._tensor = None
        self.buf = np.zeros(0, np.uint8)
        keep, self._keep = self._keep, None
        if isinstance(keep, mmap.mmap):
            try:
                keep.close()
            except BufferError:
                pass  # views still alive: unmapped when they die
        elif isinstance(keep, _PinnedAlloc):
            keep.close()  # the daemon is stopping: nothing copies any more
