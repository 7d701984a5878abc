"""The CPU attention's work items: (sequence, KV head, query tokens), ordered so that each thread's
share of a ``prange`` carries about the same work."""

from __future__ import annotations

from typing import NamedTuple

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


SHARED_MIN_KEYS = 64  # common keys worth a shared-prefix pass: one chunk of the kernel


class SharedPrefixes(NamedTuple):
    """Decode sequences that share their leading blocks, for the kernel's shared-prefix pass.

    ``items``: ``[P, 4]`` int64 rows ``(first, count, kv_head, keys)``: the sequences
    ``members[first:first+count]`` over their common keys ``0 .. keys``; ``prefix_keys[b]``:
    the keys sequence b's own items skip (0: none). All empty when there is no such pass.
    """

    items: np.ndarray
    members: np.ndarray
    prefix_keys: np.ndarray


_NO_SHARING = SharedPrefixes(np.zeros((0, 4), np.int64), np.zeros(0, np.int64), np.zeros(0, np.int64))


def shared_prefixes(
    tables: np.ndarray, seq_lens: np.ndarray, block_size: int, group: int, num_kv_heads: int, enabled: bool
) -> SharedPrefixes:
    """Runs of decode sequences whose tables begin with the same blocks, and the keys they share.

    A shared key costs the kernel one load and conversion per ``TILE_ROWS`` rows instead of per
    sequence, and its scores are a product with the rows in the vector lanes instead of a GQA
    group's dot products. Sequences sorted by their tables put those sharing a prefix next to
    each other; a run of them shares the smallest common prefix of two neighbours (capped by
    their lengths: the keys every member sees). Where one member shares less (a shorter
    prompt, a different continuation) the run is split there if the parts save more
    (``_best_runs``). A run's members are cut into tiles of about ``TILE_ROWS`` rows, times the
    KV heads: the items of the pass.
    """
    live = np.flatnonzero(seq_lens > 0)
    if not enabled or np.unique(tables[live, 0]).size == live.size:  # no two share even a first block
        return _NO_SHARING
    lens = seq_lens.astype(np.int64)[live]
    rows = tables[live]
    order = np.lexsort(rows.T[::-1])  # by column 0, then 1, ...
    rows, lens, live = rows[order], lens[order], live[order]
    same = rows[1:] == rows[:-1]
    blocks = np.where(same.all(axis=1), same.shape[1], np.argmin(same, axis=1))
    neighbours = np.minimum(blocks * block_size, np.minimum(lens[1:], lens[:-1]))  # keys seqs i, i+1 share
    prefix_keys = np.zeros(seq_lens.size, np.int64)
    members, items, first = [], [], 0
    for lo, hi, keys in _best_runs(neighbours):
        seqs = live[lo : hi + 1]
        prefix_keys[seqs] = keys
        for tile in np.array_split(seqs, -(-seqs.size * group // TILE_ROWS)):
            members.append(tile)
            items.extend((first, tile.size, h, keys) for h in range(num_kv_heads))
            first += tile.size
    if not items:
        return _NO_SHARING
    return SharedPrefixes(np.array(items, np.int64), np.concatenate(members).astype(np.int64), prefix_keys)


def _best_runs(neighbours: np.ndarray) -> list[tuple[int, int, int]]:
    """``(lo, hi, keys)``: disjoint runs of sorted sequences lo..hi sharing ``keys`` >= ``SHARED_MIN_KEYS``.

    ``neighbours[i]``: the keys sequences i and i+1 share. A run of n shares its smallest
    neighbour value k and saves about (n - 1) k keys; it is split at that smallest value when its
    two sides save more on their own (recursively, with a stack: batches can be long).
    """
    runs = []
    # a neighbour pair under SHARED_MIN_KEYS splits every run; a run whose neighbours share the
    # same keys throughout (the usual: one prompt behind many requests) cannot gain from a split
    enough = np.concatenate([[False], neighbours >= SHARED_MIN_KEYS, [False]])
    starts, ends = np.flatnonzero(enough[1:] & ~enough[:-1]), np.flatnonzero(~enough[1:] & enough[:-1])
    for lo, hi in zip(starts.tolist(), ends.tolist()):  # sequences lo..hi share neighbours[lo:hi]
        seg = neighbours[lo:hi]
        if seg.min() == seg.max():
            runs.append((lo, hi, int(seg[0])))
        else:
            runs += _split_runs(neighbours, lo, hi)
    return runs


def _split_runs(neighbours: np.ndarray, lo: int, hi: int) -> list[tuple[int, int, int]]:
    """``_best_runs`` within sequences lo..hi by the recursion on their smallest neighbour value."""
    top_lo, top_hi = lo, hi
    best: dict[tuple[int, int], tuple[int, list]] = {}
    stack = [(lo, hi, False)]  # sequences lo..hi (hi inclusive), children done?
    while stack:
        lo, hi, done = stack.pop()
        if hi <= lo:
            best[(lo, hi)] = (0, [])
            continue
        cut = lo + int(np.argmin(neighbours[lo:hi]))
        if not done:
            stack += [(lo, hi, True), (lo, cut, False), (cut + 1, hi, False)]
            continue
        keys = int(neighbours[cut])
        whole = (hi - lo) * keys if keys >= SHARED_MIN_KEYS else 0
        (left, left_runs), (right, right_runs) = best.pop((lo, cut)), best.pop((cut + 1, hi))
        if left + right > whole:
            best[(lo, hi)] = (left + right, left_runs + right_runs)
        else:
            best[(lo, hi)] = (whole, [(lo, hi, keys)] if whole else [])
    return best[(top_lo, top_hi)][1]
