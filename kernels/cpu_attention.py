"""Paged attention on the CPU with Numba: decode and prefill are one kernel.

Decode is prefill with one query per sequence, so a single kernel serves
both: a work item is (sequence, KV head, tile of up to ``Q_TILE`` query
tokens), and it handles the tile's tokens times the group's query heads
together, so each KV block is loaded and converted once per item and then
reused by every query row of the item (GQA reads each block once per KV head).
Items run in parallel (``prange``); inside an item the softmax is online
(running max and sum per row, fp32), so no score matrix is materialized.

Storage types: NumPy has no bfloat16 and Numba no float16, so the caches
arrive as raw uint16 bits and a block is converted to float32 once when it is
loaded: bfloat16 by a 16-bit shift (exact), float16 through a 65536-entry
lookup table (exact, subnormals and infinities included). float32 caches come
as float32. Passing both a uint16 and a float32 array (the unused one empty)
keeps the kernel to ONE Numba specialization for all three dtypes, which
keeps the first-call compile (and the test suite) short.

``fastmath`` leaves out ``nnan``/``ninf``: masked and empty rows rely on exact
-inf/zero handling being kept, everything else (reassociation for SIMD dot
products, contraction into FMA, approximate exp) is fair game.
"""

from __future__ import annotations

import numpy as np

from ._numba_compat import numba

MODE_F32, MODE_F16, MODE_BF16 = 0, 1, 2
_FASTMATH = {"nsz", "arcp", "contract", "afn", "reassoc"}
Q_TILE = 16  # query tokens per work item in prefill
_NEG = np.float32(-1e30)  # "no score yet"; finite so exp(_NEG - m) is a clean 0


def f16_lut() -> np.ndarray:
    """float16 bit pattern → float32 value, for all 65536 patterns."""
    return np.arange(1 << 16, dtype=np.uint16).view(np.float16).astype(np.float32)


@numba.njit(inline="always", fastmath=_FASTMATH)
def _load(src16, src32, mode, lut, base, n, dst, dst_bits):
    """Convert ``n`` cache elements starting at ``base`` into ``dst`` (float32)."""
    if mode == 0:
        for i in range(n):
            dst[i] = src32[base + i]
    elif mode == 1:
        for i in range(n):
            dst[i] = lut[src16[base + i]]
    else:
        for i in range(n):
            dst_bits[i] = np.uint32(src16[base + i]) << np.uint32(16)


@numba.njit(parallel=True, fastmath=_FASTMATH, cache=True)
def paged_attention_cpu(
    q, k16, k32, v16, v32, mode, lut, k_stride, v_stride, num_kv_heads, block_size,
    block_tables, seq_lens, cu_seqlens, items, scale, out,
):  # fmt: skip
    """``out[T, Hq, D]`` (float32) for every work item ``(seq, kv_head, tok0, ntok)``.

    ``q`` is float32 ``[T, Hq, D]``; ``k16/k32`` (and v) are flat views of one
    layer's cache starting at block 0, block ``i`` at ``i * k_stride``.
    """
    d = q.shape[2]
    group = q.shape[1] // num_kv_heads
    bs = block_size
    for w in numba.prange(items.shape[0]):
        b, h, tok0, ntok = items[w, 0], items[w, 1], items[w, 2], items[w, 3]
        q0 = cu_seqlens[b]
        q_len = cu_seqlens[b + 1] - q0
        kv_len = seq_lens[b]
        first_pos = kv_len - q_len  # position of this sequence's query 0
        rows = ntok * group
        m = np.full(rows, _NEG, dtype=np.float32)
        den = np.zeros(rows, dtype=np.float32)
        acc = np.zeros((rows, d), dtype=np.float32)
        kbuf = np.empty(bs * d, dtype=np.float32)
        vbuf = np.empty(bs * d, dtype=np.float32)
        kbits = kbuf.view(np.uint32)
        vbits = vbuf.view(np.uint32)
        s = np.empty(bs, dtype=np.float32)
        hi = min(kv_len, first_pos + tok0 + ntok)  # keys the last token of the tile sees
        for j in range((hi + bs - 1) // bs if hi > 0 else 0):
            blk = block_tables[b, j]
            n_blk = min(bs, hi - j * bs)
            _load(k16, k32, mode, lut, blk * k_stride + h * bs * d, n_blk * d, kbuf, kbits)
            _load(v16, v32, mode, lut, blk * v_stride + h * bs * d, n_blk * d, vbuf, vbits)
            for tt in range(ntok):
                n = min(n_blk, first_pos + tok0 + tt + 1 - j * bs)  # causal limit in block
                if n <= 0:
                    continue
                qt = q0 + tok0 + tt
                for g in range(group):
                    r = tt * group + g
                    qrow = q[qt, h * group + g]
                    mx = m[r]
                    for t in range(n):
                        dot = np.float32(0.0)
                        for i in range(d):
                            dot += qrow[i] * kbuf[t * d + i]
                        s[t] = dot * scale
                        mx = max(mx, s[t])
                    corr = np.exp(m[r] - mx)
                    lsum = den[r] * corr
                    for i in range(d):
                        acc[r, i] *= corr
                    for t in range(n):
                        p = np.exp(s[t] - mx)
                        lsum += p
                        for i in range(d):
                            acc[r, i] += p * vbuf[t * d + i]
                    m[r] = mx
                    den[r] = lsum
        for tt in range(ntok):
            for g in range(group):
                r = tt * group + g
                inv = np.float32(1.0) / den[r] if den[r] > 0 else np.float32(0.0)
                for i in range(d):
                    out[q0 + tok0 + tt, h * group + g, i] = acc[r, i] * inv


def work_items(cu_seqlens: np.ndarray, num_kv_heads: int, q_tile: int = Q_TILE) -> np.ndarray:
    """``[N, 4]`` int64 rows (seq, kv_head, first token in seq, tokens) covering every query."""
    q_lens = np.diff(cu_seqlens)
    seqs, starts, counts = [], [], []
    for b, n in enumerate(q_lens.tolist()):
        for t0 in range(0, n, q_tile):
            seqs.append(b)
            starts.append(t0)
            counts.append(min(q_tile, n - t0))
    base = np.array([seqs, starts, counts], dtype=np.int64).reshape(3, -1).T  # [tiles, 3]
    heads = np.arange(num_kv_heads, dtype=np.int64)
    items = np.empty((base.shape[0] * num_kv_heads, 4), dtype=np.int64)
    items[:, 0] = np.repeat(base[:, 0], num_kv_heads)
    items[:, 1] = np.tile(heads, base.shape[0])
    items[:, 2] = np.repeat(base[:, 1], num_kv_heads)
    items[:, 3] = np.repeat(base[:, 2], num_kv_heads)
    return items
