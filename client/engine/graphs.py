"""Decode steps replayed as CUDA graphs: one graph per padded batch size, captured on first use."""

from __future__ import annotations

import bisect
import logging
import time

import torch

from ..hf import PagedModel
from .runner import StepRunner

log = logging.getLogger("kvpool.engine")


def graph_batch_sizes(max_seqs: int) -> list[int]:
    """The batch sizes graphs are captured for: 1, 2, 4, then every multiple of 8, and ``max_seqs``.

    A decode step of ``n`` sequences runs the graph of the smallest size
    ``>= n``; the rows above ``n`` are idle (one token, no write), so the
    padding costs at most 7 rows' attention past 8 sequences.
    """
    sizes = {s for s in (1, 2, 4) if s < max_seqs} | set(range(8, max_seqs, 8)) | {max_seqs}
    return sorted(sizes)


class GraphRunner(StepRunner):
    """A ``StepRunner`` whose decode-only steps replay CUDA graphs.

    The model's whole forward (transformers' layers, kvpool's ``write_kv``
    and attention kernels, the logits of the kept rows) is captured once per
    batch size in ``graph_batch_sizes``, on the persistent device buffers of
    ``StepBuffers``: a step then costs the host one buffer upload and one
    ``replay``, instead of the hundreds of kernel launches transformers
    issues from Python.  Graphs are captured with the longest length the
    block table holds, so their grids fit any batch (the page-aware decode
    kernel divides the work by the lengths on the device).  Mixed and
    prefill steps run eagerly.

    Args:
        model, max_tokens, max_seqs, max_blocks: as ``StepRunner``.
        capture: capture graphs (CUDA only); ``False`` pads decode steps to
            the same sizes and runs them eagerly (what a graph would compute).
    """

    def __init__(self, model: PagedModel, max_tokens: int, max_seqs: int, max_blocks: int, *,
                 capture: bool = True) -> None:
        super().__init__(model, max_tokens, max_seqs, max_blocks)
        self.sizes = graph_batch_sizes(max_seqs)
        self.capture = capture and model.device.type == "cuda"
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._pool = None
        self.capture_seconds = 0.0
        self._replays: list | None = None  # (sequences, graph size, start event, end event) while timed

    def size_for(self, num_seqs: int) -> int:
        """The graph size that runs a decode step of ``num_seqs`` sequences."""
        return self.sizes[bisect.bisect_left(self.sizes, num_seqs)]

    def padded_rows(self, num_seqs: int, num_tokens: int) -> int:
        return self.size_for(num_seqs) if num_tokens == num_seqs else num_seqs

    def run_decode(self, num_seqs: int, max_len: int) -> torch.Tensor:
        size = self.size_for(num_seqs)
        if not self.capture:
            return self.run_eager(size, size, max_len, decode=True)[:num_seqs]
        entry = self._graphs.get(size)
        if entry is None:
            entry = self._graphs[size] = self._capture(size)
        graph, logits = entry
        with torch.cuda.device(self.model.device):  # the model's GPU, whichever is current
            if self._replays is None:
                graph.replay()
            else:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                graph.replay()
                end.record()
                self._replays.append((num_seqs, size, start, end))
        return logits[:num_seqs]

    def time_replays(self) -> None:
        """From now on, record CUDA events around every replay (``replay_ms`` reads them): for benchmarks."""
        self._replays = []

    def replay_ms(self) -> list[tuple[int, int, float]]:
        """``(sequences, graph size, GPU ms)`` of each replay since ``time_replays``, in order (waits for them)."""
        if not self._replays:
            return []
        self._replays[-1][3].synchronize()
        return [(n, size, start.elapsed_time(end)) for n, size, start, end in self._replays]

    def capture_all(self) -> None:
        """Capture every size's graph now, largest first (the smaller ones reuse its memory pool).

        The batch is all idle rows reading one block of a scratch one-token
        sequence, freed afterwards.  Without this, each size is captured the
        first time a decode step needs it.
        """
        if not self.capture:
            return
        client = self.model.client
        (scratch,) = client.create_sequences([[0]])
        try:
            n, rows = self.buffers.np, self.sizes[-1]
            self.buffers.begin()
            n["cu_seqlens_q"][0] = 0
            n["block_tables"][0, 0] = client.block_ids(scratch, 0)[0]
            self._pad(0, rows)
            self.buffers.upload(rows)
            for size in reversed(self.sizes):
                if size not in self._graphs:
                    self._graphs[size] = self._capture(size)
            torch.cuda.synchronize(self.model.device)
        finally:
            client.free([scratch])

    @property
    def captured_sizes(self) -> list[int]:
        return sorted(self._graphs)

    def _capture(self, size: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        """Capture the decode forward of ``size`` rows on the buffers the current step already filled.

        One eager run first: it compiles the kernels and lets the allocator and
        cuBLAS settle outside the capture.  It writes the step's K/V, as the
        replay that follows does again (the same values in the same slots).
        """
        t0 = time.perf_counter()
        capacity = self.buffers.max_blocks * self.block_size
        self.run_eager(size, size, capacity, decode=True)
        torch.cuda.synchronize(self.model.device)
        if self._pool is None:
            with torch.cuda.device(self.model.device):
                self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        # thread_local: the serving thread captures while other threads (HTTP, gRPC) run on
        with torch.cuda.device(self.model.device), \
                torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
            logits = self.run_eager(size, size, capacity, decode=True)
        took = time.perf_counter() - t0
        self.capture_seconds += took
        log.info("captured the decode graph of %d sequences in %.2f s", size, took)
        return graph, logits
