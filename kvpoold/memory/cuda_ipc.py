"""CUDA backend: one plain device allocation per arena, shared by legacy CUDA IPC.

The daemon allocates each arena with ``cudaMalloc`` (through CuPy's runtime
bindings; no memory pool, no managed memory) on its device and exports
``cudaIpcGetMemHandle``.  A client opens the handle with
``cudaIpcOpenMemHandle`` on the *same physical GPU* (found by PCI bus id, so
CUDA_VISIBLE_DEVICES may differ between the processes) and gets zero-copy
torch / CuPy views.  CuPy is imported lazily: the CPU path never needs it.

``release`` is a no-op here: a legacy IPC allocation cannot give part of
itself back.  The later step is CUDA VMM (reserve a virtual range per class,
``cuMemCreate``/``cuMemMap`` 2 MiB chunks in and out, export them as POSIX fd
handles over a Unix socket with SCM_RIGHTS).

Ordering between processes (the rule clients follow)
----------------------------------------------------
Each party owns one *fence* per GPU: an interprocess CUDA event
(``cudaEventInterprocess | cudaEventDisableTiming``), shared by its IPC
event handle.  The daemon's fence handle is in every CUDA
``ArenaDescriptor.fence``; a client sends its own fence handle when it
attaches.  ``cudaStreamWaitEvent`` waits for the most recent
``cudaEventRecord`` *issued before the wait call*, in any process; an RPC
orders the two host calls, so:

1. Copy-on-write copies are run by the client, in its own stream, after its
   own KV writes (``kvpool.kernels.block_copy.copy_blocks``): no fence needed.
2. Before an RPC that makes the daemon read or write pool blocks on the GPU
   (swap out / swap in, daemon-side copies), the client calls
   ``my_fence.record(stream)`` on the stream that wrote those blocks.  The
   daemon calls ``client_fence.wait(copy_stream)`` before it enqueues the
   copies, then ``daemon_fence.record(copy_stream)`` before it replies.
3. After such a reply, before touching the blocks, the client calls
   ``mapped_arena.daemon_fence.wait(stream)``.

No host thread blocks anywhere.  A client without events may instead
``torch.cuda.synchronize()`` before the RPC and ``daemon_fence.synchronize()``
after it (correct, slower).
"""

from __future__ import annotations

import os
import weakref

from ._views import check_range, typed_view
from .base import (
    Arena,
    ArenaDescriptor,
    Backend,
    BackendUnavailable,
    DeviceMismatch,
    MappedArena,
    PoolDoesNotFit,
)

MiB = 1 << 20
_EVENT_FLAGS = 2 | 4  # cudaEventDisableTiming | cudaEventInterprocess
_IPC_LAZY_PEER = 1  # cudaIpcMemLazyEnablePeerAccess


def _cupy():
    try:
        import cupy
    except ImportError as e:
        raise BackendUnavailable(
            f"CuPy is not installed ({e}): pip install 'kvpool[cuda13]' (CUDA 13) or "
            "'kvpool[cuda]' (CUDA 12), or run with --backend cpu"
        ) from None
    return cupy


def _rt():
    return _cupy().cuda.runtime


def probe_cuda(device: int | None = None, check_ipc: bool = True) -> str | None:
    """None if the CUDA backend can run on ``device`` (default: the first GPU), else why not.

    With ``check_ipc`` it creates a CUDA context on that one device and
    exports a 2 MiB test allocation, so IPC that the platform refuses (WSL,
    some containers) is caught here rather than at the first attach.
    """
    try:
        import cupy
    except ImportError as e:
        return f"CuPy is not installed ({e})"
    rt = cupy.cuda.runtime
    try:
        count = rt.getDeviceCount()
    except Exception as e:  # CUDARuntimeError: no driver / driver too old / no device
        return f"no usable CUDA driver or GPU ({e})"
    if count == 0:
        vis = os.environ.get("CUDA_VISIBLE_DEVICES")
        return "no CUDA GPU is visible" + (f" (CUDA_VISIBLE_DEVICES={vis!r})" if vis is not None else "")
    d = 0 if device is None else device
    if not 0 <= d < count:
        return f"CUDA device {d} does not exist: {count} GPU(s) visible"
    if not check_ipc:
        return None
    try:
        with cupy.cuda.Device(d):
            ptr = rt.malloc(2 * MiB)
            try:
                rt.ipcGetMemHandle(ptr)
            finally:
                rt.free(ptr)
    except Exception as e:
        return f"CUDA IPC does not work on device {d} ({e})"
    return None


