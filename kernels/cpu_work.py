"""The CPU attention's work items: (sequence, KV head, query tokens), ordered so that each thread's
share of a ``prange`` carries about the same work."""

from __future__ import annotations

import numpy as np

Q_TILE = 16  # query tokens per work item in prefill, at least (see q_tile)
TILE_ROWS = 128  # query rows (tokens x GQA group) per prefill work item, about


def q_tile(group: int) -> int:
    """Query tokens per prefill work item: about ``TILE_ROWS`` rows, at least ``Q_TILE`` tokens.

    The score product keeps the rows in its vector lanes, so each pass over 4 x 4 values of K
    makes rows / 16 vector steps, and each converted K/V chunk serves every row: a tile of a
    single vector's rows converts each chunk for too few rows, while from 64 rows up the tile
    size matters little, for every GQA group (benchmarks/NOTES-kernels.md).
    """
    return max(Q_TILE, TILE_ROWS // max(group, 1))


def work_items(
    cu_seqlens: np.ndarray,
    num_kv_heads: int,
    q_tile: int = Q_TILE,
    seq_lens: np.ndarray | None = None,
    *,
    window: int = 0,
) -> np.ndarray:
    """``[N, 4]`` int64 rows (seq, kv_head, first token in seq, tokens) covering every query.

    With ``seq_lens`` the items come in the order heaviest, lightest, 2nd heaviest,
    2nd lightest, ... (work: tokens x keys they see, at most ``window + tokens - 1``
    keys with a sliding window): ``prange`` gives each thread an equal contiguous run
    of items, and causal prefill tiles differ up to ``q_len / q_tile``-fold, so a run
    of such pairs balances where tile order would leave the thread with the last
    tiles doing most of the work.
    """
    q_lens = np.diff(cu_seqlens)
    seqs, starts, counts = [], [], []
    for b, n in enumerate(q_lens.tolist()):
        for t0 in range(0, n, q_tile):
            seqs.append(b)
            starts.append(t0)
            counts.append(min(q_tile, n - t0))
    base = np.array([seqs, starts, counts], dtype=np.int64).reshape(3, -1).T  # [tiles, 3]
    if seq_lens is not None and base.shape[0] > 1:
        first = np.asarray(seq_lens, dtype=np.int64)[base[:, 0]] - q_lens[base[:, 0]]
        keys = np.maximum(first + base[:, 1] + base[:, 2], 0)
        if window > 0:
            keys = np.minimum(keys, window + base[:, 2] - 1)
        work = base[:, 2] * keys + 64  # + per-item overhead
        by_work = np.argsort(-work, kind="stable")
        order = np.empty_like(by_work)
        half = (by_work.size + 1) // 2
        order[0::2] = by_work[:half]
        order[1::2] = by_work[half:][::-1]
        base = base[order]
    heads = np.arange(num_kv_heads, dtype=np.int64)
    items = np.empty((base.shape[0] * num_kv_heads, 4), dtype=np.int64)
    items[:, 0] = np.repeat(base[:, 0], num_kv_heads)
    items[:, 1] = np.tile(heads, base.shape[0])
    items[:, 2] = np.repeat(base[:, 1], num_kv_heads)
    items[:, 3] = np.repeat(base[:, 2], num_kv_heads)
    return items
