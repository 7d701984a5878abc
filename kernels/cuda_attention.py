"""Host side of the GPU paged attention: plan the grid and split-KV, then launch.

One call is at most two launches whatever the mix of lengths: the attention
kernel over a fixed grid (query tiles x KV heads x splits; a CTA whose split
starts past its sequence's keys exits at once) and, only when the plan has
more than one split and the variant does not fuse the merge, the merge (with
the fused merge, the last split CTA of each tile merges it: one launch). The plan depends on shapes and on an upper
bound of the sequence lengths (``max_seq_len``, default: what the block
table can hold), never on the *contents* of ``seq_lens``: nothing here reads
device memory, so a call never synchronizes and can be captured in a CUDA
graph. Prefill maps CTAs to (sequence, query tile) on the device, again without a sync:
the dedicated prefill kernels scan ``cu_seqlens`` in each CTA; the split-KV kernel is
page-aware (below); only its fixed grid of a forced ``num_splits`` reads a ``tile_cum``
tensor made before the launch.

Split-KV: when (query tiles x KV heads) alone would not fill the GPU, the
key range is cut into ``num_splits`` chunks of ``chunk`` tokens; each CTA
writes a normalized partial output plus its log2-sum-exp, which the merge
(kernel or fused tail) combines. That is what keeps a single 128k-token sequence from
running on 8 SMs.

Decode of two or more sequences is page-aware by default (``work_items``): the grid is a
bound on work items, not (sequences x splits), and each CTA finds its item from the lengths
on the device, so a batch that mixes one long sequence with many short ones gives the long
one many CTAs and each short one exactly one, in one launch that a CUDA graph replays with
new lengths. One sequence has nothing to balance and runs the fixed grid, and so does a batch
whose caller bounds its lengths within 1/8 (``min_seq_len``, ``even_batch``). Prefill on the
split-KV kernel is page-aware in the same way over query tiles: a chunk of a long prompt
beside one-token decodes splits the chunk's tiles by their keys and gives each decode one
item, with the merge fused (one launch).

Models: head_dim 64, 80, 96, 112, 128, 192, 256 (the generic kernel computes on the next of
64/128/256 with zero pad dims, reading only the real ones); float16/bfloat16/float32
caches, and float8 e4m3 caches read by a 16-bit query (converted exactly as loaded, the K
scale folded into the softmax scale and the V scale into the output); a sliding window
(a tile's keys start at its first query's window) and a logit soft cap. The dedicated
prefill kernels take none of these, so such calls prefill on the split-KV kernel.

Parts: ``cuda_pipelines`` (limits, ``Pipeline``, ``VARIANTS``, ``Tuning``), ``cuda_work``
(the page-aware division of the keys into work items and their order), ``cuda_plan``
(``plan_attention``: grid, splits and shared memory); the launch is here.
"""

from __future__ import annotations

import numpy as np
import torch

from kvpool.protocol.sizes import cdiv

from . import cuda_tma
from ._validate import AttentionArgs

# The GPU attention's host-side API: every public name of its parts is importable from here
# (the benchmarks, the tests and kvpool.hf_support import them so).
from .cuda_pipelines import (
    AUTO_DECODE, CTAS_PER_SM, DECODE_ITEM_CLASSES, DECODE_ITEM_KEYS, DECODE_ITEM_OVERHEAD, DECODE_MAX_CTA_KEYS,
    DECODE_SPLIT_CTAS_PER_SM, DEDICATED, DEFAULT_DECODE_VARIANT, DEFAULT_PREFILL_VARIANT, DEFAULT_TUNING,
    GENERIC_PREFILL, HEAD_DIMS, MAX_GROUP, PAGED_DECODE, PERSISTENT_MAX_KV_PER_NEW_TOKEN, PERSISTENT_QUEUE_BYTES,
    SMEM_LIMIT, SM_SMEM, TILE, VARIANTS, W8, W8_MAX_WAVES, W8_MIN_WAVES, WARPS, WGMMA, Pipeline, Tuning, Variant,
    kv_element_bytes, kv_format, padded_dim, variant_pipelines,
)
from .cuda_plan import (
    AttentionPlan, check_gpu_limits, ctas_per_sm, decode_stages, decode_warps_kv, pair_recv_bytes, pipeline_for,
    plan_attention, plan_dedicated, smem_bytes, wave_idle,
)
from .cuda_runtime import ptr
from .cuda_source import ORDER_CLASSES
from .cuda_work import choose_splits, decode_work, even_batch, tile_keys, work_items, work_order