def bus_id(device: int) -> str:
    """PCI bus id of a local CUDA ordinal, upper-case ("0000:3B:00.0")."""
    return _rt().deviceGetPCIBusId(device).upper()


def client_bus_id(device=None) -> str:
    """PCI bus id of the GPU this process works on: ``device``, else torch's current device; "" if none.

    Sent at attach so that a daemon serving several GPUs binds the session to
    that GPU's pool.  Without ``device``, torch's current device counts only
    once this process uses CUDA through torch (``torch.cuda.is_initialized()``,
    e.g. after ``torch.cuda.set_device`` or a model moved to the GPU): the
    attach itself neither imports torch nor starts CUDA.  An explicit
    ``device`` this process cannot see raises ``DeviceMismatch``; without
    CuPy the answer is "" (the daemon decides; mapping a CUDA pool needs CuPy
    anyway and says so).
    """
    import sys

    if device is not None and str(device) == "cpu":
        return ""
    index = _device_index(device)  # None for None and "cuda"
    if index is None:
        torch = sys.modules.get("torch")
        try:
            if torch is None or not torch.cuda.is_initialized():
                return ""
            return bus_id(torch.cuda.current_device())
        except Exception:  # noqa: BLE001 - no usable CUDA or CuPy here: the process names no GPU
            return ""
    try:
        count = _rt().getDeviceCount()
    except BackendUnavailable:
        return ""
    except Exception as e:  # noqa: BLE001 - CUDARuntimeError: no driver, no GPU
        raise DeviceMismatch(f"device={device!r}: no usable CUDA GPU in this process ({e})") from None
    if not 0 <= index < count:
        vis = os.environ.get("CUDA_VISIBLE_DEVICES")
        raise DeviceMismatch(f"device={device!r}: this process sees {count} GPU(s)"
                             + (f" (CUDA_VISIBLE_DEVICES={vis!r})" if vis is not None else ""))
    return bus_id(index)


def device_memory(device: int) -> tuple[int, int]:
    """(free, total) bytes on ``device``."""
    with _cupy().cuda.Device(device):
        return _rt().memGetInfo()


def pool_bytes_for_fraction(device: int = 0, fraction: float = 0.9, align: int = 2 * MiB) -> int:
    """Pool size from ``--gpu-memory-fraction``: that share of what is free now.

    Unlike vLLM's gpu_memory_utilization (a share of the total), this is a
    share of the *free* memory at start, so other tenants are left alone.
    """
    if not 0 < fraction <= 1:
        raise ValueError(f"gpu_memory_fraction must be in (0, 1], got {fraction}")
    free, _ = device_memory(device)
    return int(free * fraction) // align * align


def _stream_ptr(stream, device: int) -> int:
    """A raw cudaStream_t from None (torch's current), an int, a torch or CuPy stream."""
    if stream is None:
        try:
            import torch

            return torch.cuda.current_stream(device).cuda_stream
        except ImportError:
            return _cupy().cuda.get_current_stream().ptr
    if isinstance(stream, int):
        return stream
    for attr in ("cuda_stream", "ptr"):
        if hasattr(stream, attr):
            return int(getattr(stream, attr))
    raise TypeError(f"not a CUDA stream: {stream!r}")


