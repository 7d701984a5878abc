"""The arena descriptor: what a client needs to map one arena of the daemon's.

Descriptors travel to clients as plain dicts of str -> (str | int | bytes)
(``ArenaDescriptor.to_dict``/``from_dict``) so that they can be carried in a
protobuf message without the memory code knowing about gRPC.  The daemon makes
them (``kvpoold.memory``), clients open them (``kvpool.ipc.open_arena``).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields

from .layout import KV_DTYPE_ITEMSIZE

#: dtype names a view of an arena may use -> bytes per element: a KV cache's (the names are torch's,
#: ``torch.<name>``) and raw bytes
DTYPE_ITEMSIZE: dict[str, int] = {**KV_DTYPE_ITEMSIZE, "uint8": 1}


@dataclass(frozen=True)
class ArenaDescriptor:
    """What a client needs to map an arena into its own address space."""

    # "memfd" (CPU: anonymous shared memory; the fd itself comes over the daemon's side socket,
    # to the attached process only), "cuda_vmm" (CUDA virtual memory: chunks come over the side
    # socket as file descriptors, see kvpool.ipc.vmm) or "cuda" (legacy CUDA IPC of one allocation)
    kind: str
    nbytes: int  # size of the whole virtual range
    handle: bytes  # memfd: a label for messages, nothing to open; cuda: the 64-byte IPC memory handle
    device: int = -1  # daemon's CUDA ordinal (for messages), -1 on the CPU
    # PCI bus id of the pool's GPU ("0000:3B:00.0"): ordinals differ between
    # processes with different CUDA_VISIBLE_DEVICES, the bus id does not.
    device_id: str = ""
    chunk_bytes: int = 0  # cuda_vmm: the size of the chunks mapped into the range

    def to_dict(self) -> dict[str, str | int | bytes]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "ArenaDescriptor":
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})