__all__ = [
    "AUTO_DECODE", "AttentionPlan", "CTAS_PER_SM", "DECODE_ITEM_CLASSES", "DECODE_ITEM_KEYS",
    "DECODE_ITEM_OVERHEAD", "DECODE_MAX_CTA_KEYS", "DECODE_SPLIT_CTAS_PER_SM", "DEDICATED",
    "DEFAULT_DECODE_VARIANT", "DEFAULT_PREFILL_VARIANT", "DEFAULT_TUNING", "GENERIC_PREFILL", "HEAD_DIMS",
    "MAX_GROUP", "ORDER_CLASSES", "PAGED_DECODE", "PERSISTENT_MAX_KV_PER_NEW_TOKEN", "PERSISTENT_QUEUE_BYTES",
    "Pipeline", "SMEM_LIMIT", "SM_SMEM", "TILE", "Tuning", "VARIANTS", "Variant", "W8", "W8_MAX_WAVES",
    "W8_MIN_WAVES", "WARPS", "WGMMA", "check_gpu_limits", "choose_splits", "ctas_per_sm", "decode_stages",
    "decode_warps_kv", "decode_work", "even_batch", "kv_element_bytes", "kv_format", "padded_dim",
    "paged_attention", "pair_recv_bytes", "pipeline_for", "plan_attention", "plan_dedicated", "smem_bytes",
    "split_counters", "tile_keys", "variant_pipelines", "wave_idle", "work_items", "work_order",
]

_LOG2E = 1.4426950408889634


_COUNTERS: dict = {}