def resolve_device(pool_bus: str, pool_ordinal: int, requested: int | None, local_buses: list[str]) -> int:
    """The local ordinal of the pool's GPU; ``DeviceMismatch`` if that is not ``requested``.

    Pure (the bus ids are passed in) so that it is tested without a GPU.
    """
    vis = os.environ.get("CUDA_VISIBLE_DEVICES")
    vis_note = f" (CUDA_VISIBLE_DEVICES={vis!r})" if vis is not None else ""
    if not pool_bus:  # old descriptor: trust the ordinal
        local = pool_ordinal
        if not 0 <= local < len(local_buses):
            raise DeviceMismatch(f"the pool is on cuda:{pool_ordinal}, which this process cannot see{vis_note}")
    else:
        matches = [i for i, b in enumerate(local_buses) if b.upper() == pool_bus.upper()]
        if not matches:
            raise DeviceMismatch(
                f"the pool is on GPU {pool_bus} (daemon's cuda:{pool_ordinal}), which this process "
                f"cannot see{vis_note}; run the client on that GPU"
            )
        local = matches[0]
    if requested is not None and requested != local:
        mine = local_buses[requested] if 0 <= requested < len(local_buses) else "?"
        raise DeviceMismatch(
            f"this client runs on cuda:{requested} (GPU {mine}) but the pool is on GPU "
            f"{pool_bus or '?'}, which is cuda:{local} here; attach to the daemon's pool of your "
            "GPU (--devices) or move the model to the pool's GPU"
        )
    return local


def _device_index(device) -> int | None:
    """None / int / "cuda:1" / torch.device -> ordinal or None."""
    if device is None:
        return None
    if isinstance(device, int):
        return device
    s = str(device)  # "cuda", "cuda:1", torch.device("cuda", 1)
    if s == "cuda":
        return None
    if s.startswith("cuda:") and s[5:].isdigit():
        return int(s[5:])
    raise ValueError(f"not a CUDA device: {device!r}")


class _DeviceBytes:
    """Owns one device pointer; frees (daemon) or closes (client) it when the last view dies.

    Views made by ``_torch_view``/``_cupy_view`` hold a reference to this object through
    CuPy's ``UnownedMemory(owner=...)`` and the DLPack capsule torch keeps,
    so closing an arena while a tensor still views it cannot unmap under it.
    """

    def __init__(self, ptr: int, nbytes: int, device: int, release):
        self.ptr, self.nbytes, self.device = ptr, nbytes, device
        self._finalizer = weakref.finalize(self, _release_ptr, ptr, device, release)


def _release_ptr(ptr: int, device: int, release) -> None:
    try:
        cupy = _cupy()
        with cupy.cuda.Device(device):
            release(ptr)
    except Exception:
        pass  # interpreter or driver shutting down: the process exit frees it


def _cupy_flat(owner: _DeviceBytes, count: int, offset: int):
    cupy = _cupy()
    mem = cupy.cuda.UnownedMemory(owner.ptr, owner.nbytes, owner, owner.device)
    return cupy.ndarray((count,), dtype=cupy.uint8, memptr=cupy.cuda.MemoryPointer(mem, offset))


def _torch_view(owner: _DeviceBytes, dtype: str, shape, offset: int):
    import torch

    shape, count = check_range(dtype, shape, offset, owner.nbytes)
    with _cupy().cuda.Device(owner.device):
        flat = torch.from_dlpack(_cupy_flat(owner, count, offset))
    return typed_view(flat, dtype, shape)


def _cupy_view(owner: _DeviceBytes, dtype: str, shape, offset: int):
    import numpy as np

    shape, count = check_range(dtype, shape, offset, owner.nbytes)
    if dtype not in ("float16", "float32", "uint8"):
        raise ValueError(f"CuPy has no {dtype}: view it as uint8/uint16 or use as_tensor")
    np_dtype = np.dtype(dtype)
    with _cupy().cuda.Device(owner.device):
        return _cupy_flat(owner, count, offset).view(np_dtype).reshape(shape)


