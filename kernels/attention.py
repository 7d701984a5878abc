"""Public paged-attention entry points: check arguments, then run on the tensors' device.

CPU tensors go to the Numba kernel (``cpu_attention``), CUDA tensors to the
tensor-core CUDA kernel (``cuda_attention``, imported lazily so that the CPU
path never imports CuPy). Both compute the same thing; ``reference`` is the
float64 definition they are tested against:

    query i of sequence b sits at position p = seq_lens[b] - q_len_b + i and
    attends to the keys j of its sequence (read through block_tables[b]) with
    p - sliding_window < j <= p (0 <= j <= p without a window; the window
    counts the query's own key, as transformers' kv_idx > q_idx - window):

        k_j = stored_k_j * k_scale,  v_j = stored_v_j * v_scale
        s_j = scale * (q . k_j);  s_j = c * tanh(s_j / c) with logits_soft_cap c
        out = sum_j softmax(s)_j v_j   (softmax and accumulation in fp32)

Caches are float16, bfloat16, float32 or float8_e4m3fn. With an fp8 cache q
(and out) may be float16, bfloat16 or float32 and the scales dequantize it;
otherwise q has the cache's dtype and the scales are 1.0.

Rows with no key (seq_len 0, or p < 0 when seq_len < q_len) produce zeros.
Validation that needs the *values* of the index tensors (block ids within
the pool, lengths within the block table, cu_seqlens consistent) is done on
the CPU path, where it is free; the GPU path never reads device memory on the
host (that would synchronize and break CUDA-graph capture) and instead treats
out-of-range block ids as empty blocks and clamps lengths to the table.
"""

from __future__ import annotations

import functools

import numpy as np
import torch

from . import cpu_attention, cpu_work
from ._numba_compat import PARALLEL_LAUNCH
from ._validate import FP8, AttentionArgs, check_attention, check_length_bounds

__all__ = ["paged_decode_attention", "paged_prefill_attention"]


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    scale: float | None = None,
    out: torch.Tensor | None = None,
    max_seq_len: int | None = None,
    min_seq_len: int | None = None,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """One decode step: ``q [B, Hq, D]`` attends to each sequence's cached keys.

    ``k_cache``/``v_cache``: one layer of the pool, ``[num_blocks, Hkv, block_size,
    D]`` (the strided ``kv_cache[:, layer, 0|1]`` views are fine). ``block_tables``
    int32 ``[B, max_blocks]`` (entries past a sequence's blocks are ignored),
    ``seq_lens`` int32 ``[B]`` (tokens already in the cache, the query's own
    included). ``scale`` defaults to ``1/sqrt(D)``. ``max_seq_len`` is an
    optional upper bound on ``seq_lens`` that lets the GPU size its split-KV
    for the lengths actually in use rather than the table's capacity.
    ``min_seq_len``, an optional lower bound, tells the GPU planner how even the
    batch is: within 1/8 of ``max_seq_len`` it runs a fixed (sequence x split) grid,
    otherwise it divides the work by the lengths on the device. Bounds that the
    lengths do not keep cost speed, never correctness. Returns ``out [B, Hq, D]``
    in q's dtype.

    ``sliding_window`` W: the query at position p sees keys p - W < j <= p (its own
    key counts; None: all of 0..p). ``logits_soft_cap`` c: each score s becomes
    ``c * tanh(s / c)`` before the softmax (None: no cap). ``k_scale``/``v_scale``:
    an fp8 cache (float8_e4m3fn) holds K / k_scale and V / v_scale (as ``write_kv``
    stores them); the kernel attends to the dequantized ``stored * scale``. With an
    fp8 cache q is float16, bfloat16 or float32 (out has q's dtype); otherwise q has
    the cache's dtype and both scales must be 1.0.
    """
    a = check_attention(
        q, k_cache, v_cache, block_tables, seq_lens, None, scale, out,
        sliding_window=sliding_window, logits_soft_cap=logits_soft_cap, k_scale=k_scale, v_scale=v_scale,
    )  # fmt: skip
    bounds = check_length_bounds(max_seq_len, min_seq_len)
    return _dispatch(a, q, k_cache, v_cache, block_tables, seq_lens, None, *bounds)


def paged_prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    *,
    scale: float | None = None,
    out: torch.Tensor | None = None,
    max_seq_len: int | None = None,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """Prefill / chunked-prefill / extend: packed ``q [T, Hq, D]``, causal.

    Sequence ``b``'s queries are ``q[cu_seqlens_q[b]:cu_seqlens_q[b+1]]``: its
    last ``q_len`` positions, whose K/V are already in the pool (``write_kv``
    first). ``seq_lens[b]`` counts all its cached tokens, new ones included.
    The other arguments are those of ``paged_decode_attention``; a sliding window
    applies to each query at its own position.
    """
    a = check_attention(
        q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, scale, out,
        sliding_window=sliding_window, logits_soft_cap=logits_soft_cap, k_scale=k_scale, v_scale=v_scale,
    )  # fmt: skip
    max_seq_len, _ = check_length_bounds(max_seq_len)
    return _dispatch(a, q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, max_seq_len)


def _dispatch(a: AttentionArgs, q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, max_seq_len,
              min_seq_len=None):
    device = a.geo.device
    if device.type == "cuda":
        from . import cuda_attention

        return cuda_attention.paged_attention(
            a, q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, max_seq_len=max_seq_len,
            min_seq_len=min_seq_len,
        )
    if device.type != "cpu":
        raise ValueError(f"paged attention runs on CPU or CUDA tensors; got device {device}")
    return _cpu(a, q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q)


