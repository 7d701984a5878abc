"""Mapping the daemon's arenas into a client process: anonymous shared memory (memfd), CUDA VMM, CUDA IPC.

``open_arena(descriptor)`` maps an arena (``kvpool.protocol.ArenaDescriptor``)
and gives zero-copy torch views of it.  The daemon side that creates arenas is
``kvpoold.memory``; it builds on the pieces here, never the other way round.
Nothing here imports CuPy until a CUDA arena is opened.
"""

from __future__ import annotations

from ..protocol.arena import ArenaDescriptor
from .base import BackendUnavailable, DeviceMismatch, MappedArena, TensorView
from .cuda import client_bus_id  # imports no CuPy: that happens on first use

__all__ = ["BackendUnavailable", "DeviceMismatch", "MappedArena", "TensorView", "client_bus_id", "open_arena"]


def open_arena(descriptor: ArenaDescriptor | dict, device=None, fd: int | None = None) -> MappedArena:
    """Map a daemon's arena into this process, by ``descriptor.kind`` (``memfd``: from ``fd``, which it closes)."""
    if isinstance(descriptor, dict):
        descriptor = ArenaDescriptor.from_dict(descriptor)
    if descriptor.kind == "memfd":
        from .cpu_shm import CpuMappedArena

        return CpuMappedArena(descriptor, fd)
    if descriptor.kind == "cuda":
        from .cuda import CudaMappedArena

        return CudaMappedArena(descriptor, device=device)
    if descriptor.kind == "cuda_vmm":
        from .vmm import VmmMappedArena

        return VmmMappedArena(descriptor, device=device)
    raise ValueError(f"unknown arena kind {descriptor.kind!r}")

