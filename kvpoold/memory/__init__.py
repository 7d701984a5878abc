"""Memory backends, daemon side: arenas that hold the bytes of one layout class's blocks.

The core decides which block ids are used; an arena only knows byte ranges.
``make_backend`` is the daemon's entry point.  Clients map arenas with
``kvpool.ipc.open_arena`` (the descriptor is ``kvpool.protocol.ArenaDescriptor``).
Nothing here imports CuPy until the CUDA backend is asked for.
"""

from __future__ import annotations

from .base import Arena, Backend, PoolDoesNotFit

__all__ = ["Arena", "Backend", "PoolDoesNotFit", "make_backend"]


def make_backend(name: str, *, instance: str = "", device: int = 0, **kwargs) -> Backend:
    """``"cpu"``: ``CpuShmBackend(instance, **kwargs)``; ``"cuda"``: ``CudaBackend(device)``."""
    if name == "cpu":
        from .cpu_shm import CpuShmBackend

        return CpuShmBackend(instance, **kwargs)
    if name == "cuda":
        from .cuda_ipc import CudaBackend

        return CudaBackend(device)
    raise ValueError(f"unknown backend {name!r}: expected 'cpu' or 'cuda'")