class CudaFence:
    """An interprocess CUDA event used as a one-way ordering point (module docstring)."""

    def __init__(self, event: int, handle: bytes, device: int, owner: bool):
        self.event, self.handle, self.device, self.owner = event, handle, device, owner
        self._finalizer = weakref.finalize(self, _release_ptr, event, device, _rt().eventDestroy)

    @classmethod
    def create(cls, device: int) -> "CudaFence":
        rt = _rt()
        with _cupy().cuda.Device(device):
            ev = rt.eventCreateWithFlags(_EVENT_FLAGS)
            return cls(ev, bytes(rt.ipcGetEventHandle(ev)), device, owner=True)

    @classmethod
    def open(cls, handle: bytes, device: int) -> "CudaFence":
        """Open another process's fence (not one made in this process)."""
        with _cupy().cuda.Device(device):
            ev = _rt().ipcOpenEventHandle(bytes(handle))
        return cls(ev, bytes(handle), device, owner=False)

    def record(self, stream=None) -> None:
        """Mark 'everything enqueued on ``stream`` so far'."""
        with _cupy().cuda.Device(self.device):
            _rt().eventRecord(self.event, _stream_ptr(stream, self.device))

    def wait(self, stream=None) -> None:
        """Make ``stream`` wait (on the GPU) for the last ``record`` issued before this call."""
        with _cupy().cuda.Device(self.device):
            _rt().streamWaitEvent(_stream_ptr(stream, self.device), self.event, 0)

    def synchronize(self) -> None:
        """Block this host thread until the last recorded work is done."""
        with _cupy().cuda.Device(self.device):
            _rt().eventSynchronize(self.event)

    def close(self) -> None:
        self._finalizer()


class CudaArena(Arena):
    """Daemon side: one cudaMalloc of ``nbytes`` on ``device``, exported by IPC."""

    def __init__(self, tag: str, nbytes: int, device: int, bus: str, fence: bytes = b""):
        if nbytes <= 0:
            raise ValueError(f"arena size must be positive, got {nbytes}")
        cupy, rt = _cupy(), _rt()
        free, total = device_memory(device)
        if nbytes > free:
            raise _does_not_fit(nbytes, free, total, device, bus)
        with cupy.cuda.Device(device):
            try:
                ptr = rt.malloc(nbytes)
            except cupy.cuda.runtime.CUDARuntimeError as e:
                if "memory" not in str(e).lower():
                    raise
                free, total = rt.memGetInfo()
                raise _does_not_fit(nbytes, free, total, device, bus) from None
            self._mem = _DeviceBytes(ptr, nbytes, device, rt.free)
            handle = bytes(rt.ipcGetMemHandle(ptr))
        self.tag, self.nbytes, self.device, self.ptr = tag, nbytes, device, ptr
        self._descriptor = ArenaDescriptor(
            kind="cuda", nbytes=nbytes, handle=handle, device=device, device_id=bus, fence=fence
        )

    @property
    def descriptor(self) -> ArenaDescriptor:
        return self._descriptor

    def _owner(self) -> _DeviceBytes:
        if self._mem is None:
            raise RuntimeError(f"arena {self.tag} is closed")
        return self._mem

    def as_tensor(self, dtype: str, shape, offset: int = 0):
        return _torch_view(self._owner(), dtype, shape, offset)

    def as_cupy(self, dtype: str, shape, offset: int = 0):
        return _cupy_view(self._owner(), dtype, shape, offset)

    def release(self, offset: int, nbytes: int) -> None:
        """No-op: a legacy IPC allocation is committed whole until ``close`` (VMM is the later step)."""
        if offset < 0 or nbytes < 0 or offset + nbytes > self.nbytes:
            raise ValueError(f"range [{offset}, {offset + nbytes}) outside the arena's {self.nbytes} bytes")

    def close(self) -> None:
        """Drop the allocation; cudaFree runs now unless this process still holds views.

        Clients that still have the handle open keep reading valid memory
        until they close it (the driver frees the memory after the last user).
        """
        self._mem = None


def _does_not_fit(nbytes, free, total, device, bus) -> PoolDoesNotFit:
    g = 1 << 30
    return PoolDoesNotFit(
        f"the pool does not fit on cuda:{device} ({bus}): {nbytes} bytes ({nbytes / g:.2f} GiB) wanted, "
        f"{free} bytes ({free / g:.2f} GiB) free of {total / g:.2f} GiB; lower --pool-bytes or "
        "--gpu-memory-fraction"
    )


