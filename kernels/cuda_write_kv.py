"""Host side of the GPU KV write: one launch, one CTA per token, 16-byte copies.

The kernel never reads the slot mapping on the host (no sync, graph-safe);
negative slots are padding and slots past the pool's end are skipped on the
device instead of corrupting memory (the CPU path raises for those).
"""

from __future__ import annotations

import numpy as np
import torch

from ._validate import CacheGeometry
from .cuda_runtime import ptr


def write_kv(
    geo: CacheGeometry,
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    launcher=None,
) -> None:
    es = key.element_size()
    row_bytes = geo.head_dim * es
    for name, v in (
        ("head_dim * element_size", row_bytes),
        ("key.data_ptr()", key.data_ptr()),
        ("value.data_ptr()", value.data_ptr()),
        ("key.stride(0) in bytes", key.stride(0) * es),
        ("key.stride(1) in bytes", key.stride(1) * es),
        ("value.stride(0) in bytes", value.stride(0) * es),
        ("value.stride(1) in bytes", value.stride(1) * es),
        ("k_cache.data_ptr()", k_cache.data_ptr()),
        ("v_cache.data_ptr()", v_cache.data_ptr()),
        ("k_cache.stride(0) in bytes", geo.k_block_stride * es),
        ("v_cache.stride(0) in bytes", geo.v_block_stride * es),
    ):
        if v % 16:
            raise ValueError(f"{name} = {v} must be a multiple of 16 for the GPU KV write")
    num_tokens = key.shape[0]
    if num_tokens == 0:
        return
    if launcher is None:
        from .cuda_runtime import default_launcher

        launcher = default_launcher()
    args = (
        ptr(key), np.int64(key.stride(0) * es), np.int64(key.stride(1) * es),
        ptr(value), np.int64(value.stride(0) * es), np.int64(value.stride(1) * es),
        ptr(k_cache), ptr(v_cache), np.int64(geo.k_block_stride * es), np.int64(geo.v_block_stride * es),
        ptr(slot_mapping), np.int32(geo.num_kv_heads), np.int32(geo.block_size), np.int32(row_bytes),
        np.int64(geo.num_blocks * geo.block_size),
    )  # fmt: skip
    launcher.launch(("write_kv",), "write_kv", key.device, (num_tokens, 1, 1), args, 0)
