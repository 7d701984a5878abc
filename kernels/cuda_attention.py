"""Host side of the GPU paged attention: plan the grid and split-KV, then launch.

One call is at most two launches whatever the mix of lengths: the attention
kernel over a fixed grid (query tiles x KV heads x splits; a CTA whose split
starts past its sequence's keys exits at once) and, only when the plan has
more than one split, the merge. The plan depends on shapes and on an upper
bound of the sequence lengths (``max_seq_len``, default: what the block
table can hold), never on the *contents* of ``seq_lens``: nothing here reads
device memory, so a call never synchronizes and can be captured in a CUDA
graph. Prefill maps CTAs to (sequence, query tile) through a device-side
prefix sum of tiles per sequence (``tile_cum``), again without a sync.

Split-KV: when (query tiles x KV heads) alone would not fill the GPU, the
key range is cut into ``num_splits`` chunks of ``chunk`` tokens; each CTA
writes a normalized partial output plus its log2-sum-exp and the merge
kernel combines them. That is what keeps a single 128k-token sequence from
running on 8 SMs.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np
import torch

from ._validate import AttentionArgs
from .cuda_runtime import THREADS, ptr
from .cuda_source import NUM_STAGES

TILE = 16  # keys per MMA step; chunks are multiples of it
WARPS = THREADS // 32
CTAS_PER_SM = 3  # what the kernel's registers allow at most
SM_SMEM = 228 * 1024  # shared memory per SM (H100 / H200), 1 KiB of it reserved per CTA
SMEM_LIMIT = 227 * 1024  # per-CTA opt-in maximum on sm_80 / sm_90
_DT_CODE = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
_LOG2E = 1.4426950408889634


@dataclass(frozen=True)
class AttentionPlan:
    dt: int  # 0 float32, 1 float16, 2 bfloat16
    head_dim: int
    warps_kv: int  # warps sharing one row tile (splitting its keys)
    tokens_per_cta: int
    grid: tuple[int, int, int]
    num_splits: int
    chunk: int  # keys per split
    smem_bytes: int
    bs_log2: int


def check_gpu_limits(a: AttentionArgs, q: torch.Tensor) -> None:
    """What the GPU kernel supports beyond the generic checks (clear errors, not bad reads)."""
    geo = a.geo
    if geo.head_dim not in (64, 128, 256):
        raise ValueError(f"GPU paged attention supports head_dim 64, 128, 256; got {geo.head_dim}")
    bs = geo.block_size
    if bs < 8 or bs & (bs - 1):
        raise ValueError(f"GPU paged attention needs a power-of-two block_size >= 8; got {bs}")
    if a.group > 16:
        raise ValueError(f"GPU paged attention supports GQA groups up to 16; got {a.group}")
    es = q.element_size()
    for name, value in (
        ("q.data_ptr()", q.data_ptr()),
        ("q.stride(0) in bytes", q.stride(0) * es),
        ("q.stride(1) in bytes", q.stride(1) * es),
        ("k_cache.stride(0) in bytes", geo.k_block_stride * es),
        ("v_cache.stride(0) in bytes", geo.v_block_stride * es),
    ):
        if value % 16:
            raise ValueError(f"{name} = {value} must be a multiple of 16 (the kernel loads 16 bytes at a time)")


def smem_bytes(dt: int, head_dim: int, rings: int) -> int:
    """Dynamic shared memory: ``rings`` cp.async rings of NUM_STAGES (K, V) tiles,
    reused after the loop by the epilogue's [4 warps][16 rows][D + 1] floats + m, l."""
    stage = 32 * head_dim * (4 if dt == 0 else 2)
    epilogue = (WARPS * 16 * (head_dim + 1) + 2 * WARPS * 16) * 4
    return max(rings * NUM_STAGES * stage, epilogue)


def decode_warps_kv(dt: int, head_dim: int) -> int:
    """Decode gives each warp its own ring (4 key streams per CTA) when shared memory
    allows two CTAs per SM; float32 with head_dim 256 shares rings between warps."""
    for warps_kv in (WARPS, 2, 1):
        if smem_bytes(dt, head_dim, warps_kv) <= SMEM_LIMIT:
            return warps_kv
    raise ValueError(f"head_dim {head_dim} does not fit in shared memory")


