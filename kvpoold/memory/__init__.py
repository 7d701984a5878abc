"""Memory backends: arenas that hold the bytes of one layout class's blocks.

The core decides which block ids are used; an arena only knows byte ranges.
``make_backend`` is the daemon's entry point, ``open_arena`` the client's.
Nothing here imports CuPy until the CUDA backend is asked for.
"""

from __future__ import annotations

from .base import (
    DTYPE_ITEMSIZE,
    Arena,
    ArenaDescriptor,
    Backend,
    BackendUnavailable,
    DeviceMismatch,
    MappedArena,
    PoolDoesNotFit,
)

__all__ = [
    "DTYPE_ITEMSIZE", "Arena", "ArenaDescriptor", "Backend", "BackendUnavailable",
    "DeviceMismatch", "MappedArena", "PoolDoesNotFit", "make_backend", "open_arena",
]


def make_backend(name: str, *, instance: str = "", device: int = 0, **kwargs) -> Backend:
    """``"cpu"``: ``CpuShmBackend(instance, **kwargs)``; ``"cuda"``: ``CudaBackend(device)``."""
    if name == "cpu":
        from .cpu_shm import CpuShmBackend

        return CpuShmBackend(instance, **kwargs)
    if name == "cuda":
        from .cuda_ipc import CudaBackend

        return CudaBackend(device)
    raise ValueError(f"unknown backend {name!r}: expected 'cpu' or 'cuda'")


def open_arena(descriptor: ArenaDescriptor | dict, device=None) -> MappedArena:
    """Map a daemon's arena into this process (client side), by ``descriptor.kind``."""
    if isinstance(descriptor, dict):
        descriptor = ArenaDescriptor.from_dict(descriptor)
    if descriptor.kind == "cpu":
        from .cpu_shm import CpuMappedArena

        return CpuMappedArena(descriptor)
    if descriptor.kind == "cuda":
        from .cuda_ipc import CudaMappedArena

        return CudaMappedArena(descriptor, device=device)
    raise ValueError(f"unknown arena kind {descriptor.kind!r}")
