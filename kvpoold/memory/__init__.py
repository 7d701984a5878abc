"""Memory backends, daemon side: arenas that hold the bytes of one layout class's blocks.

The core decides which block ids are used; an arena only knows byte ranges.
``make_backend`` is the daemon's entry point.  Clients map arenas with
``kvpool.ipc.open_arena`` (the descriptor is ``kvpool.protocol.ArenaDescriptor``).
Nothing here imports CuPy until the CUDA backend is asked for.
"""

from __future__ import annotations

from .base import Arena, Backend, PoolDoesNotFit

__all__ = ["Arena", "Backend", "PoolDoesNotFit", "make_backend"]


def make_backend(name: str, *, instance: str = "", device: int = 0, memory: str = "auto",
                 chunk_bytes: int | None = None, **kwargs) -> Backend:
    """``"cpu"``: ``CpuShmBackend(instance, **kwargs)``; ``"cuda"``: by ``memory``.

    ``memory`` (cuda only): ``"vmm"`` (``VmmBackend``: chunks that move between
    classes), ``"ipc"`` (``CudaBackend``: one legacy IPC allocation per
    device, one class), ``"auto"``: VMM where the GPU and driver export
    memory as POSIX file descriptors, else IPC with a warning that says why.
    """
    if name == "cpu":
        from .cpu_shm import CpuShmBackend

        return CpuShmBackend(instance, **kwargs)
    if name == "cuda":
        if memory not in ("auto", "vmm", "ipc"):
            raise ValueError(f"unknown cuda memory {memory!r}: expected auto, vmm or ipc")
        if memory != "ipc":
            from kvpool.ipc.base import BackendUnavailable

            from .cuda_vmm import VmmBackend

            try:
                return VmmBackend(device, chunk_bytes)
            except BackendUnavailable as exc:
                if memory == "vmm":
                    raise
                import logging

                logging.getLogger("kvpoold").warning(
                    "cuda:%d: %s; falling back to legacy CUDA IPC (one layout class per GPU, memory taken "
                    "whole at start)", device, exc)
        from .cuda_ipc import CudaBackend

        return CudaBackend(device)
    raise ValueError(f"unknown backend {name!r}: expected 'cpu' or 'cuda'")