@functools.lru_cache(maxsize=4096)
def choose_splits(ctas: int, tiles: int, warps_kv: int, slots: int) -> int:
    """Split count minimizing (waves of CTAs) x (tiles per CTA), the fewest on ties.

    ``slots`` CTAs run at once; a CTA's time grows with its tiles. Splitting
    only pays while it fills idle slots: beyond one wave it adds merge work
    and shortens nothing. Each warp keeps at least one tile.
    """
    best, best_cost = 1, math.inf
    max_s = max(1, min(tiles // warps_kv, 2 * math.ceil(slots / max(ctas, 1)), 256))
    for s in range(1, max_s + 1):
        cost = math.ceil(ctas * s / slots) * math.ceil(tiles / s)
        if cost < best_cost:
            best, best_cost = s, cost
    return best


def plan_attention(
    a: AttentionArgs,
    *,
    prefill: bool,
    max_blocks: int,
    max_seq_len: int | None,
    num_sms: int,
    num_splits: int | None = None,
) -> AttentionPlan:
    """Grid, split-KV and shared memory for one call (pure arithmetic on shapes)."""
    geo = a.geo
    dt = _DT_CODE[geo.dtype]
    warps_kv = 1 if prefill else decode_warps_kv(dt, geo.head_dim)
    smem = smem_bytes(dt, geo.head_dim, warps_kv)
    tokens_per_cta = (16 * (WARPS // warps_kv)) // a.group
    if prefill:
        # sum over sequences of ceil(q_len / tq) <= T // tq + B
        grid_x = a.num_tokens // tokens_per_cta + a.num_seqs
    else:
        grid_x = a.num_seqs
    capacity = max_blocks * geo.block_size
    max_kv = capacity if max_seq_len is None else max(1, min(int(max_seq_len), capacity))
    tiles = max(1, math.ceil(max_kv / TILE))
    if num_splits is None:
        slots = num_sms * min(CTAS_PER_SM, SM_SMEM // (smem + 1024))
        num_splits = choose_splits(grid_x * geo.num_kv_heads, tiles, warps_kv, max(slots, num_sms))
    num_splits = max(1, min(int(num_splits), tiles))
    chunk_tiles = math.ceil(tiles / num_splits)
    num_splits = math.ceil(tiles / chunk_tiles)
    return AttentionPlan(
        dt=dt,
        head_dim=geo.head_dim,
        warps_kv=warps_kv,
        tokens_per_cta=tokens_per_cta,
        grid=(grid_x, geo.num_kv_heads, num_splits),
        num_splits=num_splits,
        chunk=chunk_tiles * TILE,
        smem_bytes=smem,
        bs_log2=geo.block_size.bit_length() - 1,
    )


def paged_attention(
    a: AttentionArgs,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    cu_seqlens_q: torch.Tensor | None,
    *,
    max_seq_len: int | None = None,
    num_splits: int | None = None,
    launcher=None,
) -> torch.Tensor:
    """Decode (``cu_seqlens_q is None``) or prefill on the GPU; returns ``a.out``."""
    check_gpu_limits(a, q)
    if launcher is None:
        from .cuda_runtime import default_launcher

        launcher = default_launcher()
    out = a.out
    if a.num_seqs == 0 or a.num_tokens == 0:
        return out
    prefill = cu_seqlens_q is not None
    plan = plan_attention(
        a,
        prefill=prefill,
        max_blocks=block_tables.shape[1],
        max_seq_len=max_seq_len,
        num_sms=launcher.num_sms(q.device),
        num_splits=num_splits,
    )
    tile_cum = None
    if prefill:
        q_lens = cu_seqlens_q[1:] - cu_seqlens_q[:-1]
        tiles = torch.div(q_lens + (plan.tokens_per_cta - 1), plan.tokens_per_cta, rounding_mode="floor")
        tile_cum = torch.cumsum(tiles, 0).to(torch.int32)
    part_o = part_lse = None
    if plan.num_splits > 1:
        part_o = torch.empty((a.num_tokens, a.num_q_heads, plan.num_splits, plan.head_dim), dtype=torch.float32, device=q.device)
        part_lse = torch.empty((a.num_tokens, a.num_q_heads, plan.num_splits), dtype=torch.float32, device=q.device)
    geo = a.geo
    args = (
        ptr(q), np.int64(q.stride(0)), np.int64(q.stride(1)),
        ptr(k_cache), ptr(v_cache), np.int64(geo.k_block_stride), np.int64(geo.v_block_stride),
        np.int32(geo.num_blocks), np.int32(geo.num_kv_heads), np.int32(plan.bs_log2),
        ptr(block_tables), np.int64(block_tables.stride(0)), np.int32(block_tables.shape[1]),
        ptr(seq_lens), ptr(cu_seqlens_q), ptr(tile_cum),
        np.int32(a.num_seqs), np.int32(a.group), np.float32(a.scale * _LOG2E),
        np.int32(plan.chunk), np.int32(plan.num_splits),
        ptr(out), ptr(part_o), ptr(part_lse),
    )  # fmt: skip
    key = ("attention", plan.dt, plan.head_dim, plan.warps_kv)
    launcher.launch(key, "attention", q.device, plan.grid, args, plan.smem_bytes)
    if plan.num_splits > 1:
        merge_args = (
            ptr(part_o), ptr(part_lse), ptr(out), ptr(seq_lens), ptr(cu_seqlens_q),
            np.int32(a.num_seqs), np.int32(a.num_tokens), np.int32(block_tables.shape[1]), np.int32(plan.bs_log2),
            np.int32(a.num_q_heads), np.int32(plan.num_splits), np.int32(plan.chunk),
        )  # fmt: skip
        rows = a.num_tokens * a.num_q_heads  # one warp each
        launcher.launch(key, "merge", q.device, (math.ceil(rows / WARPS), 1, 1), merge_args, 0)
    return out