class CudaBackend(Backend):
    """Arenas on one GPU; also owns the daemon's fence for that GPU."""

    name = "cuda"
    #: legacy IPC maps one allocation per class, so classes cannot share memory (VMM would)
    supports_many_classes = False

    def __init__(self, device: int = 0):
        reason = probe_cuda(device)
        if reason is not None:
            raise BackendUnavailable(f"the CUDA backend cannot run: {reason}. Run kvpoold with --backend cpu")
        self.device = device
        self.bus_id = bus_id(device)
        self.fence = CudaFence.create(device)
        self._arenas: list[CudaArena] = []

    def create_arena(self, tag: str, nbytes: int) -> CudaArena:
        arena = CudaArena(tag, nbytes, self.device, self.bus_id, self.fence.handle)
        self._arenas.append(arena)
        return arena

    def open_fence(self, handle: bytes) -> CudaFence:
        """A client's fence, to ``wait`` on before daemon-side copies."""
        return CudaFence.open(handle, self.device)

    def close(self) -> None:
        while self._arenas:
            try:
                arena = self._arenas.pop()
            except IndexError:
                break
            arena.close()
        self.fence.close()


class CudaMappedArena(MappedArena):
    """Client side: the daemon's arena opened by IPC on the pool's GPU.

    ``device``: where this client runs (int, "cuda:N", torch.device or None);
    ``DeviceMismatch`` if that is not the pool's GPU.
    """

    def __init__(self, descriptor: ArenaDescriptor, device=None):
        if descriptor.kind != "cuda":
            raise ValueError(f"not a CUDA arena descriptor (kind={descriptor.kind!r})")
        reason = probe_cuda(check_ipc=False)  # the open below is the IPC check
        if reason is not None:
            raise BackendUnavailable(f"cannot map a CUDA pool in this process: {reason}")
        cupy, rt = _cupy(), _rt()
        local_buses = [bus_id(i) for i in range(rt.getDeviceCount())]
        dev = resolve_device(descriptor.device_id, descriptor.device, _device_index(device), local_buses)
        with cupy.cuda.Device(dev):
            try:
                ptr = rt.ipcOpenMemHandle(bytes(descriptor.handle), _IPC_LAZY_PEER)
            except cupy.cuda.runtime.CUDARuntimeError as e:
                raise RuntimeError(
                    f"cudaIpcOpenMemHandle failed on cuda:{dev} ({e}): the daemon may have exited, or this "
                    "is the daemon's own process (a process cannot open its own IPC handle)"
                ) from None
        self.device, self.nbytes = dev, descriptor.nbytes
        self._mem = _DeviceBytes(ptr, descriptor.nbytes, dev, rt.ipcCloseMemHandle)
        self._fence_handle = bytes(descriptor.fence)
        self._fence: CudaFence | None = None

    def _owner(self) -> _DeviceBytes:
        if self._mem is None:
            raise RuntimeError("this CUDA mapping is closed")
        return self._mem

    def as_tensor(self, dtype: str, shape, offset: int = 0):
        return _torch_view(self._owner(), dtype, shape, offset)

    def as_cupy(self, dtype: str, shape, offset: int = 0):
        """A CuPy view (NumPy dtypes only: not bfloat16 / float8)."""
        return _cupy_view(self._owner(), dtype, shape, offset)

    @property
    def daemon_fence(self) -> CudaFence:
        """The daemon's fence, opened on first use (rule 3 of the module docstring)."""
        if self._fence is None:
            if not self._fence_handle:
                raise RuntimeError("the descriptor carries no daemon fence")
            self._fence = CudaFence.open(self._fence_handle, self.device)
        return self._fence

    def close(self) -> None:
        """Close the IPC handle now, or when the last view of it dies."""
        self._mem = None
        fence, self._fence = self._fence, None
        if fence is not None:
            fence.close()
