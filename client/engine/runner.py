"""One forward of a mixed batch (prefill chunks and decode tokens) through a ``PagedModel``."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..batch import pack
from ..hf import PagedModel
from .buffers import BlockTableRows, StepBuffers
from .step_check import StepCheckError, check_step, checks_enabled


@dataclass
class StepItem:
    """One sequence's share of a step.

    ``tokens`` sit at positions ``start ..`` of the sequence, whose block
    table already covers them; K/V is written for positions from
    ``write_from`` on (the ones before are in the pool already: a fully
    cached prompt recomputes only its last query).  ``table_key`` names the
    request's current blocks (see ``BlockTableRows``).
    """

    seq: object
    table_key: tuple
    start: int
    tokens: list[int]
    write_from: int


class StepRunner:
    """Packs a step's items into the persistent buffers and runs the model once.

    The seam for the GPU: a decode-only step (every item one token) goes
    through ``run_decode``, which a CUDA-graph runner overrides to replay a
    graph captured on ``buffers.dev`` for a padded batch size; mixed and
    prefill steps run eagerly through ``run_eager``.

    Args:
        model: the ``PagedModel`` (its client, pool and model).
        max_tokens, max_seqs, max_blocks: the buffers' capacity (see ``StepBuffers``).
    """

    def __init__(self, model: PagedModel, max_tokens: int, max_seqs: int, max_blocks: int) -> None:
        self.model = model
        self.block_size = model.layout.block_size
        self.buffers = StepBuffers(max_tokens, max_seqs, max_blocks, model.device)
        self.rows = BlockTableRows(self.buffers.np["block_tables"])
        self._check_steps = checks_enabled()
        self._last: tuple[list[StepItem], int] = ([], 0)

    def run(self, items: list[StepItem]) -> torch.Tensor:
        """Compute ``items``' tokens (K/V into the pool): ``prepare`` then ``forward``.

        Returns:
            The logits of each item's last token, ``[len(items), vocab]``.
        """
        return self.forward(len(items), *self.prepare(items))

    def forward(self, num_seqs: int, num_tokens: int, max_len: int) -> torch.Tensor:
        """Run the model on what ``prepare`` left in the buffers; decode-only steps through ``run_decode``."""
        if num_tokens == num_seqs:
            return self.run_decode(num_seqs, max_len)
        return self.run_eager(num_tokens, num_seqs, max_len, decode=False)

    def prepare(self, items: list[StepItem]) -> tuple[int, int]:
        """Fill the host buffers for ``items`` and upload them; returns (tokens, longest sequence)."""
        client = self.model.client

        def fill_table(row: int, num_blocks: int) -> None:
            self.rows.fill(row, items[row].table_key, client, items[row].seq, num_blocks)

        self.buffers.begin()
        total, lens = pack(self.buffers.np, [it.tokens for it in items], [it.start for it in items],
                           [it.write_from for it in items], block_size=self.block_size, fill_table=fill_table)
        self._last = (items, total)
        if self._check_steps:
            check_step(self.buffers.np, items, total, client, self.block_size)
        rows = self.padded_rows(len(items), total)
        if rows > len(items):
            self._pad(len(items), rows)
        self.buffers.upload(rows)
        return total, int(lens.max())

    def feed(self, tokens: torch.Tensor, rows: list[int] | None = None) -> None:
        """Decode rows ``0 ..`` (one token each) take their input ids from ``tokens[rows]`` (all of ``tokens`` when
        ``rows`` is None), the last step's sampled ids, on the device: after ``prepare``, before ``forward``, with
        nothing waiting for the device."""
        if rows is not None:
            tokens = tokens.index_select(0, torch.tensor(rows, dtype=torch.int64).to(tokens.device, non_blocking=True))
        self.buffers.dev["input_ids"][: len(tokens)].copy_(tokens, non_blocking=True)

    def post_mortem(self) -> str:
        """What the last prepared step's inputs were, and whether they pass the step check now: for the log of a
        step whose kernels failed (the buffers still hold its inputs; nothing here touches the GPU)."""
        items, total = self._last
        what = (f"the failed step had {len(items)} sequences and {total} tokens, "
                f"{self.padded_rows(len(items), total)} rows run")
        try:
            check_step(self.buffers.np, items, total, self.model.client, self.block_size)
        except StepCheckError as exc:
            return f"{what}; its inputs fail the step check: {exc}"
        except Exception as exc:  # noqa: BLE001 - e.g. a sequence of it was freed since: say so, do not hide the fault
            return f"{what}; its inputs could not be checked: {exc!r}"
        return f"{what}; its inputs pass the step check (tables, mapping, slots)"

    def padded_rows(self, num_seqs: int, num_tokens: int) -> int:
        """Rows the forward runs for a step of ``num_seqs`` sequences and ``num_tokens`` tokens (here: as many)."""
        return num_seqs

    def _pad(self, num_seqs: int, rows: int) -> None:
        """Fill decode rows ``num_seqs..rows`` with idle sequences: one token, written nowhere, reading one block
        that is mapped (row 0's first), so a graph captured for ``rows`` sequences can run a smaller batch."""
        n, pad = self.buffers.np, slice(num_seqs, rows)
        extra = np.arange(1, rows - num_seqs + 1)
        n["input_ids"][pad] = 0
        n["positions"][pad] = 0
        n["slot_mapping"][pad] = -1
        n["seq_lens"][pad] = 1
        n["cu_seqlens_q"][num_seqs + 1:rows + 1] = num_seqs + extra
        n["logits_index"][pad] = num_seqs + extra - 1
        n["block_tables"][pad, 0] = n["block_tables"][0, 0]
        self.rows.forget(range(num_seqs, rows))

    def run_eager(self, num_tokens: int, num_seqs: int, max_len: int, *, decode: bool) -> torch.Tensor:
        """The forward as transformers runs it, on views of the device buffers."""
        return self.model.run_packed(self.buffers.dev, num_tokens, num_seqs, max_seq_len=max_len, decode=decode)

    def run_decode(self, num_seqs: int, max_len: int) -> torch.Tensor:
        """A decode-only step; the CUDA-graph seam (eager here)."""
        return self.run_eager(num_seqs, num_seqs, max_len, decode=True)
