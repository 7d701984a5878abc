"""Float64 reference implementations of the paged kernels (plain NumPy).

Slow and obviously correct: gather each sequence's blocks through its block
table into a contiguous ``[seq_len, num_kv_heads, head_dim]`` array, then do
textbook softmax attention in float64. The tests compare every kernel (CPU
and GPU) against these, so they share no code with the kernels.

Inputs may be NumPy arrays or torch tensors (any device, any dtype,
bfloat16 included); everything is converted to float64 / int64 NumPy first.
float8_e4m3fn tensors are decoded here from their bits (``fp8_e4m3_decode``),
not by torch's conversion, and ``fp8_e4m3_encode`` is an independent model of
``write_kv``'s quantization, so the tests check torch's fp8 rounding too.
"""

from __future__ import annotations

import math

import numpy as np

__all__ = [
    "fp8_e4m3_decode",
    "fp8_e4m3_encode",
    "gather_sequence",
    "paged_attention_reference",
    "paged_decode_reference",
    "paged_prefill_reference",
    "write_kv_reference",
]


FP8_E4M3_MAX = 448.0


def fp8_e4m3_decode(codes) -> np.ndarray:
    """float8_e4m3fn codes (uint8) → float64: sign, 4 exponent bits (bias 7), 3 mantissa
    bits; exponent 0 is subnormal (m * 2^-9); S.1111.111 is NaN, there is no infinity."""
    c = np.asarray(codes, dtype=np.uint8).astype(np.int64)
    sign = np.where(c & 0x80, -1.0, 1.0)
    e, m = (c >> 3) & 0xF, c & 0x7
    mag = np.where(e == 0, m * 2.0**-9, (1 + m / 8.0) * 2.0 ** (e - 7))
    return np.where((c & 0x7F) == 0x7F, np.nan, sign * mag)


def fp8_e4m3_encode(x, scale: float = 1.0) -> np.ndarray:
    """``write_kv``'s quantization, as float64 values: x / scale in float32, clamped to
    +-448, rounded to the nearest e4m3 value (ties to the even mantissa)."""
    y = (np.asarray(_f64(x), dtype=np.float32) / np.float32(scale)).astype(np.float64)
    y = np.clip(y, -FP8_E4M3_MAX, FP8_E4M3_MAX)
    mag = np.abs(y)
    # the spacing of e4m3 values around |y|: 2^(e-3) for normal, 2^-9 below 2^-6
    exp = np.floor(np.log2(np.where(mag >= 2.0**-6, mag, 1.0)))
    step = np.where(mag >= 2.0**-6, 2.0 ** (exp - 3), 2.0**-9)
    return np.round(y / step) * step  # np.round: half to even; y / step is exact


def _f64(x) -> np.ndarray:
    if hasattr(x, "detach"):  # torch tensor; .double() also handles bfloat16
        x = x.detach().cpu()
        if str(x.dtype) == "torch.float8_e4m3fn":
            return fp8_e4m3_decode(x.view(dtype=_torch_uint8(x)).numpy())
        return x.double().numpy()
    return np.asarray(x, dtype=np.float64)


def _torch_uint8(x):
    import torch  # only here: the reference itself needs no torch

    return torch.uint8


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


def paged_attention_reference(
    q,
    k_cache,
    v_cache,
    block_tables,
    seq_lens,
    cu_seqlens_q,
    scale=None,
    *,
    sliding_window=None,
    logits_soft_cap=None,
    k_scale=1.0,
    v_scale=1.0,
):
    """Causal attention of each sequence's last ``q_len`` positions over its cache.

    Query ``i`` of sequence ``b`` sits at position ``p = seq_lens[b] - q_len + i``
    and attends to positions ``0..p``, or ``p - sliding_window < j <= p`` with a
    window. Keys and values are the cache's values times ``k_scale`` /
    ``v_scale``; scores ``scale * q . k``, then ``c * tanh(s / c)`` with a soft cap
    c. Sequences with no keys give zeros. Returns float64 ``[T, Hq, D]``.
    """
    q = _f64(q)
    k_cache, v_cache = _f64(k_cache) * k_scale, _f64(v_cache) * v_scale
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
        if logits_soft_cap is not None:
            scores = logits_soft_cap * np.tanh(scores / logits_soft_cap)
        pos = n - q_len + np.arange(q_len)
        mask = np.arange(n)[None, :] <= pos[:, None]  # [q_len, n]
        if sliding_window is not None:  # (a window over n keys is all of them, and fits int64)
            mask &= np.arange(n)[None, :] > pos[:, None] - min(sliding_window, n + 1)
        scores = np.where(mask[None], scores, -np.inf)
        row_has_keys = mask.any(axis=1)  # pos < 0 when seq_len < q_len
        scores = np.where(row_has_keys[None, :, None], scores, 0.0)
        scores -= scores.max(axis=-1, keepdims=True)
        p = np.exp(scores)
        p = np.where(row_has_keys[None, :, None], p / p.sum(axis=-1, keepdims=True), 0.0)
        out[q0:q1] = np.matmul(p, v.transpose(1, 0, 2)).transpose(1, 0, 2)
    return out


def paged_decode_reference(q, k_cache, v_cache, block_tables, seq_lens, scale=None, **options):
    """Decode: one query per sequence, at the sequence's last position (options as above)."""
    b = len(_i64(seq_lens))
    return paged_attention_reference(q, k_cache, v_cache, block_tables, seq_lens, np.arange(b + 1), scale, **options)


paged_prefill_reference = paged_attention_reference


def write_kv_reference(key, value, k_cache, v_cache, slot_mapping, *, k_scale=1.0, v_scale=1.0):
    """Returns float64 copies of the caches (their stored values) after writing ``key``/``value`` by slot.

    A negative slot is padding and skipped; for duplicate slots the last
    token wins (the kernels leave duplicates undefined, so tests avoid them).
    An fp8 cache stores ``fp8_e4m3_encode(x, scale)``.
    """
    k, v = _f64(k_cache).copy(), _f64(v_cache).copy()
    if str(getattr(k_cache, "dtype", "")) == "torch.float8_e4m3fn":
        key, value = fp8_e4m3_encode(key, k_scale), fp8_e4m3_encode(value, v_scale)
    else:
        key, value = _f64(key), _f64(value)
    slots = _i64(slot_mapping)
    bs = k.shape[2]
    for i, s in enumerate(slots):
        if s < 0:
            continue
        k[s // bs, :, s % bs, :] = key[i]
        v[s // bs, :, s % bs, :] = value[i]
    return k, v
