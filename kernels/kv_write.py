"""Public KV write (reshape-and-cache): new tokens' K/V rows into the pool by slot.

``slot = block_id * block_size + offset``; a negative slot is padding and is
skipped. Run it before attention for the same step (prefill attention reads
the new tokens from the pool). Duplicate slots in one call are a caller error
(the copies run in parallel; which one lands is unspecified).
"""

from __future__ import annotations

import numpy as np
import torch

from ._validate import check_write_kv
from .cpu_write_kv import write_kv_cpu

__all__ = ["write_kv"]


def write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """``key``/``value [T, Hkv, D]`` (cache dtype) → ``k_cache``/``v_cache`` in place."""
    geo = check_write_kv(key, value, k_cache, v_cache, slot_mapping)
    if geo.device.type == "cuda":
        from . import cuda_write_kv

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
    block_bytes = geo.num_kv_heads * geo.block_size * row_bytes
    k_bytes = _bytes(k_cache, geo.k_block_stride * es, block_bytes)
    v_bytes = _bytes(v_cache, geo.v_block_stride * es, block_bytes)
    write_kv_cpu(
        k_rows, v_rows, k_bytes, v_bytes, np.ascontiguousarray(slots), geo.block_size,
        geo.k_block_stride * es, geo.v_block_stride * es, geo.num_kv_heads, row_bytes,
    )  # fmt: skip


def _bytes(cache: torch.Tensor, block_stride_bytes: int, block_bytes: int) -> np.ndarray:
    """Flat uint8 view of one layer's cache from block 0 to the end of the last block."""
    es = cache.element_size()
    span = ((cache.shape[0] - 1) * block_stride_bytes + block_bytes) // es
    flat = torch.as_strided(cache.detach(), (span,), (1,))
    return flat.view(torch.uint8).numpy()
