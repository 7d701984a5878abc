"""Argument checks shared by the public wrappers.

The kernels index raw memory with the strides we hand them, so a wrong
shape, dtype or stride does not fail loudly inside a kernel: it reads or
writes the wrong bytes. Every public entry point therefore checks its
arguments here first and raises ``TypeError`` (wrong kind or dtype) or
``ValueError`` (wrong shape, stride, device or value) naming the argument,
what was expected and what was given. None of these checks reads device
memory, so they never synchronize a CUDA stream.

Caches are float16, bfloat16, float32 or float8_e4m3fn. An fp8 cache holds
``x / scale`` (per layer and K|V, ``k_scale`` / ``v_scale``); its queries,
outputs and written keys/values are float16, bfloat16 or float32, and a
scale other than 1.0 is refused on any other cache, where it would be
meaningless.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import torch

from kvpool.protocol.layout import KV_DTYPE_ITEMSIZE

FP8 = torch.float8_e4m3fn
COMPUTE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
#: the dtypes a layout may name are exactly those the kernels take: one table, the protocol's
CACHE_DTYPES = tuple(getattr(torch, name) for name in KV_DTYPE_ITEMSIZE)
FP8_MAX = 448.0  # the largest finite float8_e4m3fn; write_kv clamps to +-FP8_MAX
INT32_MAX = 2**31 - 1


@dataclass(frozen=True)
class CacheGeometry:
    """What the kernels need to know about one layer's K and V caches.

    ``*_block_stride`` is in elements: the distance between block ``i`` and
    ``i + 1`` along axis 0, which for a per-layer view of the pool is the
    whole multi-layer block, not ``num_kv_heads * block_size * head_dim``.
    """

    num_blocks: int
    num_kv_heads: int
    block_size: int
    head_dim: int
    k_block_stride: int
    v_block_stride: int
    dtype: torch.dtype
    device: torch.device


def _describe(x: object) -> str:
    if isinstance(x, torch.Tensor):
        return f"tensor(shape={tuple(x.shape)}, dtype={x.dtype}, device={x.device})"
    return type(x).__name__


def require_tensor(name: str, x: object, ndim: int) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {_describe(x)}")
    if x.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {tuple(x.shape)}")
    return x


def require_dtype(name: str, x: torch.Tensor, dtypes: tuple[torch.dtype, ...]) -> None:
    if x.dtype not in dtypes:
        allowed = ", ".join(str(d) for d in dtypes)
        raise TypeError(f"{name} must have dtype {allowed}; got {x.dtype}")


def require_device(name: str, x: torch.Tensor, device: torch.device) -> None:
    if x.device != device:
        raise ValueError(f"{name} is on {x.device} but the KV cache is on {device}")


def require_contiguous_1d(name: str, x: torch.Tensor) -> None:
    if x.shape[0] > 1 and x.stride(0) != 1:
        raise ValueError(f"{name} must be contiguous; got stride {x.stride(0)}")


def check_kv_cache(k_cache: object, v_cache: object) -> CacheGeometry:
    """Check one layer's ``[num_blocks, num_kv_heads, block_size, head_dim]`` views."""
    k = require_tensor("k_cache", k_cache, 4)
    v = require_tensor("v_cache", v_cache, 4)
    require_dtype("k_cache", k, CACHE_DTYPES)
    if v.dtype != k.dtype:
        raise TypeError(f"v_cache dtype {v.dtype} differs from k_cache dtype {k.dtype}")
    if v.shape != k.shape:
        raise ValueError(f"v_cache shape {tuple(v.shape)} differs from k_cache shape {tuple(k.shape)}")
    require_device("v_cache", v, k.device)
    n, h, bs, d = k.shape
    if n < 1 or h < 1 or bs < 1 or d < 1:
        raise ValueError(f"k_cache has an empty dimension: shape {tuple(k.shape)}")
    inner = (bs * d, d, 1)
    for name, x in (("k_cache", k), ("v_cache", v)):
        if tuple(x.stride()[1:]) != inner:
            raise ValueError(
                f"{name} must be contiguous inside a block (strides {inner} for the last "
                f"three axes, head-major [head][token][dim]); got strides {tuple(x.stride())}"
            )
        if n > 1 and x.stride(0) < h * bs * d:
            raise ValueError(
                f"{name} blocks overlap: axis-0 stride {x.stride(0)} < one block's "
                f"{h * bs * d} elements"
            )
    return CacheGeometry(n, h, bs, d, k.stride(0), v.stride(0), k.dtype, k.device)


