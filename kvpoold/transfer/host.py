"""Tier 1: block copies in host memory (pinned when the pool is on a GPU).

One buffer of ``capacity + staging`` bytes, page-aligned, cut into slots by a
``SlotAllocator`` (slot sizes are block sizes rounded up to 4 KiB, so every
slot can be the buffer of an ``O_DIRECT`` read or write).  ``capacity`` is
what the core's host tier accounts; ``staging`` is room for copies in flight
that the core no longer counts: a block being written to disk after the core
pushed it down, a block on its way from disk to the GPU.  When no slot is
free the transfer engine waits for copies in flight to finish.

A slot is *pinned* while a copy reads or writes it; a slot whose key was
forgotten meanwhile (``release``) returns to the allocator when its last pin
goes.  Only the daemon's event loop calls this class (worker threads touch
the bytes of slots they were handed, never the bookkeeping).

On the GPU backend the buffer is page-locked (``cudaHostAlloc`` through CuPy),
so host <-> device copies are DMA transfers that run asynchronously on a
stream; on the CPU backend it is plain anonymous memory, committed as it is
touched.
"""

from __future__ import annotations

import mmap

import numpy as np

from .slots import SlotAllocator

ALIGN = 4096


class Slot:
    """A piece of host memory holding one block (``offset`` -1: a temporary buffer)."""

    __slots__ = ("offset", "size", "_buf", "pins", "orphan")

    def __init__(self, offset: int, size: int, buf: np.ndarray) -> None:
        self.offset = offset
        self.size = size
        self._buf = buf  # the store's whole buffer, or the temporary buffer itself (offset -1)
        self.pins = 0
        self.orphan = False  # its key is gone: free it when the last pin goes

    @property
    def view(self) -> np.ndarray:
        """The slot's ``size`` bytes (made on use: the GPU path copies by offset and never needs it)."""
        if self.offset < 0:
            return self._buf
        return self._buf[self.offset:self.offset + self.size]


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
        self.nbytes = -(-(capacity + staging) // ALIGN) * ALIGN
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
        self.entries: dict[tuple, Slot] = {}
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
    def alloc(self, nbytes: int) -> Slot | None:
        off = self.slots.alloc(nbytes)
        if off is None:
            return None
        return Slot(off, self.slots.size_of(off), self.buf)

    @staticmethod
    def temp(nbytes: int) -> Slot:
        """A buffer outside the store (when it has no slot and nothing in flight will free one)."""
        size = -(-nbytes // ALIGN) * ALIGN
        return Slot(-1, size, aligned_empty(size))

    def pin(self, slot: Slot) -> None:
        slot.pins += 1

    def unpin(self, slot: Slot) -> None:
        slot.pins -= 1
        if slot.pins == 0 and slot.orphan:
            self._free(slot)

    def release(self, slot: Slot) -> None:
        """The slot's bytes are no longer needed (now, or when its last copy ends)."""
        if slot.pins:
            slot.orphan = True
        else:
            self._free(slot)

    def _free(self, slot: Slot) -> None:
        slot.orphan = False
        if slot.offset >= 0:
            self.slots.free(slot.offset)
            slot.offset, slot._buf = -2, None  # freed: a second free or a late read must fail loudly

    # -- keyed entries --------------------------------------------------------------------------
    def put(self, key: tuple, slot: Slot) -> None:
        assert key not in self.entries, f"host tier already holds {key}"
        self.entries[key] = slot

    def pop(self, key: tuple) -> Slot | None:
        return self.entries.pop(key, None)

    def drop(self, key: tuple) -> bool:
        slot = self.entries.pop(key, None)
        if slot is None:
            return False
        self.release(slot)
        return True

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
