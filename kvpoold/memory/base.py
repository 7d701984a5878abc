"""The interface every daemon-side memory backend implements.

One arena per layout class. An arena is a single virtual byte range whose
block ``i`` lives at ``offset = i * block_bytes``; kernels therefore see one
base pointer and one stride for all of a class's blocks.  Physical memory is
committed slab by slab: the core hands slabs to a class and takes them back;
the daemon calls ``arena.commit`` on a slab before its blocks are handed out
and ``arena.release`` when the slab comes back.

What clients see of an arena is its ``kvpool.protocol.ArenaDescriptor``; they
map it with ``kvpool.ipc.open_arena``.  The errors both sides raise
(``BackendUnavailable``, ``DeviceMismatch``) and the tensor-view interface come
from ``kvpool.ipc``.

This module imports neither torch nor CuPy: the core and the server can use
the names and errors below without pulling a GPU stack in.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

from kvpool.ipc.base import TensorView
from kvpool.protocol import ArenaDescriptor


class PoolDoesNotFit(MemoryError):
    """The memory asked for is not free (message: bytes wanted vs free)."""


class Arena(TensorView):
    """Daemon-side owner of one class's block bytes."""

    #: clients map the whole arena writable, so pages may be there that no slab of the class owns
    #: (``DevicePool`` releases them when a session of the class ends)
    client_writable = False

    @property
    @abstractmethod
    def descriptor(self) -> ArenaDescriptor: ...

    def commit(self, offset: int, nbytes: int) -> None:
        """Back ``[offset, offset+nbytes)`` with physical memory now.

        Called before a slab's blocks are handed out, so that a full machine
        fails here, in the daemon, with ``PoolDoesNotFit`` rather than later
        with SIGBUS in a client that touches the page.  No-op where the whole
        arena is committed at creation (legacy CUDA IPC).
        """

    @abstractmethod
    def release(self, offset: int, nbytes: int) -> None:
        """Give the physical memory behind ``[offset, offset+nbytes)`` back.

        Called when the core returns an empty slab; the range reads as zeros
        or garbage afterwards (callers never read a released range).
        """

    @abstractmethod
    def close(self) -> None:
        """Free everything; idempotent, callable from a signal handler."""


class Backend(ABC):
    """Creates arenas for the daemon."""

    name: str
    #: whether several layout classes may each map the whole pool's size (sparse memory)
    supports_many_classes: bool = True
    #: whether a slab must be whole chunks at a chunk-aligned offset (CUDA VMM maps whole chunks)
    exact_slabs: bool = False
    #: how the memory is made, for operators ("shm", "vmm", "ipc")
    memory: str = ""
    #: the open arenas, which ``close`` closes (each backend fills it in ``create_arena``)
    _arenas: list

    @abstractmethod
    def create_arena(self, tag: str, nbytes: int, class_id: int = 0, tenant: str = "") -> Arena:
        """A fresh arena of ``nbytes`` virtual bytes for class ``class_id`` of ``tenant``; ``tag`` names it."""

    def settle(self) -> None:
        """After a round of commits and releases: give back what no class uses (VMM); a no-op elsewhere."""

    def close_arena(self, arena: Arena) -> None:
        """Close one arena of this backend now (its layout class was dropped), and forget it.

        Args:
            arena: an arena ``create_arena`` made.
        """
        arenas = self._arenas
        arena.close()
        if arena in arenas:
            arenas.remove(arena)

    @abstractmethod
    def close(self) -> None:
        """Close every arena this backend created; idempotent."""
