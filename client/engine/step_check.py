"""An optional check of every step's inputs against the client's mirror, before a kernel reads them.

``KVPOOL_CHECK_STEPS=1`` turns it on (``StepRunner``): each step's block-table rows must equal its
sequences' blocks in the mirror, every block a kernel reads or writes must lie in memory this process
maps, and every slot written must belong to its own sequence.  A step that fails ends its requests with
an error that names the row and the blocks, instead of a kernel faulting on the GPU (which ends every
request of the process) or reading another sequence's K/V.  It costs a pass over the tables per step.
"""

from __future__ import annotations

import os

import numpy as np

from ..batch import slot_mapping
from ..protocol.sizes import cdiv
from ..sequence import seq_ids


class StepCheckError(RuntimeError):
    """A step's inputs name blocks its sequences do not hold, or that this process does not map."""


def checks_enabled() -> bool:
    return os.environ.get("KVPOOL_CHECK_STEPS", "") not in ("", "0")


def check_step(arrays, items, num_tokens: int, client, block_size: int) -> None:
    """Raise ``StepCheckError`` unless the filled ``arrays`` (``StepBuffers.np``) match ``items``' sequences."""
    tables, lens = arrays["block_tables"], arrays["seq_lens"]
    used = []
    for row, item in enumerate(items):
        need = cdiv(int(lens[row]), block_size)
        have = tables[row, :need].tolist()
        want = client.block_ids(item.seq)[:need]
        if have != want:
            wrong = [i for i in range(need) if i >= len(want) or have[i] != want[i]]
            raise StepCheckError(
                f"row {row} (request key {item.table_key}, sequence {seq_ids(item.seq)[0]}, length {int(lens[row])}) "
                f"holds blocks {[have[i] for i in wrong[:8]]} at positions {wrong[:8]} where the sequence has "
                f"{[want[i] if i < len(want) else None for i in wrong[:8]]}")
        used.append(have)
    ids = [b for row in used for b in row]
    unmapped = client.unmapped_blocks(ids)
    if unmapped:
        rows = [r for r, row in enumerate(used) if set(row) & set(unmapped)]
        raise StepCheckError(f"blocks {unmapped[:8]} of rows {rows[:8]} lie in memory this process does not map")
    counts = np.diff(arrays["cu_seqlens_q"][:len(items) + 1])
    row_of = np.repeat(np.arange(len(items)), counts)
    slots = arrays["slot_mapping"][:num_tokens].astype(np.int64)
    own = slot_mapping(tables, arrays["positions"][:num_tokens], block_size, rows=row_of)
    wrong = np.flatnonzero((slots >= 0) & (slots != own))
    if len(wrong):
        t = int(wrong[0])
        raise StepCheckError(f"token {t} of row {row_of[t]} writes slot {int(slots[t])}, not its own {int(own[t])}")
