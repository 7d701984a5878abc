"""CUDA virtual memory management (VMM): one virtual range per arena, physical chunks mapped into it.

The daemon creates physical memory in chunks (``cuMemCreate``, exportable as
POSIX file descriptors) and maps each chunk at a chunk-aligned offset of a
class's virtual range, so block ``i`` stays at ``i * block_bytes``: kernels
keep one base pointer and one stride.  A client reserves a range of the same
size in its own address space and maps the same chunks at the same offsets,
importing them from file descriptors the daemon hands it over the side socket
(``kvpool.handoff.sync_chunks``).  Chunks join and leave a range while both
processes run; see ``kvpoold/memory/chunk_ledger.py`` for the rule that keeps
a process from touching a chunk that is not mapped or was given to someone else.

The driver API comes from ``cuda.bindings`` (``cuda-python``), imported on
first use: the CPU path never needs it.  Every call runs in the device's
primary context, the one CuPy and torch use, so pointers mix freely.
"""

from __future__ import annotations

import os
import threading
import weakref

import numpy as np

from ..protocol.arena import ArenaDescriptor
from .base import BackendUnavailable, MappedArena
from .cuda import DeviceBytes, DeviceViews, bus_id, cuda_runtime, device_index, probe_cuda, resolve_device

_driver = None


def driver():
    """``cuda.bindings.driver``, initialised; ``BackendUnavailable`` if missing."""
    global _driver
    if _driver is None:
        try:
            from cuda.bindings import driver as cu
        except ImportError as e:
            raise BackendUnavailable(
                f"CUDA virtual memory needs cuda-python ({e}): pip install 'kvpool[cuda13]'"
            ) from None
        check(cu.cuInit(0), "cuInit")
        _driver = cu
    return _driver


class DriverError(RuntimeError):
    """A CUDA driver call failed; the message names the call and the driver's reason."""


def check(result, what: str):
    """The values of a ``cuda.bindings`` call after its status; ``DriverError`` unless CUDA_SUCCESS."""
    status, *values = result if isinstance(result, tuple) else (result,)
    cu = _driver
    if cu is None:
        from cuda.bindings import driver as cu
    if status != cu.CUresult.CUDA_SUCCESS:
        err, text = cu.cuGetErrorString(status)
        reason = text.decode() if err == cu.CUresult.CUDA_SUCCESS and text else str(status)
        raise DriverError(f"{what} failed: {reason}")
    if not values:
        return None
    return values[0] if len(values) == 1 else tuple(values)


_contexts: dict[int, object] = {}
_ctx_lock = threading.Lock()


