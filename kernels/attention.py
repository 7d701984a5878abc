"""Public paged-attention entry points: check arguments, then run on the tensors' device.

CPU tensors go to the Numba kernel (``cpu_attention``), CUDA tensors to the
tensor-core CUDA kernel (``cuda_attention``, imported lazily so that the CPU
path never imports CuPy). Both compute the same thing; ``reference`` is the
float64 definition they are tested against:

    query i of sequence b sits at position p = seq_lens[b] - q_len_b + i and
    attends (softmax(scale * q . k) v, fp32 accumulation) to the keys at
    positions 0..p of its sequence, read through block_tables[b].

Rows with no key (seq_len 0, or p < 0 when seq_len < q_len) produce zeros.
Validation that needs the *values* of the index tensors (block ids within
the pool, lengths within the block table, cu_seqlens consistent) is done on
the CPU path, where it is free; the GPU path never reads device memory on the
host (that would synchronize and break CUDA-graph capture) and instead treats
out-of-range block ids as empty blocks and clamps lengths to the table.
"""

from __future__ import annotations

import numpy as np
import torch

from . import cpu_attention
from ._validate import AttentionArgs, check_attention

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
) -> torch.Tensor:
    """One decode step: ``q [B, Hq, D]`` attends to each sequence's cached keys.

    ``k_cache``/``v_cache``: one layer of the pool, ``[num_blocks, Hkv, block_size,
    D]`` (the strided ``kv_cache[:, layer, 0|1]`` views are fine). ``block_tables``
    int32 ``[B, max_blocks]`` (entries past a sequence's blocks are ignored),
    ``seq_lens`` int32 ``[B]`` (tokens already in the cache, the query's own
    included). ``scale`` defaults to ``1/sqrt(D)``. ``max_seq_len`` is an
    optional upper bound on ``seq_lens`` that lets the GPU size its split-KV
    for the lengths actually in use rather than the table's capacity.
    Returns ``out [B, Hq, D]`` in q's dtype.
    """
    a = check_attention(q, k_cache, v_cache, block_tables, seq_lens, None, scale, out)
    return _dispatch(a, q, k_cache, v_cache, block_tables, seq_lens, None, max_seq_len)


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
) -> torch.Tensor:
    """Prefill / chunked-prefill / extend: packed ``q [T, Hq, D]``, causal.

    Sequence ``b``'s queries are ``q[cu_seqlens_q[b]:cu_seqlens_q[b+1]]``: its
    last ``q_len`` positions, whose K/V are already in the pool (``write_kv``
    first). ``seq_lens[b]`` counts all its cached tokens, new ones included.
    """
    a = check_attention(q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, scale, out)
    return _dispatch(a, q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, max_seq_len)


def _dispatch(a: AttentionArgs, q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, max_seq_len):
    device = a.geo.device
    if device.type == "cuda":
        from . import cuda_attention

        return cuda_attention.paged_attention(
            a, q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, max_seq_len=max_seq_len
        )
    if device.type != "cpu":
        raise ValueError(f"paged attention runs on CPU or CUDA tensors; got device {device}")
    return _cpu(a, q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q)


def storage_as_numpy(t: torch.Tensor) -> np.ndarray:
    """A NumPy view of a contiguous tensor as the CPU kernel takes it: float32 stays
    float32; float16 and bfloat16 come as raw uint16 bits (NumPy has no bfloat16 and
    Numba no float16), converted inside the kernel."""
    if t.dtype == torch.float32:
        return t.numpy()
    return t.view(torch.int16).numpy().view(np.uint16)


def cache_as_numpy(cache: torch.Tensor, block_stride: int, block_elems: int) -> np.ndarray:
    """A flat NumPy view (``storage_as_numpy``) of one layer's cache from block 0 to the
    end of the last block."""
    span = (cache.shape[0] - 1) * block_stride + block_elems
    return storage_as_numpy(torch.as_strided(cache.detach(), (span,), (1,)))


def _cpu(a: AttentionArgs, q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q) -> torch.Tensor:
    geo = a.geo
    tables = np.ascontiguousarray(block_tables.numpy())
    lens = seq_lens.numpy()
    if cu_seqlens_q is None:
        cu = np.arange(a.num_seqs + 1, dtype=np.int32)
    else:
        cu = np.ascontiguousarray(cu_seqlens_q.numpy())
    _check_index_values(geo, tables, lens, cu, a.num_tokens)

    mode = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}[geo.dtype]
    block_elems = geo.num_kv_heads * geo.block_size * geo.head_dim
    kc = cache_as_numpy(k_cache, geo.k_block_stride, block_elems)
    vc = cache_as_numpy(v_cache, geo.v_block_stride, block_elems)
    empty16, empty32 = np.zeros(0, np.uint16), np.zeros(0, np.float32)
    k16, k32 = (empty16, kc) if mode == 0 else (kc, empty32)
    v16, v32 = (empty16, vc) if mode == 0 else (vc, empty32)

    qn = storage_as_numpy(q.detach().contiguous())  # q has the cache's dtype (checked): passed the same way
    no16, no32 = np.zeros((0, 0, 0), np.uint16), np.zeros((0, 0, 0), np.float32)
    q16, q32 = (no16, qn) if mode == 0 else (qn, no32)
    out = a.out
    direct = out.dtype == torch.float32  # out is contiguous (checked): write into it
    out32 = out.detach().numpy() if direct else np.empty(out.shape, np.float32)
    q_tile = 1 if cu_seqlens_q is None else cpu_attention.q_tile(a.group)
    items = cpu_attention.work_items(cu, geo.num_kv_heads, q_tile, lens)
    cpu_attention.paged_attention_cpu(
        q16, q32, k16, k32, v16, v32, mode, geo.k_block_stride, geo.v_block_stride,
        geo.num_kv_heads, geo.block_size, tables, lens, cu, items, np.float32(a.scale), out32,
    )  # fmt: skip
    if not direct:
        out.copy_(torch.from_numpy(out32))
    return out


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
