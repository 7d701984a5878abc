"""Client side of the CUDA backend: open a daemon's arena by legacy CUDA IPC.

The daemon allocates each arena with ``cudaMalloc`` on its device and exports
``cudaIpcGetMemHandle`` (``kvpoold.memory.cuda_ipc``).  A client opens the
handle with ``cudaIpcOpenMemHandle`` on the *same physical GPU* (found by PCI
bus id, so CUDA_VISIBLE_DEVICES may differ between the processes) and gets
zero-copy torch / CuPy views.  The helpers the daemon shares (``probe_cuda``,
``bus_id``, ``DeviceBytes``, the views) live here too.  CuPy is imported
lazily: the CPU path never needs it.

Ordering between the processes needs no CUDA event: the client synchronizes its
device before every call that lets the daemon read its blocks, and the daemon
replies only once its own copies are complete (``kvpool.mapping.PoolMapping.sync_device``).
"""

from __future__ import annotations

import os
import weakref

from ..protocol.arena import ArenaDescriptor
from .base import BackendUnavailable, DeviceMismatch, MappedArena
from .views import check_range, typed_view

MiB = 1 << 20
_CUDA_IPC_MEM_LAZY_ENABLE_PEER_ACCESS = 1


def cupy_module():
    try:
        import cupy
    except ImportError as e:
        raise BackendUnavailable(
            f"CuPy is not installed ({e}): pip install 'kvpool[cuda13]' (CUDA 13) or "
            "'kvpool[cuda]' (CUDA 12), or run with --backend cpu"
        ) from None
    return cupy


def cuda_runtime():
    return cupy_module().cuda.runtime


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
    return cuda_runtime().deviceGetPCIBusId(device).upper()


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
    index = device_index(device)  # None for None and "cuda"
    if index is None:
        torch = sys.modules.get("torch")
        try:
            if torch is None or not torch.cuda.is_initialized():
                return ""
            return bus_id(torch.cuda.current_device())
        except Exception:  # noqa: BLE001 - no usable CUDA or CuPy here: the process names no GPU
            return ""
    try:
        count = cuda_runtime().getDeviceCount()
    except BackendUnavailable:
        return ""
    except Exception as e:  # noqa: BLE001 - CUDARuntimeError: no driver, no GPU
        raise DeviceMismatch(f"device={device!r}: no usable CUDA GPU in this process ({e})") from None
    if not 0 <= index < count:
        vis = os.environ.get("CUDA_VISIBLE_DEVICES")
        raise DeviceMismatch(f"device={device!r}: this process sees {count} GPU(s)"
                             + (f" (CUDA_VISIBLE_DEVICES={vis!r})" if vis is not None else ""))
    return bus_id(index)


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


def device_index(device) -> int | None:
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


class DeviceBytes:
    """Owns one device pointer; frees (daemon) or closes (client) it when the last view dies.

    Views made by ``torch_view``/``cupy_view`` hold a reference to this object through
    CuPy's ``UnownedMemory(owner=...)`` and the DLPack capsule torch keeps,
    so closing an arena while a tensor still views it cannot unmap under it.
    """

    def __init__(self, ptr: int, nbytes: int, device: int, release):
        self.ptr, self.nbytes, self.device = ptr, nbytes, device
        self._finalizer = weakref.finalize(self, _release_ptr, ptr, device, release)


def _release_ptr(ptr: int, device: int, release) -> None:
    try:
        cupy = cupy_module()
        with cupy.cuda.Device(device):
            release(ptr)
    except Exception:
        pass  # interpreter or driver shutting down: the process exit frees it


def _cupy_flat(owner: DeviceBytes, count: int, offset: int):
    cupy = cupy_module()
    mem = cupy.cuda.UnownedMemory(owner.ptr, owner.nbytes, owner, owner.device)
    return cupy.ndarray((count,), dtype=cupy.uint8, memptr=cupy.cuda.MemoryPointer(mem, offset))


def torch_view(owner: DeviceBytes, dtype: str, shape, offset: int):
    import torch

    shape, count = check_range(dtype, shape, offset, owner.nbytes)
    with cupy_module().cuda.Device(owner.device):
        flat = torch.from_dlpack(_cupy_flat(owner, count, offset))
    return typed_view(flat, dtype, shape)


def cupy_view(owner: DeviceBytes, dtype: str, shape, offset: int):
    import numpy as np

    shape, count = check_range(dtype, shape, offset, owner.nbytes)
    if dtype not in ("float16", "float32", "uint8"):
        raise ValueError(f"CuPy has no {dtype}: view it as uint8/uint16 or use as_tensor")
    np_dtype = np.dtype(dtype)
    with cupy_module().cuda.Device(owner.device):
        return _cupy_flat(owner, count, offset).view(np_dtype).reshape(shape)


class DeviceViews:
    """Zero-copy torch / CuPy views of the device bytes ``self._mem`` owns (None once closed).

    Shared by every CUDA arena, daemon and client side, IPC and VMM alike.
    """

    _mem: DeviceBytes | None
    closed_message = "this CUDA mapping is closed"

    def _owner(self) -> DeviceBytes:
        if self._mem is None:
            raise RuntimeError(self.closed_message)
        return self._mem

    def as_tensor(self, dtype: str, shape, offset: int = 0):
        return torch_view(self._owner(), dtype, shape, offset)

    def as_cupy(self, dtype: str, shape, offset: int = 0):
        """A CuPy view (NumPy dtypes only: not bfloat16 / float8)."""
        return cupy_view(self._owner(), dtype, shape, offset)


class CudaMappedArena(DeviceViews, MappedArena):
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
        cupy, rt = cupy_module(), cuda_runtime()
        local_buses = [bus_id(i) for i in range(rt.getDeviceCount())]
        dev = resolve_device(descriptor.device_id, descriptor.device, device_index(device), local_buses)
        with cupy.cuda.Device(dev):
            try:
                ptr = rt.ipcOpenMemHandle(bytes(descriptor.handle), _CUDA_IPC_MEM_LAZY_ENABLE_PEER_ACCESS)
            except cupy.cuda.runtime.CUDARuntimeError as e:
                raise RuntimeError(
                    f"cudaIpcOpenMemHandle failed on cuda:{dev} ({e}): the daemon may have exited, or this "
                    "is the daemon's own process (a process cannot open its own IPC handle)"
                ) from None
        self.device, self.nbytes = dev, descriptor.nbytes
        self._mem = DeviceBytes(ptr, descriptor.nbytes, dev, rt.ipcCloseMemHandle)

    def close(self) -> None:
        """Close the IPC handle now, or when the last view of it dies."""
        self._mem = None
