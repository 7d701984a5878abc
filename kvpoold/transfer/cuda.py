"""GPU <-> pinned host copies of batches of blocks.

A batch of blocks is scattered over the pool (one block = one contiguous
transfer unit) and over the host tier's slots.  One ``cudaMemcpyAsync`` per
block reaches only a fraction of PCIe for small blocks (32 KiB: ~10 GB/s), so
a batch goes through a device staging buffer instead:

* device -> host: ONE gather launch (``kvpool.kernels.block_copy``) packs the
  blocks into the staging buffer at HBM speed, then one DMA per *run* of
  consecutive host slots (the slot allocator hands out the lowest free slots,
  so a batch is usually one run) copies it to pinned memory;
* host -> device: the DMAs first, then ONE scatter launch.

Each direction has its own stream and staging buffer, so a swap-out and a
swap-in overlap (the two DMA directions use separate copy engines).  Batches
larger than the staging buffer go in pieces, in stream order.  Callers get a
CUDA event per batch: device reads are complete when it has fired, and so are
device writes.
"""

from __future__ import annotations

import numpy as np

DEFAULT_STAGING = 64 << 20  # per direction, on the GPU, taken on first use


def runs(offsets, size: int) -> list[tuple[int, int]]:
    """[i0, i1) index ranges whose host offsets follow each other by ``size`` (offset < 0: alone)."""
    off = np.asarray(offsets, np.int64)
    if off.size == 0:
        return []
    joined = (off[1:] == off[:-1] + size) & (off[1:] >= 0) & (off[:-1] >= 0)
    starts = np.flatnonzero(~joined) + 1
    bounds = [0, *starts.tolist(), off.size]
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

    @staticmethod
    def _host_views(host_tensor, slots, bb: int):
        """Per run: (i0, i1, host tensor of (i1 - i0) * bb bytes)."""
        import torch

        offsets = [s.offset for s in slots]
        out = []
        for i0, i1 in runs(offsets, bb):
            if offsets[i0] >= 0:
                out.append((i0, i1, host_tensor[offsets[i0]:offsets[i0] + (i1 - i0) * bb]))
            else:  # a temporary buffer: not part of the pinned store
                out.append((i0, i1, torch.from_numpy(slots[i0].view[:bb])))
        return out

    def to_host(self, pool, ids: list[int], host_tensor, slots):
        """Copy ``pool[ids[i]]`` into ``slots[i]`` (host slots); returns the CUDA event of the batch."""
        from kvpool.kernels.block_copy import gather_blocks

        torch = self.torch
        bb = pool.shape[1]
        stage = self._staging("out", bb)
        cap = stage.numel() // bb
        views = self._host_views(host_tensor, slots, bb)
        with torch.cuda.stream(self.out_stream):
            for start in range(0, len(ids), cap):
                stop = min(len(ids), start + cap)
                rows = stage[:(stop - start) * bb].view(stop - start, bb)
                gather_blocks(pool, np.asarray(ids[start:stop], np.int64), rows, stream=self.out_stream, check=False)
                for i0, i1, dst in views:
                    lo, hi = max(i0, start), min(i1, stop)
                    if lo >= hi:
                        continue
                    d = dst[(lo - i0) * bb:(hi - i0) * bb]
                    d.copy_(rows[lo - start:hi - start].reshape(-1), non_blocking=True)
            ev = torch.cuda.Event()
            ev.record(self.out_stream)
        return ev

    def to_device(self, pool, ids: list[int], host_tensor, slots):
        """Copy ``slots[i]`` (host) into ``pool[ids[i]]``; returns the CUDA event of the batch."""
        from kvpool.kernels.block_copy import scatter_blocks

        torch = self.torch
        bb = pool.shape[1]
        stage = self._staging("in", bb)
        cap = stage.numel() // bb
        views = self._host_views(host_tensor, slots, bb)
        with torch.cuda.stream(self.in_stream):
            for start in range(0, len(ids), cap):
                stop = min(len(ids), start + cap)
                rows = stage[:(stop - start) * bb].view(stop - start, bb)
                for i0, i1, src in views:
                    lo, hi = max(i0, start), min(i1, stop)
                    if lo >= hi:
                        continue
                    rows[lo - start:hi - start].reshape(-1).copy_(src[(lo - i0) * bb:(hi - i0) * bb],
                                                                 non_blocking=True)
                scatter_blocks(pool, np.asarray(ids[start:stop], np.int64), rows, stream=self.in_stream, check=False)
            ev = torch.cuda.Event()
            ev.record(self.in_stream)
        return ev
