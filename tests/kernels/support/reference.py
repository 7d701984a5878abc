"""Float64 reference implementations of the paged kernels (plain NumPy).

Slow and obviously correct: gather each sequence's blocks through its block
table into a contiguous ``[seq_len, num_kv_heads, head_dim]`` array, then do
textbook softmax attention in float64. The tests compare every kernel (CPU
and GPU) against these, so they share no code with the kernels.

Inputs may be NumPy arrays or torch tensors (any device, any dtype,
bfloat16 included); everything is converted to float64 / int64 NumPy first.
"""

from __future__ import annotations

import math

import numpy as np

__all__ = [
    "gather_sequence",
    "paged_attention_reference",
    "paged_decode_reference",
    "paged_prefill_reference",
    "write_kv_reference",
]


def _f64(x) -> np.ndarray:
    if hasattr(x, "detach"):  # torch tensor; .double() also handles bfloat16
        return x.detach().cpu().double().numpy()
    return np.asarray(x, dtype=np.float64)


def _i64(x) -> np.ndarray:
    if hasattr(x, "detach"):
        return x.detach().cpu().long().numpy()
    return np.asarray(x, dtype=np.int64)


def gather_sequence(cache, block_table, seq_len: int) -> np.ndarray:
    """``cache [num_blocks, H, bs, D]`` + one block-table row → ``[seq_len, H, D]``."""
    cache = _f64(cache)
    table = _i64(block_table)
    bs = cache.shape[2]
    pos = np.arange(seq_len)
    blocks = cache[table[pos // bs], :, pos % bs, :]  # [seq_len, H, D]
    return blocks


def paged_attention_reference(q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, scale=None):
    """Causal attention of each sequence's last ``q_len`` positions over its cache.

    Query ``i`` of sequence ``b`` sits at position ``seq_lens[b] - q_len + i``
    and attends to positions ``0..`` that position. Sequences with no keys
    give zeros. Returns float64 ``[T, Hq, D]``.
    """
    q = _f64(q)
    k_cache, v_cache = _f64(k_cache), _f64(v_cache)
    tables, lens, cu = _i64(block_tables), _i64(seq_lens), _i64(cu_seqlens_q)
    t, hq, d = q.shape
    hkv = k_cache.shape[1]
    group = hq // hkv
    if scale is None:
        scale = 1.0 / math.sqrt(d)
    out = np.zeros((t, hq, d), dtype=np.float64)
    for b in range(len(lens)):
        q0, q1 = int(cu[b]), int(cu[b + 1])
        n, q_len = int(lens[b]), q1 - q0
        if q_len == 0 or n == 0:
            continue
        k = gather_sequence(k_cache, tables[b], n)  # [n, Hkv, D]
        v = gather_sequence(v_cache, tables[b], n)
        k = np.repeat(k, group, axis=1)  # query head h uses KV head h // group
        v = np.repeat(v, group, axis=1)
        # [Hq, q_len, n]; a batched matmul (BLAS), not einsum: the GPU tests compare
        # prefills of hundreds of tokens x 32 heads and 128k-token decodes with this
        scores = np.matmul(q[q0:q1].transpose(1, 0, 2), k.transpose(1, 2, 0)) * scale
        pos = n - q_len + np.arange(q_len)
        mask = np.arange(n)[None, :] <= pos[:, None]  # [q_len, n]
        scores = np.where(mask[None], scores, -np.inf)
        row_has_keys = mask.any(axis=1)  # pos < 0 when seq_len < q_len
        scores = np.where(row_has_keys[None, :, None], scores, 0.0)
        scores -= scores.max(axis=-1, keepdims=True)
        p = np.exp(scores)
        p = np.where(row_has_keys[None, :, None], p / p.sum(axis=-1, keepdims=True), 0.0)
        out[q0:q1] = np.matmul(p, v.transpose(1, 0, 2)).transpose(1, 0, 2)
    return out


def paged_decode_reference(q, k_cache, v_cache, block_tables, seq_lens, scale=None):
    """Decode: one query per sequence, at the sequence's last position."""
    b = len(_i64(seq_lens))
    return paged_attention_reference(q, k_cache, v_cache, block_tables, seq_lens, np.arange(b + 1), scale)


paged_prefill_reference = paged_attention_reference


def write_kv_reference(key, value, k_cache, v_cache, slot_mapping):
    """Returns float64 copies of the caches after writing ``key``/``value`` by slot.

    A negative slot is padding and skipped; for duplicate slots the last
    token wins (the kernels leave duplicates undefined, so tests avoid them).
    """
    key, value = _f64(key), _f64(value)
    k, v = _f64(k_cache).copy(), _f64(v_cache).copy()
    slots = _i64(slot_mapping)
    bs = k.shape[2]
    for i, s in enumerate(slots):
        if s < 0:
            continue
        k[s // bs, :, s % bs, :] = key[i]
        v[s // bs, :, s % bs, :] = value[i]
    return k, v