_MODES = {
    torch.float32: cpu_attention.MODE_F32,
    torch.float16: cpu_attention.MODE_F16,
    torch.bfloat16: cpu_attention.MODE_BF16,
    FP8: cpu_attention.MODE_FP8,
}


def storage_as_numpy(t: torch.Tensor) -> np.ndarray:
    """A NumPy view of a contiguous q as the CPU kernel takes it: float32 stays float32;
    float16 and bfloat16 come as raw uint16 bits (NumPy has no bfloat16 and Numba no
    float16), converted inside the kernel."""
    if t.dtype == torch.float32:
        return t.numpy()
    return t.view(torch.int16).numpy().view(np.uint16)


@functools.lru_cache(maxsize=1)
def fp8_values() -> np.ndarray:
    """float32 value of each of the 256 float8_e4m3fn codes (exact; 0x7F and 0xFF are NaN)."""
    return torch.arange(256, dtype=torch.int32).to(torch.uint8).view(FP8).float().numpy()


def cache_bytes(cache: torch.Tensor, block_stride: int, block_elems: int) -> np.ndarray:
    """A flat uint8 NumPy view of one layer's cache from block 0 to the end of the last block."""
    span = (cache.shape[0] - 1) * block_stride + block_elems
    return torch.as_strided(cache.detach(), (span,), (1,)).view(torch.uint8).numpy()


def _cpu(a: AttentionArgs, q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q) -> torch.Tensor:
    geo = a.geo
    tables = np.ascontiguousarray(block_tables.numpy())
    lens = seq_lens.numpy()
    if cu_seqlens_q is None:
        cu = np.arange(a.num_seqs + 1, dtype=np.int32)
    else:
        cu = np.ascontiguousarray(cu_seqlens_q.numpy())
    _check_index_values(geo, tables, lens, cu, a.num_tokens)

    block_elems = geo.num_kv_heads * geo.block_size * geo.head_dim
    k_bytes = cache_bytes(k_cache, geo.k_block_stride, block_elems)
    v_bytes = cache_bytes(v_cache, geo.v_block_stride, block_elems)

    q_mode = _MODES[q.dtype]
    qn = storage_as_numpy(q.detach().contiguous())
    no16, no32 = np.zeros((0, 0, 0), np.uint16), np.zeros((0, 0, 0), np.float32)
    q16, q32 = (no16, qn) if q_mode == cpu_attention.MODE_F32 else (qn, no32)
    out = a.out
    direct = out.dtype == torch.float32  # out is contiguous (checked): write into it
    out32 = out.detach().numpy() if direct else np.empty(out.shape, np.float32)
    decode = cu_seqlens_q is None
    q_tile = 1 if decode else cpu_work.q_tile(a.group)
    shared = cpu_work.shared_prefixes(tables, lens, geo.block_size, a.group, geo.num_kv_heads, decode and a.window == 0)
    own_keys = lens - shared.prefix_keys if shared.prefix_keys.size else lens
    items = cpu_work.work_items(cu, geo.num_kv_heads, q_tile, own_keys, window=a.window)
    rows = (a.num_tokens, a.num_q_heads) if shared.prefix_keys.size else (0, 0)
    with PARALLEL_LAUNCH:
        cpu_attention.paged_attention_cpu(
            q16, q32, q_mode, k_bytes, v_bytes, _MODES[geo.dtype], fp8_values(), geo.k_block_stride,
            geo.v_block_stride, geo.num_kv_heads, geo.block_size, tables, lens, cu, items,
            np.float32(a.scale * a.k_scale), _soft_cap_f32(a.soft_cap), np.int64(a.window), np.float32(a.v_scale),
            out32, shared.items, shared.members, shared.prefix_keys, np.empty(rows, np.float32),
            np.empty(rows, np.float32), np.empty((*rows, geo.head_dim), np.float32),
        )  # fmt: skip
    if not direct:
        out.copy_(torch.from_numpy(out32))
    return out


def _soft_cap_f32(cap: float) -> np.float32:
    """The cap as the kernel's float32: beyond float32's range ``c * tanh(s / c)`` equals s for
    every float32 score (no cap, 0); below its smallest normal value it is the same as that
    value (every score about 0: a uniform softmax)."""
    f32 = np.finfo(np.float32)
    if cap == 0.0 or cap > float(f32.max):
        return np.float32(0.0)
    return np.float32(max(cap, float(f32.tiny)))


def _check_index_values(geo, tables: np.ndarray, lens: np.ndarray, cu: np.ndarray, num_tokens: int) -> None:
    """Value checks the CPU path can afford: the kernel would read out of bounds otherwise."""
    if lens.size and lens.min() < 0:
        raise ValueError(f"seq_lens must be >= 0; got min {int(lens.min())}")
    capacity = tables.shape[1] * geo.block_size
    if lens.size and lens.max() > capacity:
        raise ValueError(f"seq_lens max {int(lens.max())} exceeds the block table's capacity {capacity}")
    if cu[0] != 0 or np.any(np.diff(cu) < 0) or cu[-1] != num_tokens:
        raise ValueError(f"cu_seqlens_q must start at 0, not decrease, and end at T={num_tokens}; got {cu.tolist()}")
    needed = (lens.astype(np.int64) + geo.block_size - 1) // geo.block_size
    used = tables[np.arange(tables.shape[1])[None, :] < needed[:, None]]
    if used.size and (used.min() < 0 or used.max() >= geo.num_blocks):
        raise ValueError(
            f"block_tables entries in use must be in [0, {geo.num_blocks}); "
            f"got range [{int(used.min())}, {int(used.max())}]"
        )