def split_counters(device: torch.device, n: int) -> torch.Tensor:
    """Zeroed arrival counters for the fused split merge, one per (tile, KV head).

    Kept per (device, current stream): calls on one stream run one after another and
    the kernel leaves every counter at zero again, so no memset is needed per call.
    While a CUDA graph is being captured and the kept buffer is too small, a fresh
    zeroed buffer (a memset in the graph) serves that call only.
    """
    if device.type != "cuda":  # the CPU emulator
        return torch.zeros(n, dtype=torch.int32, device=device)
    stream = torch.cuda.current_stream(device)
    key = (device.index, stream.cuda_stream)
    buf = _COUNTERS.get(key)
    if buf is not None and buf.numel() >= n:
        return buf
    size = max(1024, 1 << (n - 1).bit_length())
    fresh = torch.zeros(size, dtype=torch.int32, device=device)
    if not torch.cuda.is_current_stream_capturing():
        _COUNTERS[key] = fresh
    return fresh


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
    min_seq_len: int | None = None,
    num_splits: int | None = None,
    variant: str | Variant | None = None,
    tuning: Tuning = DEFAULT_TUNING,
    launcher=None,
) -> torch.Tensor:
    """Decode (``cu_seqlens_q is None``) or prefill on the GPU; returns ``a.out``.

    ``num_splits`` (a fixed grid of that many splits), ``variant`` (the kernel pipelines: a
    name from ``VARIANTS`` or a ``Variant``) and ``tuning`` (the planner's rules) default to
    what the public wrappers run; they exist so that one GPU run can time the shipped kernel
    against a candidate and the tests reach every kernel path on small shapes. ``launcher``:
    what compiles and launches the kernels (default: CuPy's; the tests' emulator)."""
    check_gpu_limits(a, q)
    if launcher is None:
        from .cuda_runtime import default_launcher

        launcher = default_launcher()
    out = a.out
    if a.num_seqs == 0 or a.num_tokens == 0:
        return out
    prefill = cu_seqlens_q is not None
    geo = a.geo

    def plan_with(wgmma: bool) -> AttentionPlan:
        return plan_attention(
            a,
            prefill=prefill,
            max_blocks=block_tables.shape[1],
            max_seq_len=max_seq_len,
            min_seq_len=min_seq_len,
            num_sms=launcher.num_sms(q.device),
            num_splits=num_splits,
            variant=variant,
            aligned_out=out.data_ptr() % 4 == 0,
            wgmma=wgmma,
            clusters=getattr(launcher, "clusters", lambda device: False)(q.device),
            tuning=tuning,
        )

    plan = plan_with(wgmma=getattr(launcher, "wgmma", lambda device: False)(q.device))
    maps = None  # TMA tensor maps of the pool: only the warpgroup-MMA prefill kernel reads them
    if plan.pipe.wgmma:
        maps = cuda_tma.maps_for(geo, k_cache, v_cache)
        if maps is None:  # none to hand (a first call inside graph capture, the driver): mma.sync
            plan = plan_with(wgmma=False)
    tile_cum = None
    if prefill and not plan.pipe.dedicated and not plan.work_target:  # the others scan cu_seqlens themselves
        q_lens = cu_seqlens_q[1:] - cu_seqlens_q[:-1]
        tiles = torch.div(q_lens + (plan.tokens_per_cta - 1), plan.tokens_per_cta, rounding_mode="floor")
        tile_cum = torch.cumsum(tiles, 0).to(torch.int32)
    part_o = part_lse = counters = None
    d = padded_dim(plan.head_dim, plan.kf)
    if plan.pipe.persistent:  # the next item's number, and the CTAs done (the last zeroes both)
        counters = split_counters(q.device, 2)
    elif plan.work_target:  # page-aware: partials and counters by (work item, KV head)
        # Prefill splits only while its tiles number fewer than the target: items below 2 x target.
        items = min(plan.num_splits, 2 * plan.work_target) if prefill else plan.num_splits
        rows = items * (plan.tokens_per_cta if prefill else 1)
        counters = split_counters(q.device, items * geo.num_kv_heads)
        part_o = torch.empty((rows, a.num_q_heads, d), dtype=torch.float32, device=q.device)
        part_lse = torch.empty((rows, a.num_q_heads), dtype=torch.float32, device=q.device)
    elif plan.num_splits > 1 and not plan.pair:  # a pair merges in shared memory
        if plan.pipe.fused:
            counters = split_counters(q.device, plan.grid[0] * plan.grid[1])
        part_o = torch.empty((a.num_tokens, a.num_q_heads, plan.num_splits, d), dtype=torch.float32, device=q.device)
        part_lse = torch.empty((a.num_tokens, a.num_q_heads, plan.num_splits), dtype=torch.float32, device=q.device)
    args = (
        ptr(q), np.int64(q.stride(0)), np.int64(q.stride(1)),
        ptr(k_cache), ptr(v_cache), np.int64(geo.k_block_stride), np.int64(geo.v_block_stride),
        np.int32(geo.num_blocks), np.int32(geo.num_kv_heads), np.int32(plan.bs_log2),
        ptr(block_tables), np.int64(block_tables.stride(0)), np.int32(block_tables.shape[1]),
        ptr(seq_lens), ptr(cu_seqlens_q), ptr(tile_cum),
        np.int32(a.num_seqs), np.int32(a.group), np.float32(a.scale * a.k_scale * _LOG2E),
        np.int32(plan.chunk), np.int32(plan.num_splits),
        ptr(out), ptr(part_o), ptr(part_lse), ptr(counters),
        np.int32(a.window), np.float32(a.soft_cap * _LOG2E), np.float32(a.v_scale),
        np.int32(plan.work_target), np.int32(plan.min_chunk), np.int32(plan.item_overhead),
        np.int32(plan.item_classes),
    )  # fmt: skip
    p = plan.pipe
    if p.wgmma:
        key = ("prefill_wg", plan.dt, plan.head_dim, p.persistent)
        args = (*args, ptr(maps[0]), ptr(maps[1]))
    elif p.dedicated:
        key = ("prefill", plan.dt, plan.head_dim, p.mtiles, p.warps, p.stages)
    else:
        key = ("attention", plan.dt, plan.head_dim, plan.kf, plan.warps_kv, p.stages, p.keys, plan.pair)
    launcher.launch(key, "attention", q.device, plan.grid, args, plan.smem_bytes)
    if part_o is not None and counters is None:  # partials, not merged by the attention kernel
        merge_args = (
            ptr(part_o), ptr(part_lse), ptr(out), ptr(seq_lens), ptr(cu_seqlens_q),
            np.int32(a.num_seqs), np.int32(a.num_tokens), np.int32(block_tables.shape[1]), np.int32(plan.bs_log2),
            np.int32(a.num_q_heads), np.int32(plan.num_splits), np.int32(plan.chunk),
        )  # fmt: skip
        rows = a.num_tokens * a.num_q_heads  # one warp each
        launcher.launch(key, "merge", q.device, (cdiv(rows, WARPS), 1, 1), merge_args, 0)
    return out
