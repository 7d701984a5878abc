"""One forward's batch on the host: where each new token's K/V goes in the pool and which blocks each sequence
reads.  ``Client.slot_mapping``, ``kvpool.hf.PagedModel`` and the engine's ``StepRunner`` all build it here.

The new tokens of all sequences are packed into one row (no padding).  Per
token: ``input_ids``, ``positions`` (in its own sequence) and ``slot_mapping``
(``block * block_size + offset``; -1: attend but do not write its K/V).  Per
sequence: ``seq_lens`` (tokens after this forward), ``cu_seqlens_q`` (where
its tokens start in the row, one more entry than sequences),
``logits_index`` (its last token's row) and ``block_tables``.
"""

from __future__ import annotations

from typing import Callable, Mapping, Sequence as Seq

import numpy as np

from .protocol.sizes import cdiv

#: the arrays of a batch by their dtype (the tables last: a step copies only the rows it uses)
INT64_ARRAYS = ("input_ids", "positions", "slot_mapping", "logits_index")
INT32_ARRAYS = ("seq_lens", "cu_seqlens_q", "block_tables")


def array_sizes(max_tokens: int, max_seqs: int, max_blocks: int) -> dict[str, int]:
    """Elements of each array for a batch of up to ``max_tokens`` tokens, ``max_seqs`` sequences and
    ``max_blocks`` blocks per sequence."""
    return {"input_ids": max_tokens, "positions": max_tokens, "slot_mapping": max_tokens,
            "logits_index": max_seqs, "seq_lens": max_seqs, "cu_seqlens_q": max_seqs + 1,
            "block_tables": max_seqs * max_blocks}


def host_arrays(max_tokens: int, max_seqs: int, max_blocks: int) -> dict[str, np.ndarray]:
    """Fresh zeroed arrays for ``pack`` (``block_tables`` is ``[max_seqs, max_blocks]``)."""
    sizes = array_sizes(max_tokens, max_seqs, max_blocks)
    out = {name: np.zeros(sizes[name], np.int64) for name in INT64_ARRAYS}
    out.update({name: np.zeros(sizes[name], np.int32) for name in INT32_ARRAYS})
    out["block_tables"] = out["block_tables"].reshape(max_seqs, max_blocks)
    return out


def slot_mapping(block_table: np.ndarray, positions: np.ndarray, block_size: int,
                 rows: np.ndarray | None = None) -> np.ndarray:
    """Pool slots (block * block_size + offset) of token ``positions``, int64.

    Args:
        block_table: one sequence's block ids, or a ``[sequences, blocks]`` table with ``rows``.
        positions: each token's position in its sequence.
        block_size: tokens per block.
        rows: each token's row of a two-dimensional ``block_table``.
    """
    index = positions // block_size
    blocks = block_table[index] if rows is None else block_table[rows, index]
    return blocks.astype(np.int64) * block_size + positions % block_size


def pack(out: Mapping[str, np.ndarray], tokens: Seq[Seq[int]], starts: Seq[int], write_from: Seq[int], *,
         block_size: int, fill_table: Callable[[int, int], None]) -> tuple[int, np.ndarray]:
    """Fill the leading entries of ``out``'s arrays for one batch.

    Args:
        out: the arrays (``host_arrays``, or views of persistent buffers), large enough.
        tokens: per sequence, its new tokens, at positions ``starts[i] ..``.
        starts: per sequence, the position of its first new token.
        write_from: per sequence, the first position whose K/V is written (those before are in the pool).
        block_size: tokens per block.
        fill_table: ``fill_table(row, num_blocks)`` puts the first ``num_blocks`` block ids of sequence
            ``row`` into ``out["block_tables"][row]``.

    Returns:
        The number of tokens and each sequence's length after the forward (int64).

    Raises:
        ValueError: the batch does not fit the arrays.
    """
    num_seqs = len(tokens)
    counts = np.fromiter((len(t) for t in tokens), np.int64, num_seqs)
    total = int(counts.sum())
    if total > len(out["input_ids"]) or num_seqs > len(out["seq_lens"]):
        raise ValueError(f"a step of {total} tokens / {num_seqs} sequences exceeds the buffers")
    starts = np.asarray(starts, np.int64)
    lens = starts + counts
    cu = out["cu_seqlens_q"]
    cu[0] = 0
    np.cumsum(counts, out=cu[1:num_seqs + 1])
    out["seq_lens"][:num_seqs] = lens
    out["logits_index"][:num_seqs] = cu[1:num_seqs + 1] - 1
    for row, toks in enumerate(tokens):
        out["input_ids"][cu[row]:cu[row + 1]] = toks
        fill_table(row, cdiv(int(lens[row]), block_size))
    row_of = np.repeat(np.arange(num_seqs), counts)
    pos = np.arange(total) - np.repeat(cu[:num_seqs], counts) + np.repeat(starts, counts)
    out["positions"][:total] = pos
    slots = slot_mapping(out["block_tables"], pos, block_size, rows=row_of)
    slots[pos < np.repeat(np.asarray(write_from, np.int64), counts)] = -1
    out["slot_mapping"][:total] = slots
    return total, lens
