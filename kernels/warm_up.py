"""Compile the CPU kernels before they are first needed.

Numba compiles a kernel at its first call (or loads it from its cache) while holding the
GIL: in a model process that is attached to kvpoold, the client's heartbeat thread cannot
run meanwhile, and on a loaded machine a first forward can outlast the session's lease.
Compiling them before attaching keeps that first call short.  Every dtype shares one
specialization (the kernels take raw bytes), so one call of each compiles everything.
"""

from __future__ import annotations

import numpy as np
import torch

from .attention import paged_decode_attention, paged_prefill_attention
from .cpu_write_kv import PARALLEL_LAUNCH, write_kv_cpu
from .kv_write import write_kv


def warm_up_cpu_kernels() -> None:
    """Run each CPU kernel once on a one-block cache (float32 and float8, decode and prefill)."""
    _compile_parallel_write_kv()
    for dtype in (torch.float32, torch.float8_e4m3fn):
        kv = torch.zeros(1, 2, 1, 16, 16, dtype=dtype)  # [blocks, k|v, heads, block_size, head_dim]
        k_cache, v_cache = kv[:, 0], kv[:, 1]
        new = torch.zeros(2, 1, 16)
        write_kv(new, new, k_cache, v_cache, torch.tensor([0, 1]))
        q = torch.zeros(2, 1, 16)
        table, lens = torch.zeros(1, 1, dtype=torch.int32), torch.tensor([2], dtype=torch.int32)
        paged_prefill_attention(q, k_cache, v_cache, table, lens, torch.tensor([0, 2], dtype=torch.int32))
        paged_decode_attention(q[:1], k_cache, v_cache, table, lens)


def _compile_parallel_write_kv() -> None:
    """``write_kv``'s parallel copy, which its calls take from ``PARALLEL_MIN_BYTES`` on (the ones below are serial)."""
    rows, cache = np.zeros((1, 16), np.uint8), np.zeros(16, np.uint8)
    with PARALLEL_LAUNCH:
        write_kv_cpu(rows, rows, cache, cache, np.zeros(1, np.int64), 1, 16, 16, 1, 16)
