"""The step's inputs in persistent buffers: filled in place on the host, copied to the device once."""

from __future__ import annotations

import numpy as np
import torch

from ..batch import INT32_ARRAYS, INT64_ARRAYS, array_sizes
from ..protocol.sizes import cdiv
from ..sequence import seq_ids


class StepBuffers:
    """One staging area on the host and its twin on the device, at fixed addresses.

    Every array a forward needs (token ids, positions, slots, block tables,
    lengths, where each sequence's tokens start, which rows' logits to keep)
    is a view at a fixed offset of one byte buffer, so a step is one
    host-to-device copy of the used prefix, and a CUDA graph captured on the
    device views stays valid from step to step.  On the CPU the device
    buffer is the host buffer.

    Args:
        max_tokens: tokens per step (``max_num_batched_tokens``).
        max_seqs: sequences per step.
        max_blocks: block-table width (the longest sequence's blocks).
        device: the model's device.
    """

    def __init__(self, max_tokens: int, max_seqs: int, max_blocks: int, device: torch.device) -> None:
        self.max_tokens, self.max_seqs, self.max_blocks = max_tokens, max_seqs, max_blocks
        sizes = array_sizes(max_tokens, max_seqs, max_blocks)
        self._offsets, offset = {}, 0
        for name in INT64_ARRAYS + INT32_ARRAYS:
            width = 8 if name in INT64_ARRAYS else 4
            offset = cdiv(offset, 8) * 8
            self._offsets[name] = (offset, sizes[name], width)
            offset += sizes[name] * width
        pin = device.type == "cuda"
        self.host = torch.zeros(offset, dtype=torch.uint8, pin_memory=pin)
        self.device_bytes = self.host if device.type == "cpu" else torch.zeros(offset, dtype=torch.uint8,
                                                                                device=device)
        self.np = {name: self._view(self.host, name).numpy() for name in self._offsets}
        self.np["block_tables"] = self.np["block_tables"].reshape(max_seqs, max_blocks)
        self.dev = {name: self._view(self.device_bytes, name) for name in self._offsets}
        self.dev["block_tables"] = self.dev["block_tables"].view(max_seqs, max_blocks)
        self._copied = torch.cuda.Event() if pin else None  # the last upload, read from the pinned host buffer

    def begin(self) -> None:
        """Wait until the last upload has read the host buffer, before it is written again."""
        if self._copied is not None:
            self._copied.synchronize()

    def _view(self, buf: torch.Tensor, name: str) -> torch.Tensor:
        offset, count, width = self._offsets[name]
        return buf[offset:offset + count * width].view(torch.int64 if width == 8 else torch.int32)

    def upload(self, num_seqs: int) -> None:
        """Copy the used prefix to the device (no-op on the CPU): everything up to row ``num_seqs`` of the tables."""
        if self.device_bytes is self.host:
            return
        offset = self._offsets["block_tables"][0] + num_seqs * self.max_blocks * 4
        self.device_bytes[:offset].copy_(self.host[:offset], non_blocking=True)
        self._copied.record()


class BlockTableRows:
    """Which request's table each row of the block-table buffer holds, so a step writes only new blocks.

    A row is keyed by the request's ``table_key``, which changes whenever its
    blocks may all have moved (admission, swap-in).  The last block known is
    written again each step: copy-on-write can replace a partly filled tail.
    """

    def __init__(self, tables: np.ndarray) -> None:
        self._tables = tables
        self._owner: list[tuple | None] = [None] * tables.shape[0]
        self._filled = [0] * tables.shape[0]

    def fill(self, row: int, key: tuple, client, seq, num_blocks: int) -> None:
        """Make ``row`` hold the first ``num_blocks`` block ids of ``seq``."""
        start = max(self._filled[row] - 1, 0) if self._owner[row] == key else 0
        if num_blocks > self._tables.shape[1]:
            raise ValueError(f"a sequence of {num_blocks} blocks exceeds the table width {self._tables.shape[1]}")
        ids = client.block_ids(seq, start)[: num_blocks - start]
        if len(ids) < num_blocks - start:
            # the columns left would keep another request's blocks: attention would read them
            raise ValueError(f"sequence {seq_ids(seq)[0]} has {start + len(ids)} blocks; the step needs {num_blocks}")
        self._tables[row, start:start + len(ids)] = ids
        self._owner[row], self._filled[row] = key, start + len(ids)

    def forget(self, rows) -> None:
        """Rows overwritten by something else: their next owner fills them from the first block."""
        for row in rows:
            self._owner[row], self._filled[row] = None, 0
