"""CUDA backend, daemon side: one plain device allocation per arena, shared by legacy CUDA IPC.

The daemon allocates each arena with ``cudaMalloc`` (through CuPy's runtime
bindings; no memory pool, no managed memory) on its device and exports
``cudaIpcGetMemHandle``; clients open it with ``kvpool.ipc.cuda.CudaMappedArena``.
CuPy is imported lazily: the CPU path never needs it.

``release`` is a no-op here: a legacy IPC allocation cannot give part of
itself back.  This backend is the fallback where CUDA virtual memory with
POSIX file-descriptor handles is unavailable (``cuda_vmm.py`` is the default).

Ordering between the processes: the daemon's copies of pool blocks (demotions,
swaps, promotions) complete before the reply that lets a client use those
blocks, and the client synchronizes its device before any call that lets the
daemon read blocks it wrote; the rule is written where the client enforces it,
``kvpool.mapping.PoolMapping.sync_device``.  Copy-on-write copies run in the
client's own stream.
"""

from __future__ import annotations

from kvpool.ipc.base import BackendUnavailable
from kvpool.ipc.cuda import MiB, DeviceBytes, DeviceViews, bus_id, cuda_runtime, cupy_module, probe_cuda
from kvpool.protocol import ArenaDescriptor

from .base import Arena, Backend, PoolDoesNotFit


def device_memory(device: int) -> tuple[int, int]:
    """(free, total) bytes on ``device``."""
    with cupy_module().cuda.Device(device):
        return cuda_runtime().memGetInfo()


def pool_bytes_for_fraction(device: int = 0, fraction: float = 0.9, align: int = 2 * MiB) -> int:
    """Pool size from ``--gpu-memory-fraction``: that share of what is free now.

    Unlike vLLM's gpu_memory_utilization (a share of the total), this is a
    share of the *free* memory at start, so other tenants are left alone.
    """
    if not 0 < fraction <= 1:
        raise ValueError(f"gpu_memory_fraction must be in (0, 1], got {fraction}")
    free, _ = device_memory(device)
    return int(free * fraction) // align * align


class CudaArena(DeviceViews, Arena):
    """Daemon side: one cudaMalloc of ``nbytes`` on ``device``, exported by IPC."""

    def __init__(self, tag: str, nbytes: int, device: int, bus: str):
        if nbytes <= 0:
            raise ValueError(f"arena size must be positive, got {nbytes}")
        cupy, rt = cupy_module(), cuda_runtime()
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
            self._mem = DeviceBytes(ptr, nbytes, device, rt.free)
            handle = bytes(rt.ipcGetMemHandle(ptr))
        self.tag, self.nbytes, self.device, self.ptr = tag, nbytes, device, ptr
        self.closed_message = f"arena {tag} is closed"
        self._descriptor = ArenaDescriptor(
            kind="cuda", nbytes=nbytes, handle=handle, device=device, device_id=bus
        )

    @property
    def descriptor(self) -> ArenaDescriptor:
        return self._descriptor

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
    """Arenas on one GPU."""

    name = "cuda"
    #: legacy IPC maps one allocation per class, so classes cannot share memory (VMM would)
    supports_many_classes = False
    memory = "ipc"

    def __init__(self, device: int = 0):
        reason = probe_cuda(device)
        if reason is not None:
            raise BackendUnavailable(f"the CUDA backend cannot run: {reason}. Run kvpoold with --backend cpu")
        self.device = device
        self.bus_id = bus_id(device)
        self._arenas: list[CudaArena] = []

    def create_arena(self, tag: str, nbytes: int, class_id: int = 0, tenant: str = "") -> CudaArena:
        arena = CudaArena(tag, nbytes, self.device, self.bus_id)
        self._arenas.append(arena)
        return arena

    def close(self) -> None:
        while self._arenas:
            try:
                arena = self._arenas.pop()
            except IndexError:
                break
            arena.close()