def use_device(device: int):
    """Make ``device``'s primary context current on this thread (the one CuPy and torch use)."""
    cu = driver()
    with _ctx_lock:
        ctx = _contexts.get(device)
        if ctx is None:
            dev = check(cu.cuDeviceGet(device), "cuDeviceGet")
            ctx = _contexts[device] = check(cu.cuDevicePrimaryCtxRetain(dev), "cuDevicePrimaryCtxRetain")
    check(cu.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
    return cu


def allocation_prop(device: int):
    """Pinned device memory on ``device`` that can be exported as a POSIX file descriptor."""
    cu = driver()
    prop = cu.CUmemAllocationProp()
    prop.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    prop.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    prop.location.id = device
    prop.requestedHandleTypes = cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
    return prop


def granularity(device: int) -> int:
    """The smallest chunk the driver maps on ``device`` (2 MiB on current GPUs)."""
    cu = use_device(device)
    flag = cu.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM
    return int(check(cu.cuMemGetAllocationGranularity(allocation_prop(device), flag), "cuMemGetAllocationGranularity"))


def posix_fd_type():
    return driver().CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR


def chunks_cover(chunk_of: np.ndarray, blocks, block_bytes: int, chunk_bytes: int) -> bool:
    """Whether every place holding a byte of ``blocks`` has a chunk in ``chunk_of`` (place -> chunk id, 0: none).

    A block larger than a chunk spans several places: all of them, not only its first and last.
    """
    b = np.asarray(blocks, np.int64)
    if b.size == 0:
        return True
    first, last = b * block_bytes // chunk_bytes, ((b + 1) * block_bytes - 1) // chunk_bytes
    if last.max() >= len(chunk_of) or first.min() < 0:
        return False
    if not (chunk_of[first].all() and chunk_of[last].all()):
        return False
    inner = np.flatnonzero(last - first > 1)
    return all(chunk_of[first[i] + 1:last[i]].all() for i in inner.tolist())


class VirtualRange:
    """A reserved virtual range on one device, with chunks mapped at chunk-aligned offsets.

    ``map``/``unmap`` are not thread-safe by themselves: the owner serialises them.
    The range is freed by ``free`` once nothing views it (``DeviceBytes``'s finalizer).
    """

    def __init__(self, device: int, nbytes: int, chunk_bytes: int) -> None:
        if nbytes <= 0 or chunk_bytes <= 0 or nbytes % chunk_bytes:
            raise ValueError(f"a virtual range of {nbytes} bytes is not whole chunks of {chunk_bytes}")
        cu = use_device(device)
        self.device, self.nbytes, self.chunk_bytes = device, nbytes, chunk_bytes
        self.base = int(check(cu.cuMemAddressReserve(nbytes, chunk_bytes, 0, 0), "cuMemAddressReserve"))
        self.handles: dict[int, object] = {}  # chunk index -> handle mapped there
        access = cu.CUmemAccessDesc()
        access.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        access.location.id = device
        access.flags = cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        self._access = access

    @property
    def chunks(self) -> int:
        return self.nbytes // self.chunk_bytes

    def map(self, index: int, handle) -> None:
        """Map ``handle`` at chunk ``index`` (read-write on the device); the range keeps a reference."""
        if not 0 <= index < self.chunks:
            raise ValueError(f"chunk {index} is outside the range's {self.chunks} chunks")
        if index in self.handles:
            raise ValueError(f"chunk {index} is already mapped")
        cu = use_device(self.device)
        address, size = self.base + index * self.chunk_bytes, self.chunk_bytes
        check(cu.cuMemMap(address, size, 0, handle, 0), "cuMemMap")
        try:
            check(cu.cuMemSetAccess(address, size, [self._access], 1), "cuMemSetAccess")
        except BaseException:
            cu.cuMemUnmap(address, size)
            raise
        self.handles[index] = handle

    def unmap(self, index: int):
        """Unmap chunk ``index``; returns its handle (the caller releases it), None if nothing was there."""
        handle = self.handles.pop(index, None)
        if handle is not None:
            cu = use_device(self.device)
            check(cu.cuMemUnmap(self.base + index * self.chunk_bytes, self.chunk_bytes), "cuMemUnmap")
        return handle

    def free(self, release_handles: bool) -> None:
        """Unmap every chunk (releasing the handles if ``release_handles``) and give the range back."""
        cu = use_device(self.device)
        for index in list(self.handles):
            handle = self.unmap(index)
            if release_handles:
                cu.cuMemRelease(handle)
        if self.base:
            cu.cuMemAddressFree(self.base, self.nbytes)
            self.base = 0


def _free_range(vrange: VirtualRange, release_handles: bool) -> None:
    try:
        vrange.free(release_handles)
    except Exception:  # noqa: BLE001 - interpreter or driver going away: the process exit frees it
        pass


class VmmMappedArena(DeviceViews, MappedArena):
    """Client side: a class's virtual range with the daemon's chunks imported and mapped.

    ``device``: where this client runs (int, "cuda:N", torch.device or None);
    ``DeviceMismatch`` if that is not the pool's GPU.  Chunks arrive through
    ``apply`` (``kvpool.handoff.sync_chunks`` drives it); ``covers`` tells the
    client whether every byte of some blocks is mapped here yet.
    """

    def __init__(self, descriptor: ArenaDescriptor, device=None):
        if descriptor.kind != "cuda_vmm":
            raise ValueError(f"not a CUDA VMM arena descriptor (kind={descriptor.kind!r})")
        reason = probe_cuda(check_ipc=False)
        if reason is not None:
            raise BackendUnavailable(f"cannot map a CUDA pool in this process: {reason}")
        rt = cuda_runtime()
        local = [bus_id(i) for i in range(rt.getDeviceCount())]
        dev = resolve_device(descriptor.device_id, descriptor.device, device_index(device), local)
        self.device, self.nbytes, self.chunk_bytes = dev, descriptor.nbytes, descriptor.chunk_bytes
        self._range = VirtualRange(dev, descriptor.nbytes, descriptor.chunk_bytes)
        self.chunk_of = np.zeros(self._range.chunks, np.int64)  # index -> chunk id mapped there, 0: none
        self._mem = DeviceBytes(self._range.base, descriptor.nbytes, dev, lambda _ptr: None)
        # the range outlives close() while views of it exist: freed with the last one
        weakref.finalize(self._mem, _free_range, self._range, True)

    # -- what is mapped ----------------------------------------------------------------
    def covers(self, blocks, block_bytes: int) -> bool:
        """Whether every chunk holding a byte of ``blocks`` (block ids) is mapped here."""
        return chunks_cover(self.chunk_of, blocks, block_bytes, self.chunk_bytes)

    def mapped(self) -> dict[int, int]:
        """chunk index -> chunk id of what is mapped now."""
        idx = np.flatnonzero(self.chunk_of)
        return dict(zip(idx.tolist(), self.chunk_of[idx].tolist()))

    # -- changes (one at a time: under the client's lock) ----------------------------------
    def unmap(self, index: int) -> None:
        handle = self._range.unmap(index)
        if handle is not None:
            check(driver().cuMemRelease(handle), "cuMemRelease")
        self.chunk_of[index] = 0

    def map_fd(self, index: int, chunk: int, fd: int) -> None:
        """Import the chunk behind ``fd`` (closed here) and map it at ``index``."""
        try:
            cu = use_device(self.device)
            handle = check(cu.cuMemImportFromShareableHandle(fd, posix_fd_type()), "cuMemImportFromShareableHandle")
        finally:
            os.close(fd)
        try:
            if self.chunk_of[index]:
                self.unmap(index)
            self._range.map(index, handle)
        except BaseException:
            cu.cuMemRelease(handle)
            raise
        self.chunk_of[index] = chunk

    def close(self) -> None:
        """Drop this arena; the chunks are unmapped and the range freed once no view of it is left."""
        self._mem = None
