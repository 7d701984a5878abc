"""The pool's memory in this process: the arena's mapping, its CUDA VMM chunks, and views of it."""

from __future__ import annotations

import time
from typing import Iterable

import numpy as np

from .errors import FailedPrecondition, Unavailable
from .handoff import arena_fd, sync_chunks
from .ipc import open_arena
from .layout import Layout


class PoolMapping:
    """Maps the arena the attach described, on first use, and keeps the mapped chunks in step with the daemon.

    Args:
        address: the daemon's socket (the side socket that hands fds over).
        token: the session's token.
        arena: the attach reply's arena descriptor.
        layout, num_blocks, block_bytes, backend: the pool's shape, from the attach.
        device: the GPU the client named (``kvpool.connect``), or None.
    """

    def __init__(self, address: str, token: bytes, arena, *, layout: Layout, num_blocks: int, block_bytes: int,
                 backend: str, device) -> None:
        self._address, self._token = address, token
        self.descriptor = {
            "kind": arena.kind, "nbytes": arena.nbytes, "handle": arena.handle,
            "device": arena.device, "device_id": arena.device_id, "chunk_bytes": arena.chunk_bytes,
        }
        self.layout, self.num_blocks, self.block_bytes, self.backend = layout, num_blocks, block_bytes, backend
        self._device = device
        self.arena = None
        self._kv = None
        self.chunk_sync_seconds = 0.0  # CUDA VMM: time spent mapping the pool's chunks (kvpool.handoff)
        self.device_wait_seconds = 0.0  # GPU: time ``sync_device`` waited for this process's queued work

    def kv_cache(self):
        """The pool as a torch tensor (``Client.kv_cache``); maps the arena the first time."""
        if self._kv is None:
            kind = self.descriptor["kind"]
            fd = arena_fd(self._address, self._token) if kind == "memfd" else None
            self.arena = open_arena(self.descriptor, device=self._device, fd=fd)
            if kind == "cuda_vmm":
                self.sync_chunks()
            self._kv = self.arena.as_tensor(self.layout.dtype, (self.num_blocks, *self.layout.block_shape))
        return self._kv

    def kv_cache_cupy(self):
        """The pool as a CuPy array (``Client.kv_cache_cupy``)."""
        if self.backend != "cuda":
            raise FailedPrecondition(
                "CuPy views exist on the CUDA backend; on the CPU use numpy.asarray(client.kv_cache())"
            )
        self.kv_cache()  # maps the arena
        shape = (self.num_blocks, *self.layout.block_shape)
        if self.layout.dtype in ("float16", "float32"):
            return self.arena.as_cupy(self.layout.dtype, shape)
        raw = {"bfloat16": np.uint16, "float8_e4m3fn": np.uint8}[self.layout.dtype]
        flat = self.arena.as_cupy("uint8", (self.num_blocks * self.block_bytes,))
        return flat.view(raw).reshape(shape)

    def run_copies(self, copies: Iterable[tuple[int, int]]) -> None:
        """Run (src, dst) block copies on the pool (copy-on-write), in this process."""
        pairs = list(copies)
        if not pairs:
            return
        import torch

        from kvpool.kernels.block_copy import copy_blocks

        kv = self.kv_cache()
        # a source may be a block no reply named to this process (a prefix another of its sequences shares)
        self.ensure_mapped(np.asarray(pairs, np.int64).ravel())
        copy_blocks(kv, torch.tensor(pairs, dtype=torch.int64, device=kv.device))

    def sync_chunks(self) -> None:
        """Map the chunks the class has now and drop those it gave up (CUDA VMM; ``kvpool.handoff``).

        Under the client's lock, like every change to the mapping: one sync at a time, and none while a call
        applies a reply.
        """
        arena = self.arena
        if arena is None or not hasattr(arena, "chunk_of"):
            return
        t0 = time.perf_counter()
        sync_chunks(self._address, self._token, arena)
        self.chunk_sync_seconds += time.perf_counter() - t0

    def let_go_of_chunks(self) -> None:
        """Chunks left this class (CUDA VMM): sync, so that the daemon may reuse or free them.

        Runs on the watch thread, between two of the client's calls (``Client`` holds its lock).
        """
        try:
            self.sync_chunks()
        except Exception:  # noqa: BLE001 - the next reply that needs a chunk syncs again, and says why
            pass

    def ensure_mapped(self, blocks) -> None:
        """Before any of ``blocks`` is used here, every chunk they lie in is mapped (CUDA VMM).

        The daemon maps a chunk into its class before it hands out a block in
        it; this process maps it when a reply first names such a block.
        """
        arena = self.arena
        if arena is None or not hasattr(arena, "covers") or arena.covers(blocks, self.block_bytes):
            return
        self.sync_chunks()
        if not arena.covers(blocks, self.block_bytes):
            raise Unavailable("kvpoold handed out blocks in chunks it did not hand this process; attach again")

    def unmapped_blocks(self, blocks) -> list[int]:
        """``Client.unmapped_blocks``: the ids in ``blocks`` not covered by this process's mapped chunks."""
        arena = self.arena
        ids = np.unique(np.asarray(list(blocks), np.int64))
        if arena is None or not hasattr(arena, "covers") or arena.covers(ids, self.block_bytes):
            return []
        return [b for b in ids.tolist() if not arena.covers([b], self.block_bytes)]

    def sync_device(self) -> None:
        """Make this process's pool writes visible to the daemon's copies (GPU: synchronize).

        The ordering rule between a client and the daemon, which needs no CUDA
        event shared between the processes:

        * The daemon reads pool blocks on a client's behalf (swap-out; demotion
          of cached blocks to the host or disk tier) only after a call that
          says their KV is written: a ``Step`` (``extend`` reaching the daemon,
          ``flush``, ``mark_written``, ``free``) or ``SwapOut``.  This method
          runs first in each of those calls, so every kernel this process
          queued on the pool has finished before the daemon can copy a block
          out.  Blocks of a session that ends without such a call lose their
          hash and are never copied out.
        * The daemon's own copies complete before the reply that lets a client
          use the blocks involved: device reads (demotions, swap-outs) before
          it replies to the call that planned them, so a block is handed out
          again only after its bytes are copied; device writes (promotions,
          swap-ins) before ``Create``/``SwapIn`` reply, or with ``wait=False``
          before ``Wait`` replies for the positions listed in
          ``Sequence.arriving`` (the daemon holds those blocks meanwhile).  A
          reply therefore means the bytes are in place; the client launches
          nothing on them before it.
        * Copy-on-write copies are run by this process on its own stream
          (``run_copies``), ordered after its own writes by stream order.
        """
        if self._kv is not None and getattr(self._kv, "is_cuda", False):
            import torch

            t0 = time.perf_counter()
            torch.cuda.synchronize(self._kv.device)
            self.device_wait_seconds += time.perf_counter() - t0

    def close(self) -> None:
        """Unmap the arena (views still alive keep their memory until they die)."""
        self._kv = None
        if self.arena is not None:
            self.arena.close()
