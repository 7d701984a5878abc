"""CUDA backend on virtual memory management: one GPU's memory as chunks that move between classes.

Each layout class gets a virtual range as large as its block-id space (the
pool's ceiling), in the daemon and in each client.  Physical memory exists
only for the slabs the core has given a class: ``commit`` creates (or reuses)
one chunk per ``chunk_bytes`` and maps it at its offset, ``release`` unmaps
it.  What is left over at the end of a round of slab changes goes back to the
GPU at once (``settle``), so the pool takes memory as classes need it and
gives it back when the core takes slabs away (another class's need, an idle
slab, a resize).  ``ChunkLedger`` holds the bookkeeping and the safety rule
(mapped before handed out, freed only when no process maps it, never reused
across tenants).

Clients get a chunk as a POSIX file descriptor over the side socket, exported
when they ask (``export``) and closed once sent: the daemon holds no
descriptor per chunk.
"""

from __future__ import annotations

import logging
import os

from kvpool.ipc.base import BackendUnavailable
from kvpool.ipc.cuda import DeviceBytes, DeviceViews, bus_id, probe_cuda
from kvpool.ipc.vmm import DriverError, VirtualRange, allocation_prop, check, granularity, posix_fd_type, use_device
from kvpool.protocol import ArenaDescriptor
from kvpool.protocol.sizes import cdiv

from .base import Arena, Backend, PoolDoesNotFit
from .chunk_ledger import ChunkLedger

log = logging.getLogger("kvpoold")


def probe_vmm(device: int) -> str | None:
    """None if VMM with POSIX file-descriptor handles works on ``device``, else why not."""
    try:
        cu = use_device(device)
        dev = check(cu.cuDeviceGet(device), "cuDeviceGet")
        attr = cu.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED
        if not check(cu.cuDeviceGetAttribute(attr, dev), "cuDeviceGetAttribute"):
            return "the GPU does not export memory as POSIX file descriptors"
        size = granularity(device)
        handle = check(cu.cuMemCreate(size, allocation_prop(device), 0), "cuMemCreate")
        try:
            fd = check(cu.cuMemExportToShareableHandle(handle, posix_fd_type(), 0), "cuMemExportToShareableHandle")
            os.close(int(fd))
        finally:
            cu.cuMemRelease(handle)
    except BackendUnavailable as e:
        return str(e)
    except Exception as e:  # noqa: BLE001 - DriverError, or a driver too old for the calls
        return f"{type(e).__name__}: {e}"
    return None


