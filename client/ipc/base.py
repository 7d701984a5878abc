"""The interface of a mapped arena and the errors of mapping one.

``TensorView`` is shared with the daemon's arenas (``kvpoold.memory.base``):
both sides hand out zero-copy torch views of an arena's bytes the same way.
This module imports neither torch nor CuPy.
"""

from __future__ import annotations

from abc import ABC, abstractmethod


class BackendUnavailable(RuntimeError):
    """The backend cannot run on this machine (no GPU, no CuPy, no /dev/shm...).

    The message says why and what to run instead.
    """


class DeviceMismatch(RuntimeError):
    """A client asked to map a pool on a GPU other than the pool's."""


class TensorView(ABC):
    @abstractmethod
    def as_tensor(self, dtype: str, shape: tuple[int, ...], offset: int = 0):
        """A torch tensor over bytes ``[offset, offset + prod(shape)*itemsize)``.

        No copy: writes through the tensor land in the arena.  The mapping
        stays valid while any such tensor is alive, even after ``close()``.
        ``dtype`` is one of ``DTYPE_ITEMSIZE``'s names.
        """


class MappedArena(TensorView):
    """Client-side view of an arena (zero-copy)."""

    @abstractmethod
    def close(self) -> None:
        """Drop this process's mapping; idempotent.

        Tensors made by ``as_tensor`` keep the mapping alive until they die.
        """