@dataclass(frozen=True)
class AttentionArgs:
    """Checked attention arguments plus the derived sizes the launchers use."""

    geo: CacheGeometry
    num_seqs: int
    num_tokens: int
    num_q_heads: int
    group: int
    scale: float
    out: torch.Tensor
    window: int = 0  # sliding window in keys, the query's own included; 0: no window
    soft_cap: float = 0.0  # logits soft cap c (s -> c * tanh(s / c)); 0.0: none
    k_scale: float = 1.0  # dequantized key = stored key * k_scale (1.0 unless the cache is fp8)
    v_scale: float = 1.0  # dequantized value = stored value * v_scale


def check_attention(
    q: object,
    k_cache: object,
    v_cache: object,
    block_tables: object,
    seq_lens: object,
    cu_seqlens_q: object | None,
    scale: float | None,
    out: object | None,
    *,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> AttentionArgs:
    """Checks for both decode (``cu_seqlens_q is None``) and prefill."""
    geo = check_kv_cache(k_cache, v_cache)
    q = require_tensor("q", q, 3)
    require_compute_dtype("q", q, geo)
    require_device("q", q, geo.device)
    t, hq, d = q.shape
    if d != geo.head_dim:
        raise ValueError(f"q head_dim {d} differs from the cache head_dim {geo.head_dim}")
    if hq < 1 or hq % geo.num_kv_heads:
        raise ValueError(
            f"q has {hq} heads, which is not a positive multiple of the cache's "
            f"{geo.num_kv_heads} KV heads (GQA needs num_q_heads = group * num_kv_heads)"
        )
    if q.stride(2) != 1:
        raise ValueError(f"q must be contiguous along head_dim (stride 1); got strides {tuple(q.stride())}")

    bt = require_tensor("block_tables", block_tables, 2)
    require_dtype("block_tables", bt, (torch.int32,))
    require_device("block_tables", bt, geo.device)
    if bt.stride(1) != 1 and bt.shape[1] > 1:
        raise ValueError(f"block_tables rows must be contiguous; got strides {tuple(bt.stride())}")
    b = bt.shape[0]
    if bt.shape[1] < 1:
        raise ValueError("block_tables must have at least one column (max_blocks >= 1)")

    sl = require_tensor("seq_lens", seq_lens, 1)
    require_dtype("seq_lens", sl, (torch.int32,))
    require_device("seq_lens", sl, geo.device)
    require_contiguous_1d("seq_lens", sl)
    if sl.shape[0] != b:
        raise ValueError(f"seq_lens has {sl.shape[0]} entries but block_tables has {b} rows")

    if cu_seqlens_q is None:
        if t != b:
            raise ValueError(f"decode takes one query per sequence: q has {t} rows, block_tables {b}")
    else:
        cu = require_tensor("cu_seqlens_q", cu_seqlens_q, 1)
        require_dtype("cu_seqlens_q", cu, (torch.int32,))
        require_device("cu_seqlens_q", cu, geo.device)
        require_contiguous_1d("cu_seqlens_q", cu)
        if cu.shape[0] != b + 1:
            raise ValueError(f"cu_seqlens_q must have num_seqs + 1 = {b + 1} entries; got {cu.shape[0]}")

    if scale is None:
        scale = 1.0 / math.sqrt(d)
    elif not isinstance(scale, (int, float)) or not math.isfinite(scale):
        raise TypeError(f"scale must be a finite float or None; got {scale!r}")

    if out is None:
        out = torch.empty((t, hq, d), dtype=q.dtype, device=q.device)
    else:
        out = require_tensor("out", out, 3)
        if out.dtype != q.dtype:
            raise TypeError(f"out dtype {out.dtype} must match q dtype {q.dtype}")
        require_device("out", out, geo.device)
        if tuple(out.shape) != (t, hq, d):
            raise ValueError(f"out must have shape {(t, hq, d)}; got {tuple(out.shape)}")
        if not out.is_contiguous():
            raise ValueError(f"out must be contiguous; got strides {tuple(out.stride())}")
    window = check_sliding_window(sliding_window)
    soft_cap = check_soft_cap(logits_soft_cap)
    k_scale, v_scale = check_kv_scales(geo, k_scale, v_scale)
    return AttentionArgs(
        geo, b, t, hq, hq // geo.num_kv_heads, float(scale), out, window, soft_cap, k_scale, v_scale
    )


def require_compute_dtype(name: str, x: torch.Tensor, geo: CacheGeometry) -> None:
    """q, key and value: the cache's dtype, or any of ``COMPUTE_DTYPES`` for an fp8 cache."""
    if geo.dtype == FP8:
        require_dtype(name, x, COMPUTE_DTYPES)
    elif x.dtype != geo.dtype:
        raise TypeError(f"{name} dtype {x.dtype} must match the KV cache dtype {geo.dtype}")


def _is_int(x: object) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _is_real(x: object) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def check_sliding_window(sliding_window: object) -> int:
    """``None`` → 0 (no window); otherwise an int >= 1 (the query's own key counts).

    A window of 2^31 - 1 keys or more is no window (0): ``seq_lens`` are int32, so
    no query has more keys than that, and the kernels keep the window in 32 bits.
    """
    if sliding_window is None:
        return 0
    if not _is_int(sliding_window):
        raise TypeError(f"sliding_window must be an int >= 1 or None; got {sliding_window!r}")
    if sliding_window < 1:
        raise ValueError(f"sliding_window must be >= 1 (it counts the query's own key); got {sliding_window}")
    return int(sliding_window) if sliding_window < INT32_MAX else 0


def check_soft_cap(logits_soft_cap: object) -> float:
    """``None`` → 0.0 (no cap); otherwise a finite float > 0."""
    if logits_soft_cap is None:
        return 0.0
    if not _is_real(logits_soft_cap):
        raise TypeError(f"logits_soft_cap must be a float > 0 or None; got {logits_soft_cap!r}")
    if not (math.isfinite(logits_soft_cap) and logits_soft_cap > 0):
        raise ValueError(f"logits_soft_cap must be finite and > 0; got {logits_soft_cap}")
    return float(logits_soft_cap)


def check_length_bounds(max_seq_len: object, min_seq_len: object = None) -> tuple[int | None, int | None]:
    """The caller's bounds on ``seq_lens``: ints >= 0 (or None), ``min_seq_len <= max_seq_len``."""
    for name, x in (("max_seq_len", max_seq_len), ("min_seq_len", min_seq_len)):
        if x is None:
            continue
        if not _is_int(x):
            raise TypeError(f"{name} must be an int >= 0 or None; got {x!r}")
        if x < 0:
            raise ValueError(f"{name} must be >= 0; got {x}")
    if max_seq_len is not None and min_seq_len is not None and min_seq_len > max_seq_len:
        raise ValueError(f"min_seq_len {min_seq_len} exceeds max_seq_len {max_seq_len}")
    return (None if max_seq_len is None else int(max_seq_len)), (None if min_seq_len is None else int(min_seq_len))


def check_kv_scales(geo: CacheGeometry, k_scale: object, v_scale: object) -> tuple[float, float]:
    """Finite and > 0; other than 1.0 only for an fp8 cache."""
    for name, x in (("k_scale", k_scale), ("v_scale", v_scale)):
        if not _is_real(x):
            raise TypeError(f"{name} must be a float; got {x!r}")
        if not (math.isfinite(x) and x > 0):
            raise ValueError(f"{name} must be finite and > 0; got {x}")
        if x != 1.0 and geo.dtype != FP8:
            raise ValueError(
                f"{name} = {x} needs a float8_e4m3fn cache; a {geo.dtype} cache holds the "
                f"values themselves, so {name} must be 1.0"
            )
    return float(k_scale), float(v_scale)


def check_write_kv(
    key: object,
    value: object,
    k_cache: object,
    v_cache: object,
    slot_mapping: object,
    *,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> CacheGeometry:
    geo = check_kv_cache(k_cache, v_cache)
    shape = None
    for name, x in (("key", key), ("value", value)):
        x = require_tensor(name, x, 3)
        require_compute_dtype(name, x, geo)
        require_device(name, x, geo.device)
        if x.shape[1:] != (geo.num_kv_heads, geo.head_dim):
            raise ValueError(
                f"{name} must have shape [T, {geo.num_kv_heads}, {geo.head_dim}] "
                f"(num_kv_heads, head_dim of the cache); got {tuple(x.shape)}"
            )
        if x.stride(2) != 1:
            raise ValueError(f"{name} must be contiguous along head_dim; got strides {tuple(x.stride())}")
        if shape is not None and x.shape != shape:
            raise ValueError(f"value shape {tuple(x.shape)} differs from key shape {tuple(shape)}")
        shape = x.shape
    sm = require_tensor("slot_mapping", slot_mapping, 1)
    require_dtype("slot_mapping", sm, (torch.int64,))
    require_device("slot_mapping", sm, geo.device)
    require_contiguous_1d("slot_mapping", sm)
    if sm.shape[0] != shape[0]:
        raise ValueError(f"slot_mapping has {sm.shape[0]} entries but key has {shape[0]} tokens")
    check_kv_scales(geo, k_scale, v_scale)
    return geo