class VmmArena(DeviceViews, Arena):
    """Daemon side: one class's virtual range; chunks come and go with the core's slabs."""

    def __init__(self, backend: "VmmBackend", class_id: int, tag: str, nbytes: int, tenant: str):
        c = backend.chunk_bytes
        self.backend, self.class_id, self.tag, self.tenant = backend, class_id, tag, tenant
        self.closed_message = f"arena {tag} is closed"
        self.nbytes = cdiv(nbytes, c) * c
        self.device = backend.device
        self._range = VirtualRange(backend.device, self.nbytes, c)
        backend.ledger.add_class(class_id, tenant)
        self._mem = DeviceBytes(self._range.base, self.nbytes, self.device, lambda _ptr: None)
        self.released_bytes = 0  # given back by the core since the class began
        self._descriptor = ArenaDescriptor(kind="cuda_vmm", nbytes=self.nbytes, handle=tag.encode(),
                                           device=self.device, device_id=backend.bus_id, chunk_bytes=c)

    @property
    def descriptor(self) -> ArenaDescriptor:
        return self._descriptor

    @property
    def mapped_bytes(self) -> int:
        return self.backend.ledger.placed_chunks(self.class_id) * self.backend.chunk_bytes

    def _indices(self, offset: int, nbytes: int) -> range:
        c = self.backend.chunk_bytes
        if offset % c or nbytes % c or offset < 0 or offset + nbytes > self.nbytes:
            raise ValueError(f"[{offset}, {offset + nbytes}) is not whole chunks of {c} inside {self.nbytes} bytes")
        return range(offset // c, (offset + nbytes) // c)

    def commit(self, offset: int, nbytes: int) -> None:
        done = []
        try:
            for index in self._indices(offset, nbytes):
                self.backend.map_chunk(self, self._range, index)
                done.append(index)
        except BaseException:
            for index in reversed(done):  # all or nothing: the core's slab was not taken
                self.backend.unmap_chunk(self, self._range, index)
            raise

    def release(self, offset: int, nbytes: int) -> None:
        for index in self._indices(offset, nbytes):
            self.backend.unmap_chunk(self, self._range, index)
        self.released_bytes += nbytes

    def close(self) -> None:
        """Unmap every chunk (they drain or go back to the GPU) and free the range."""
        if self._mem is None:
            return
        for index in sorted(self._range.handles):
            self.backend.unmap_chunk(self, self._range, index)
        self.backend.ledger.drop_class(self.class_id)
        self.backend.arenas.pop(self.class_id, None)
        self.backend.settle()
        self._mem = None
        self._range.free(release_handles=False)


class VmmBackend(Backend):
    """Chunks of one GPU, shared by every class's range; the ledger decides who may use which."""

    name = "cuda"
    supports_many_classes = True
    #: a slab must be whole chunks at a chunk-aligned offset (the core sizes slabs so)
    exact_slabs = True
    memory = "vmm"

    def __init__(self, device: int = 0, chunk_bytes: int | None = None):
        reason = probe_cuda(device, check_ipc=False) or probe_vmm(device)
        if reason is not None:
            raise BackendUnavailable(f"CUDA virtual memory cannot run on device {device}: {reason}")
        gran = granularity(device)
        chunk_bytes = chunk_bytes or gran
        if chunk_bytes % gran:
            raise ValueError(f"chunk_bytes {chunk_bytes} is not a multiple of cuda:{device}'s VMM granularity "
                             f"{gran}: set chunk_bytes to a multiple of it, or cuda_memory = \"ipc\"")
        self.device, self.bus_id, self.chunk_bytes = device, bus_id(device), chunk_bytes
        self.ledger = ChunkLedger()
        self.handles: dict[int, object] = {}  # chunk id -> the daemon's handle (the physical memory)
        self.arenas: dict[int, VmmArena] = {}
        self.created_bytes = 0  # cumulative
        self.freed_bytes = 0  # given back to the GPU, cumulative
        self.notify = lambda viewers: None  # the service tells those clients to sync ("remap")

    def create_arena(self, tag: str, nbytes: int, class_id: int = 0, tenant: str = "") -> VmmArena:
        arena = VmmArena(self, class_id, tag, nbytes, tenant)
        self.arenas[class_id] = arena
        return arena

    def close_arena(self, arena: VmmArena) -> None:
        """Close one class's range (its class was dropped): its chunks drain or go back to the GPU."""
        arena.close()

    # -- chunks ------------------------------------------------------------------------
    def map_chunk(self, arena: VmmArena, vrange: VirtualRange, index: int) -> None:
        placed = self.ledger.place(arena.class_id, index)
        try:
            if placed.source == "new":
                self._release(self.ledger.take_idle(keep_tenant=arena.tenant))  # other tenants' leftovers first
                self.handles[placed.chunk] = self._create()
                self.created_bytes += self.chunk_bytes
            vrange.map(index, self.handles[placed.chunk])
        except BaseException:
            chunk, _viewers = self.ledger.unplace(arena.class_id, index)
            if chunk not in self.handles:
                self.ledger.discard(chunk)  # never created: only the books knew it
            raise

    def unmap_chunk(self, arena: VmmArena, vrange: VirtualRange, index: int) -> None:
        vrange.unmap(index)
        _chunk, viewers = self.ledger.unplace(arena.class_id, index)
        if viewers:
            self.notify(viewers)

    def _create(self):
        cu = use_device(self.device)
        try:
            return check(cu.cuMemCreate(self.chunk_bytes, allocation_prop(self.device), 0), "cuMemCreate")
        except DriverError as e:
            if "memory" not in str(e).lower():
                raise
            from .cuda_ipc import device_memory

            free, total = device_memory(self.device)
            raise PoolDoesNotFit(
                f"cuda:{self.device} ({self.bus_id}) has no room for another {self.chunk_bytes}-byte chunk: "
                f"{free} of {total} bytes free; lower --pool-bytes or free the GPU"
            ) from None

    def _release(self, chunks) -> None:
        cu = use_device(self.device) if chunks else None
        for chunk in chunks:
            handle = self.handles.pop(chunk, None)
            if handle is not None:
                cu.cuMemRelease(handle)
                self.freed_bytes += self.chunk_bytes

    def settle(self) -> None:
        """End of a round of slab changes: chunks nobody uses go back to the GPU."""
        self._release(self.ledger.take_idle())

    def export(self, chunk: int) -> int:
        """A new POSIX file descriptor of ``chunk`` (the caller closes it)."""
        cu = use_device(self.device)
        return int(check(cu.cuMemExportToShareableHandle(self.handles[chunk], posix_fd_type(), 0),
                         "cuMemExportToShareableHandle"))

    def max_pool_bytes(self) -> int:
        """The most a pool on this GPU can grow to (``kvpoolctl resize``): its whole memory, in chunks."""
        from .cuda_ipc import device_memory

        _free, total = device_memory(self.device)
        return total // self.chunk_bytes * self.chunk_bytes

    # -- figures --------------------------------------------------------------------------
    @property
    def physical_bytes(self) -> int:
        return len(self.handles) * self.chunk_bytes

    @property
    def draining_bytes(self) -> int:
        return len(self.ledger.draining) * self.chunk_bytes

    def close(self) -> None:
        for arena in list(self.arenas.values()):
            try:
                arena.close()
            except Exception:  # noqa: BLE001 - the other arenas must still go
                log.exception("closing arena %s failed", arena.tag)
        self.arenas.clear()
        self._release(list(self.handles))  # draining ones too: clients that still map them keep them alive
