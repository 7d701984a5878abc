"""GPU <-> pinned host copies of batches of blocks.

A batch of blocks is scattered over the pool (one block = one contiguous
transfer unit) and over the host tier's slots.  One ``cudaMemcpyAsync`` per
block reaches only a fraction of PCIe for small blocks (32 KiB: ~10 GB/s), so
a batch goes through a device staging buffer instead:

* device -> host: ONE gather launch (``kvpool.kernels.block_copy``) packs the
  blocks into the staging buffer at HBM speed, then one DMA per *run* of
  consecutive host slots (the slot allocator hands a batch ascending slots,
  so a batch is usually one run or a few) copies it to pinned memory;
* host -> device: the DMAs first, then ONE scatter launch.

Both directions run the same loop (``_copy``); each has its own stream and
staging buffer, so a swap-out and a swap-in overlap (the two DMA directions
use separate copy engines).  Batches larger than the staging buffer go in
pieces, in stream order.  Callers get a CUDA event per batch: device reads
are complete when it has fired, and so are device writes.

Host memory is given as a numpy uint8 buffer plus one byte offset per block
(``run_bounds`` finds the runs), so the caller keeps no object per block.
"""

from __future__ import annotations

import numpy as np

DEFAULT_STAGING = 64 << 20  # per direction, on the GPU, taken on first use


def run_bounds(offsets, size: int, piece: int | None = None) -> list[tuple[int, int]]:
    """[i0, i1) index ranges whose offsets follow each other by ``size``.

    With ``piece``, a range also ends at every multiple of ``piece`` (the
    staging buffer's capacity in blocks), so that no range spans two pieces.
    """
    off = np.asarray(offsets, np.int64)
    n = off.size
    if n == 0:
        return []
    cut = np.flatnonzero(off[1:] != off[:-1] + size) + 1
    if piece is not None and piece < n:
        cut = np.union1d(cut, np.arange(piece, n, piece))
    bounds = [0, *cut.tolist(), n]
    return list(zip(bounds[:-1], bounds[1:]))


class CudaCopier:
    def __init__(self, device: int, staging_bytes: int = DEFAULT_STAGING) -> None:
        import torch

        self.torch = torch
        self.device = torch.device("cuda", device)
        self.out_stream = torch.cuda.Stream(self.device)
        self.in_stream = torch.cuda.Stream(self.device)
        self.staging_bytes = staging_bytes
        self._stage: dict[str, object] = {}

    def _staging(self, which: str, block_bytes: int):
        need = max(self.staging_bytes // block_bytes, 1) * block_bytes
        buf = self._stage.get(which)
        if buf is None or buf.numel() < need:
            buf = self._stage[which] = self.torch.empty(need, dtype=self.torch.uint8, device=self.device)
        return buf

    def to_host(self, pool, ids, host: np.ndarray, offsets):
        """Copy ``pool[ids[i]]`` into ``host[offsets[i]:]``; returns the CUDA event of the batch."""
        return self._copy(pool, ids, host, offsets, out=True)

    def to_device(self, pool, ids, host: np.ndarray, offsets):
        """Copy ``host[offsets[i]:]`` into ``pool[ids[i]]``; returns the CUDA event of the batch."""
        return self._copy(pool, ids, host, offsets, out=False)

    def _copy(self, pool, ids, host: np.ndarray, offsets, out: bool):
        """One gather (out) or scatter (in) launch per staging piece, one DMA per run of host slots."""
        from kvpool.kernels.block_copy import gather_blocks, scatter_blocks

        torch = self.torch
        bb = pool.shape[1]
        ids = np.asarray(ids, np.int64)
        offsets = np.asarray(offsets, np.int64)
        stream = self.out_stream if out else self.in_stream
        stage = self._staging("out" if out else "in", bb)
        cap = stage.numel() // bb
        host_t = torch.from_numpy(host)  # no copy: page-locked memory stays page-locked
        ranges = run_bounds(offsets, bb, cap)
        starts = offsets[[i0 for i0, _ in ranges]].tolist() if ranges else []
        with torch.cuda.stream(stream):
            k = 0
            for start in range(0, len(ids), cap):
                stop = min(len(ids), start + cap)
                rows = stage[:(stop - start) * bb].view(stop - start, bb)
                if out:
                    gather_blocks(pool, ids[start:stop], rows, stream=stream, check=False)
                while k < len(ranges) and ranges[k][0] < stop:
                    i0, i1 = ranges[k]
                    h = host_t[starts[k]:starts[k] + (i1 - i0) * bb]
                    d = rows[i0 - start:i1 - start].reshape(-1)
                    if out:
                        h.copy_(d, non_blocking=True)
                    else:
                        d.copy_(h, non_blocking=True)
                    k += 1
                if not out:
                    scatter_blocks(pool, ids[start:stop], rows, stream=stream, check=False)
            ev = torch.cuda.Event()
            ev.record(stream)
        return ev
