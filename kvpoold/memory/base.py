"""The interface every memory backend implements, daemon side and client side.

One arena per layout class. An arena is a single virtual byte range whose
block ``i`` lives at ``offset = i * block_bytes``; kernels therefore see one
base pointer and one stride for all of a class's blocks.  Physical memory is
committed slab by slab: the core hands slabs to a class and takes them back;
the daemon calls ``arena.commit`` on a slab before its blocks are handed out
and ``arena.release`` when the slab comes back.

Descriptors travel to clients as plain dicts of str -> (str | int | bytes)
(``ArenaDescriptor.to_dict``/``from_dict``) so that they can be carried in a
protobuf ``map``/message without the backend knowing about gRPC.

This module imports neither torch nor CuPy: the core and the server can use
the names and errors below without pulling a GPU stack in.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import asdict, dataclass, fields

#: dtype names a layout may use -> bytes per element.  The names are torch's
#: (``torch.<name>``); the core needs only the sizes to compute block bytes.
DTYPE_ITEMSIZE: dict[str, int] = {
    "float16": 2,
    "bfloat16": 2,
    "float32": 4,
    "float8_e4m3fn": 1,
    "uint8": 1,
}


class BackendUnavailable(RuntimeError):
    """The backend cannot run on this machine (no GPU, no CuPy, no /dev/shm...).

    The message says why and what to run instead.
    """


class DeviceMismatch(RuntimeError):
    """A client asked to map a pool on a GPU other than the pool's."""


class PoolDoesNotFit(MemoryError):
    """The memory asked for is not free (message: bytes wanted vs free)."""


@dataclass(frozen=True)
class ArenaDescriptor:
    """What a client needs to map an arena into its own address space."""

    kind: str  # "cpu" (POSIX shared memory) or "cuda" (CUDA IPC)
    nbytes: int  # size of the whole virtual range
    handle: bytes  # cpu: absolute path of the shm file (utf-8); cuda: the 64-byte IPC memory handle
    device: int = -1  # daemon's CUDA ordinal (for messages), -1 on the CPU
    # PCI bus id of the pool's GPU ("0000:3B:00.0"): ordinals differ between
    # processes with different CUDA_VISIBLE_DEVICES, the bus id does not.
    device_id: str = ""
    # cuda: IPC event handle of the daemon's per-device fence (see cuda_ipc's
    # ordering rule); empty on the CPU.
    fence: bytes = b""

    def to_dict(self) -> dict[str, str | int | bytes]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "ArenaDescriptor":
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})


class _TensorView(ABC):
    @abstractmethod
    def as_tensor(self, dtype: str, shape: tuple[int, ...], offset: int = 0):
        """A torch tensor over bytes ``[offset, offset + prod(shape)*itemsize)``.

        No copy: writes through the tensor land in the arena.  The mapping
        stays valid while any such tensor is alive, even after ``close()``.
        ``dtype`` is one of ``DTYPE_ITEMSIZE``'s names.
        """


class Arena(_TensorView):
    """Daemon-side owner of one class's block bytes."""

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


class MappedArena(_TensorView):
    """Client-side view of an arena (zero-copy)."""

    @abstractmethod
    def close(self) -> None:
        """Drop this process's mapping; idempotent.

        Tensors made by ``as_tensor`` keep the mapping alive until they die.
        """


class Backend(ABC):
    """Creates arenas for the daemon."""

    name: str
    #: whether several layout classes may each map the whole pool's size (sparse memory)
    supports_many_classes: bool = True

    @abstractmethod
    def create_arena(self, tag: str, nbytes: int) -> Arena:
        """A fresh arena of ``nbytes`` virtual bytes; ``tag`` names it for operators."""

    @abstractmethod
    def close(self) -> None:
        """Close every arena this backend created; idempotent."""
