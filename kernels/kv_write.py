"""Public KV write (reshape-and-cache): new tokens' K/V rows into the pool by slot.

``slot = block_id * block_size + offset``; a negative slot is padding and is
skipped. Run it before attention for the same step (prefill attention reads
the new tokens from the pool). Duplicate slots in one call are a caller error
(the copies run in parallel; which one lands is unspecified).

An fp8 cache (float8_e4m3fn) takes key/value in float16, bfloat16 or float32
and stores each element quantized with its scale:
``clamp(x / scale, -448, 448).to(float8_e4m3fn)`` (the division in float32,
the conversion rounding to nearest even), so that attention with the same
``k_scale``/``v_scale`` reads ``stored * scale``. Other caches take their own
dtype, copied bit for bit, and the scales must be 1.0.
"""

from __future__ import annotations

import numpy as np
import torch

from ._validate import FP8, FP8_MAX, check_write_kv
from .attention import cache_bytes
from .cpu_write_kv import copy_rows

__all__ = ["write_kv"]


def write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """``key``/``value [T, Hkv, D]`` → ``k_cache``/``v_cache`` in place.

    key/value have the cache's dtype, or float16 / bfloat16 / float32 for an fp8
    cache, which stores ``clamp(x / scale, -448, 448)`` in float8_e4m3fn with
    ``k_scale`` for keys and ``v_scale`` for values (finite, > 0; 1.0 for any
    other cache).
    """
    geo = check_write_kv(key, value, k_cache, v_cache, slot_mapping, k_scale=k_scale, v_scale=v_scale)
    if geo.dtype == FP8:
        key, value = quantize_fp8(key, k_scale), quantize_fp8(value, v_scale)
    if geo.device.type == "cuda":
        from . import cuda_write_kv

        if geo.dtype == FP8:  # the CUDA copy moves bytes: give it byte views
            key, value, k_cache, v_cache = (x.view(torch.uint8) for x in (key, value, k_cache, v_cache))
        cuda_write_kv.write_kv(geo, key, value, k_cache, v_cache, slot_mapping)
        return
    if geo.device.type != "cpu":
        raise ValueError(f"write_kv runs on CPU or CUDA tensors; got device {geo.device}")
    slots = slot_mapping.numpy()
    num_slots = geo.num_blocks * geo.block_size
    if slots.size and slots.max() >= num_slots:
        raise ValueError(f"slot_mapping max {int(slots.max())} is past the pool's last slot {num_slots - 1}")
    es = key.element_size()
    row_bytes = geo.head_dim * es
    t = key.shape[0]
    k_rows = key.detach().contiguous().view(torch.uint8).reshape(t, -1).numpy()
    v_rows = value.detach().contiguous().view(torch.uint8).reshape(t, -1).numpy()
    block_elems = geo.num_kv_heads * geo.block_size * geo.head_dim
    k_bytes = cache_bytes(k_cache, geo.k_block_stride, block_elems)
    v_bytes = cache_bytes(v_cache, geo.v_block_stride, block_elems)
    copy_rows(
        k_rows, v_rows, k_bytes, v_bytes, np.ascontiguousarray(slots), geo.block_size,
        geo.k_block_stride * es, geo.v_block_stride * es, geo.num_kv_heads, row_bytes,
    )  # fmt: skip


def quantize_fp8(x: torch.Tensor, scale: float) -> torch.Tensor:
    """``clamp(x / scale, -448, 448)`` as float8_e4m3fn, computed on x's device.

    The clamp keeps out-of-range values at the largest finite code rather than NaN
    (e4m3fn has no infinity). Only device ops with ``scale`` as a Python number:
    no host sync, so it can be captured in a CUDA graph.
    """
    return (x.float() / scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8)
