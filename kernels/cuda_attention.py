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
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, replace
from typing import NamedTuple

import numpy as np
import torch

from . import cuda_tma
from kvpool.protocol.sizes import cdiv
from ._validate import AttentionArgs
from .cuda_source import ORDER_CLASSES, WG_GROUPS, WG_KEYS, WG_STAGES
from .cuda_runtime import THREADS, ptr

TILE = 16  # keys per MMA step
WARPS = THREADS // 32
CTAS_PER_SM = 3  # what the kernel's registers allow at most
# Decode: the CTAs per SM that the split count is planned for. Two even where shared memory
# would seat three: two per SM already stream at the whole GPU's bandwidth, so the splits a
# third would take only add partials to merge (benchmarks/NOTES-kernels.md).
DECODE_SPLIT_CTAS_PER_SM = 2
# Decode: most keys per CTA where the grid is longer than one wave. The last wave's CTAs end
# apart by up to a CTA's length, with SMs idle meanwhile, so the longest CTAs are halved;
# CTAs of a few thousand keys stay whole, where one more split costs more than the shorter
# tail saves (benchmarks/NOTES-kernels.md).
DECODE_MAX_CTA_KEYS = 8192
SM_SMEM = 228 * 1024  # shared memory per SM (H100 / H200), 1 KiB of it reserved per CTA
SMEM_LIMIT = 227 * 1024  # per-CTA opt-in maximum on sm_80 / sm_90
_DT_CODE = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
_FP8 = getattr(torch, "float8_e4m3fn", None)
_LOG2E = 1.4426950408889634
HEAD_DIMS = (64, 80, 96, 112, 128, 192, 256)
MAX_GROUP = 16  # query heads per KV head
# Page-aware decode: work items planned per SM (see decode_work) and the fewest keys per
# item (one 16-key tile per warp of a 4-warp CTA).
DECODE_ITEM_KEYS = 64
# Page-aware attention (decode and prefill): a work item's fixed cost (start, table reads,
# pipeline fill, epilogue and its share of the merge), in keys streamed in the same time;
# work_items weighs items by it, so that short items are not counted as free. The mixed
# batches timed are not sensitive to the exact value (benchmarks/NOTES-mixed-decode.md).
DECODE_ITEM_OVERHEAD = 256
# Page-aware decode: size classes of the item order (``work_order``; at least two in one wave,
# where the long sequences' items run first), up to ``cuda_source.ORDER_CLASSES``: larger
# items first over several waves too, so that the last wave is not left to a few long items.
# Four: the best mean over the mixed batches timed, and close to the best on each of them
# (benchmarks/NOTES-mixed-decode.md).
DECODE_ITEM_CLASSES = 4


def padded_dim(head_dim: int, kf: int = 0) -> int:
    """The head_dim the generic kernel computes with (``Pad`` in the kernel source)."""
    return next(d for d in ((128, 256) if kf else (64, 128, 256)) if head_dim <= d)


def kv_format(dtype: torch.dtype) -> int:
    """The kernel's KF for a cache dtype: 1 for float8 e4m3 (converted to the query's 16-bit
    type as it is read), 0 for a cache in the query's own dtype."""
    return 1 if dtype == _FP8 else 0


def kv_element_bytes(dt: int, kf: int) -> int:
    return 1 if kf else 4 if dt == 0 else 2


@dataclass(frozen=True)
class Pipeline:
    """How K/V stream through shared memory: ``stages`` cp.async stages of ``keys``
    keys each per ring; with split-KV, ``fused``: the last split CTA of a tile merges (no merge launch). ``dedicated``:
    prefill on ``prefill_kernel`` instead, with ``warps`` warps of ``mtiles`` 16-row MMA
    tiles each (4 x 1 or 4 x 2: 64 or 128 query rows per CTA sharing each K/V tile; 8 x 1:
    128 rows, Q fragments in registers, one CTA per SM; mtiles 0: the planner picks).
    ``paged``: decode divides its work by the actual lengths on the device (``decode_work``)
    instead of a fixed (sequence, split) grid; the merge is fused. ``wgmma``: on a device with warpgroup MMA (Hopper), prefill on ``prefill_wg_kernel``
    with ``warps // 4`` warpgroups of 64 rows and ``keys``-key tiles; elsewhere the
    pipeline is the ``mma.sync`` planner's (``DEDICATED``), as it is where no TMA tensor
    map of the pool can be had (``cuda_tma.maps_for``). ``pair``: decode with exactly two
    splits runs ``paged_attention_pair_kernel`` where the device has thread block clusters
    (sm_90+): the two split CTAs of a row tile form a cluster and merge through shared
    memory instead of global partials and an arrival counter. ``persistent``: the warpgroup-MMA
    prefill runs one CTA per SM, each taking query tiles from a counter until none are left
    (``prefill_wg_kernel``'s PERSIST)."""

    stages: int
    keys: int
    fused: bool = False
    mtiles: int = 1
    dedicated: bool = False
    warps: int = 4
    wgmma: bool = False
    pair: bool = False
    paged: bool = False
    persistent: bool = False


# Decode with stages == 0: the planner picks per shape (``decode_stages``); exactly two
# splits run as clusters of two CTAs where the device has clusters (``pair``).
AUTO_DECODE = Pipeline(0, 16, fused=True, pair=True)
# Page-aware decode (``decode_work``): stages per shape as AUTO_DECODE, splits by the lengths.
PAGED_DECODE = Pipeline(0, 16, fused=True, paged=True)
# Prefill on the dedicated kernel (``prefill_kernel``: 64-key tiles, 2 stages, Q in shared
# memory, rows written from registers); mtiles 0 = the planner picks 64 or 128 rows per CTA.
DEDICATED = Pipeline(2, 64, dedicated=True, mtiles=0)
# 8 warps x 16 rows (128 rows per CTA, one CTA per SM), 3 stages: each K/V tile serves
# as many rows as mtiles=2 without its 255 registers and spill (see prefill_kernel).
W8 = Pipeline(3, 64, dedicated=True, mtiles=1, warps=8)
# The grids, in waves of one CTA per SM, on which the planner (mtiles 0) picks W8: from
# W8_MIN_WAVES up to below W8_MAX_WAVES (``Tuning.w8_waves``). On a short grid W8's one
# CTA per SM, loading each K/V tile once for 128 rows, wins; on a long grid two 4-warp CTAs
# per SM hide each other's barriers better. The upper end lies between the grids timed:
# where exactly the cross-over is has not been measured (benchmarks/NOTES-kernels.md).
W8_MIN_WAVES = 2
W8_MAX_WAVES = 4
# Prefill on warpgroup MMA (sm_90a, ``prefill_wg_kernel``; its shape is fixed in
# cuda/paged_attention_sm90.cu). Forced (mtiles 1), it runs whatever the grid; the planner's (mtiles 0)
# only where the query tiles alone give two CTAs per SM, else split-KV as in v7.
WGMMA = Pipeline(WG_STAGES, WG_KEYS, dedicated=True, warps=4 * WG_GROUPS, wgmma=True)
# The persistent warpgroup-MMA prefill's queue in shared memory: four mbarriers and two
# PrefillTile entries of nine ints.
PERSISTENT_QUEUE_BYTES = 4 * 8 + 2 * 9 * 4
# The planner runs the persistent prefill only while the longest sequence's keys are within
# this many times the mean new tokens per sequence (no long cached prefix): there its query
# tiles see few keys, and what a CTA of one tile pays once weighs most. Behind a long cached
# prefix every tile streams many keys, that once-paid cost weighs little, and one CTA per
# tile is faster (benchmarks/NOTES-mixed-decode.md).
PERSISTENT_MAX_KV_PER_NEW_TOKEN = 4
# Prefill where the dedicated kernel does not apply (float32, head_dim 256, forced splits,
# or too few query tiles to fill the GPU without split-KV): page-aware, each query tile split
# by its own key count (``work_items``).
GENERIC_PREFILL = Pipeline(3, 16, paged=True)


class Variant(NamedTuple):
    """A kernel variant: the pipeline that decode runs and the one that prefill runs."""

    decode: Pipeline
    prefill: Pipeline


# The kernel variants by name, for ``variant=`` (a name here or a ``Variant``). Names are
# versions of the kernels; only those the defaults run ship here. benchmarks/kernel_variants.py
# holds the earlier pipelines and the planner's per-shape choices forced, which
# ``bench_decode.py --variants`` and the tests pass as ``Variant`` objects. "v9": decode
# page-aware (``decode_work``); prefill on warpgroup MMA with TMA loads where the device has
# them (Hopper) and the grid fills it, else on the dedicated kernel where it applies
# (``plan_dedicated`` picks its rows per CTA) and on the split-KV kernel elsewhere. "v10": v9
# with the warpgroup-MMA prefill persistent (one CTA per SM taking query tiles from a counter).
VARIANTS: dict[str, Variant] = {
    "v9": Variant(decode=PAGED_DECODE, prefill=replace(WGMMA, mtiles=0)),
    "v10": Variant(decode=PAGED_DECODE, prefill=replace(WGMMA, mtiles=0, persistent=True)),
}
# The variants whose pipelines ``variant=None`` runs: decode v9's, prefill v10's.
DEFAULT_DECODE_VARIANT = "v9"
DEFAULT_PREFILL_VARIANT = "v10"


@dataclass(frozen=True)
class Tuning:
    """The planner's tunable rules, an argument of ``plan_attention`` and ``paged_attention`` so
    that a benchmark can time other settings (``benchmarks/kernel_variants.py``); the defaults
    are what every call runs.

    ``decode_ctas_per_sm``: the CTAs per SM of the wave that page-aware decode aims at (None:
    ``decode_work``'s rule). ``item_overhead``: a page-aware work item's fixed cost in keys
    (``work_items``), decode and prefill. ``item_classes``: the size classes of page-aware
    decode's item order (``work_order``). ``w8_waves``: the grids, in waves of one CTA per SM,
    from the first up to below the second, on which the dedicated prefill planner picks ``W8``
    (None: never)."""

    decode_ctas_per_sm: int | None = None
    item_overhead: int = DECODE_ITEM_OVERHEAD
    item_classes: int = DECODE_ITEM_CLASSES
    w8_waves: tuple[int, int] | None = (W8_MIN_WAVES, W8_MAX_WAVES)


DEFAULT_TUNING = Tuning()


@dataclass(frozen=True)
class AttentionPlan:
    dt: int  # the query's: 0 float32, 1 float16, 2 bfloat16
    head_dim: int
    warps_kv: int  # warps sharing one row tile (splitting its keys)
    pipe: Pipeline
    tokens_per_cta: int
    grid: tuple[int, int, int]
    num_splits: int
    chunk: int  # keys per split
    smem_bytes: int
    bs_log2: int
    pair: bool = False  # two splits as a cluster of two CTAs (paged_attention_pair_kernel)
    kf: int = 0  # the cache's element format (kv_format)
    work_target: int = 0  # page-aware: the wave of work items per KV head planned (0: fixed grid)
    min_chunk: int = 0  # page-aware: fewest keys per work item
    item_overhead: int = 0  # page-aware: an item's fixed cost in keys (work_items)
    item_classes: int = 0  # page-aware decode: size classes of the item order (work_order)


def check_gpu_limits(a: AttentionArgs, q: torch.Tensor) -> None:
    """What the GPU kernel supports beyond the generic checks (clear errors, not bad reads)."""
    geo = a.geo
    if geo.head_dim not in HEAD_DIMS:
        raise ValueError(f"GPU paged attention supports head_dim {', '.join(map(str, HEAD_DIMS))}; got {geo.head_dim}")
    if kv_format(geo.dtype) and q.dtype not in (torch.float16, torch.bfloat16):
        raise TypeError(f"GPU paged attention on a float8 cache computes in float16 or bfloat16; q is {q.dtype}")
    bs = geo.block_size
    if bs < 8 or bs & (bs - 1):
        raise ValueError(f"GPU paged attention needs a power-of-two block_size >= 8; got {bs}")
    if a.group > MAX_GROUP:
        raise ValueError(f"GPU paged attention supports GQA groups up to {MAX_GROUP}; got {a.group}")
    es, kes = q.element_size(), torch.empty(0, dtype=geo.dtype).element_size()
    for name, value in (
        ("q.data_ptr()", q.data_ptr()),
        ("q.stride(0) in bytes", q.stride(0) * es),
        ("q.stride(1) in bytes", q.stride(1) * es),
        ("k_cache.stride(0) in bytes", geo.k_block_stride * kes),
        ("v_cache.stride(0) in bytes", geo.v_block_stride * kes),
        ("head_dim in bytes", geo.head_dim * kes),
    ):
        if value % 16:
            raise ValueError(f"{name} = {value} must be a multiple of 16 (the kernel loads 16 bytes at a time)")


def smem_bytes(dt: int, head_dim: int, rings: int, pipe: Pipeline = GENERIC_PREFILL, kf: int = 0) -> int:
    """Dynamic shared memory: ``rings`` cp.async rings of ``pipe.stages`` (K, V) stages of
    padded rows, reused after the loop by the epilogue's [4 warps][16 rows][D + 1] floats + m, l."""
    d = padded_dim(head_dim, kf)
    stage = 2 * pipe.keys * d * kv_element_bytes(dt, kf)
    rows = WARPS * 16
    epilogue = (rows * (d + 1) + 2 * rows) * 4 + 16  # + the fused merge's flag
    return max(rings * pipe.stages * stage, epilogue)


def pair_recv_bytes(smem: int, head_dim: int, warps_kv: int, kf: int = 0) -> int:
    """Shared memory a pair CTA adds past its rings and epilogue (``smem`` bytes, the
    ``smem_bytes`` of its plan), 16-byte aligned: split 1's rows (16 per warp of a row
    tile) of ``head_dim`` floats and their log-sum-exps (``pair_recv_offset`` in the kernel
    source)."""
    rows = 16 * (WARPS // warps_kv)
    return -smem % 16 + rows * (padded_dim(head_dim, kf) + 1) * 4


def ctas_per_sm(smem: int) -> int:
    """CTAs of ``smem`` bytes of dynamic shared memory that fit on one SM (at most
    ``CTAS_PER_SM``: the kernel's registers)."""
    return min(CTAS_PER_SM, SM_SMEM // (smem + 1024))


def decode_warps_kv(dt: int, head_dim: int, pipe: Pipeline = GENERIC_PREFILL, kf: int = 0) -> int:
    """Decode gives each warp its own ring (4 key streams per CTA) when shared memory
    allows two CTAs per SM; float32 with head_dim 256 shares rings between warps."""
    for warps_kv in (WARPS, 2, 1):
        if smem_bytes(dt, head_dim, warps_kv, pipe, kf) <= SMEM_LIMIT:
            return warps_kv
    raise ValueError(f"head_dim {head_dim} does not fit in shared memory")


def variant_pipelines(variant: str | Variant | None) -> Variant:
    """``variant=``'s pipelines: a ``Variant`` as given, a name from ``VARIANTS``, or None for
    what the defaults run (``DEFAULT_DECODE_VARIANT``'s decode, ``DEFAULT_PREFILL_VARIANT``'s
    prefill)."""
    if isinstance(variant, Variant):
        return variant
    if variant is None:
        decode, prefill = VARIANTS[DEFAULT_DECODE_VARIANT].decode, VARIANTS[DEFAULT_PREFILL_VARIANT].prefill
        return Variant(decode=decode, prefill=prefill)
    if variant not in VARIANTS:
        raise ValueError(f"unknown kernel variant {variant!r}; choose from {sorted(VARIANTS)} or pass a Variant")
    return VARIANTS[variant]


def pipeline_for(
    variant: str | Variant | None, *, prefill: bool, dt: int, head_dim: int, plain: bool = True, kf: int = 0
) -> Pipeline:
    """The variant's pipeline, its stages halved (down to 16 keys) while one ring
    would keep two CTAs off an SM (wide rows: head_dim 256 or float32). The dedicated
    prefill kernels take ``plain`` calls only (16-bit cache of head_dim 64 or 128, no window,
    soft cap or scale); the rest prefill on the split-KV kernel."""
    pipes = variant_pipelines(variant)
    pipe = pipes.prefill if prefill else pipes.decode
    if pipe.dedicated:
        if dt == 0 or head_dim not in (64, 128) or not plain or kf:
            pipe = GENERIC_PREFILL
        else:
            return pipe
    while pipe.keys > TILE and smem_bytes(dt, head_dim, 1, pipe, kf) > SMEM_LIMIT // 2:
        pipe = replace(pipe, keys=pipe.keys // 2)
    return pipe


def decode_stages(ctas: int, max_kv: int, num_sms: int, kf: int = 0) -> int:
    """Stages per decode ring when the variant leaves it to the planner (``stages == 0``).

    Two stages seat three CTAs per SM, three stages two (and keep more bytes in flight per
    warp). Where the grid (``ctas``, before splits) is between one wave of two per SM and
    three waves of three per SM, equal CTAs finish wave by wave and a last wave left mostly
    empty costs up to a whole wave's time: there the stage count whose last wave is fuller
    wins (``wave_idle``; ties to two stages), whatever the bytes each keeps in flight
    (benchmarks/NOTES-mixed-decode.md).

    Elsewhere: 3 stages keep the most bytes in flight per warp and are fastest except where
    (sequences x KV heads) is about one CTA per SM and the contexts are long (4096 keys or
    more): there 2 stages, seating a third CTA per SM, are the faster
    (benchmarks/NOTES-kernels.md). The split count is planned for two CTAs per SM whatever
    fits (``DECODE_SPLIT_CTAS_PER_SM``), and with two splits there two stages still beat
    three. A float8 cache (``kf``; stages of twice the keys, as many bytes) takes 2 there:
    three CTAs per SM keep more warps converting and multiplying, which float8 needs more of
    per byte than bfloat16 (benchmarks/NOTES-mixed-decode.md).
    """
    three_per_sm, two_per_sm = ctas / (3 * num_sms), ctas / (2 * num_sms)
    if two_per_sm > 1 and three_per_sm < 3:
        return 3 if wave_idle(two_per_sm) < wave_idle(three_per_sm) else 2
    if kf:
        return 2
    return 2 if num_sms // 2 <= ctas < 2 * num_sms and max_kv >= 4096 else 3


def wave_idle(waves: float) -> float:
    """The empty part of the last wave of a grid of ``waves`` waves of equal CTAs (none within
    one wave: every CTA runs at once)."""
    return math.ceil(waves) - waves if waves > 1 else 0.0


def plan_dedicated(
    a: AttentionArgs,
    pipe: Pipeline,
    num_sms: int,
    max_kv: int,
    bs_log2: int,
    *,
    wgmma: bool = False,
    w8_waves: tuple[int, int] | None = DEFAULT_TUNING.w8_waves,
) -> AttentionPlan | None:
    """The dedicated prefill kernel's plan, or None where it does not apply.

    It has no split-KV, so the planner (``pipe.mtiles == 0``) uses it only when the
    query tiles alone give at least two CTAs per SM; rows per CTA: 128 on 8 warps
    (``W8``: each K/V tile loaded once for twice the rows, registers to spare) when that
    gives ``w8_waves`` waves of one CTA per SM (from the first up to below the second; None:
    never), else 128 on 4 warps when that leaves four CTAs per SM, else 64 (shorter CTAs
    balance the causal triangle better when the grid is small). A variant that fixes ``mtiles`` always gets it
    (tests, benchmark). With ``wgmma`` (Hopper, and TMA maps of the pool to hand) a
    ``wgmma`` pipeline runs ``prefill_wg_kernel`` under the same grid rule; without, it
    falls back to the ``mma.sync`` planner above. A ``persistent`` one stays persistent under
    the planner only while the longest sequence (``max_kv``) is within
    ``PERSISTENT_MAX_KV_PER_NEW_TOKEN`` times the mean new tokens per sequence.
    """
    geo = a.geo
    kvh = geo.num_kv_heads

    def grid_x(rows: int) -> int:
        return a.num_tokens // (rows // a.group) + a.num_seqs

    if pipe.wgmma and (not wgmma or a.scale <= 0):
        pipe = DEDICATED  # no warpgroup MMA here (or a scale the kernel's softmax does not take)
    if pipe.mtiles == 0:
        if grid_x(64) * kvh < 2 * num_sms:
            return None
        if pipe.wgmma:
            short = max_kv <= PERSISTENT_MAX_KV_PER_NEW_TOKEN * cdiv(a.num_tokens, a.num_seqs)
            pipe = replace(WGMMA, persistent=pipe.persistent and short)
        elif w8_waves and w8_waves[0] * num_sms <= grid_x(128) * kvh < w8_waves[1] * num_sms:
            pipe = W8
        else:
            pipe = Pipeline(pipe.stages, pipe.keys, dedicated=True, mtiles=2 if grid_x(128) * kvh >= 4 * num_sms else 1)
    rows = 16 * pipe.mtiles * pipe.warps
    es = 2
    smem = rows * geo.head_dim * es + pipe.stages * (2 * pipe.keys * geo.head_dim * es)
    items = grid_x(rows) * kvh
    grid, per_head = (items, 1, 1), 1  # KV head fastest: see prefill_kernel
    if pipe.wgmma:
        smem += 1024 + 16 * pipe.stages  # 1 KiB to align the swizzled tiles, two mbarriers per stage
        if pipe.persistent:  # one CTA per SM; the kernel reads the items per KV head as num_splits
            smem += PERSISTENT_QUEUE_BYTES
            grid, per_head = (min(items, num_sms), 1, 1), grid_x(rows)
    return AttentionPlan(
        dt=_DT_CODE[geo.dtype],
        head_dim=geo.head_dim,
        warps_kv=1,
        pipe=pipe,
        tokens_per_cta=rows // a.group,
        grid=grid,
        num_splits=per_head,
        chunk=max_kv,
        smem_bytes=smem,
        bs_log2=bs_log2,
    )


@functools.lru_cache(maxsize=4096)
def choose_splits(ctas: int, tiles: int, warps_kv: int, slots: int) -> int:
    """Split count minimizing (waves of CTAs) x (tiles per CTA), the fewest on ties.

    ``slots`` CTAs run at once; a CTA's time grows with its tiles. Splitting
    only pays while it fills idle slots: beyond one wave it adds merge work
    and shortens nothing. Each warp keeps at least one tile.
    """
    best, best_cost = 1, math.inf
    max_s = max(1, min(tiles // warps_kv, 2 * cdiv(slots, max(ctas, 1)), 256))
    for s in range(1, max_s + 1):
        cost = cdiv(ctas * s, slots) * cdiv(tiles, s)
        if cost < best_cost:
            best, best_cost = s, cost
    return best


def decode_work(num_seqs: int, num_kv_heads: int, tiles: int, num_sms: int, *, per_sm: int | None = None) -> int:
    """Page-aware decode: the wave, in CTAs per KV head, that one call's work division aims at
    (``work_items`` states the division; the kernel's ``locate_item`` makes it from the
    lengths on the device).

    ``per_sm`` CTAs per SM over all KV heads; by default ``DECODE_SPLIT_CTAS_PER_SM``, or one
    where that already gives a uniform batch of this size 8 or more splits (small batches:
    fewer partials to merge; ``tiles`` is the longest sequence's 16-key tiles, the shape
    bound). The grid holds ``target + num_seqs`` items per head; the merge is fused (a row's
    last item merges).
    """
    if per_sm is None:
        ctas = num_seqs * num_kv_heads
        per_sm = 1 if choose_splits(ctas, tiles, WARPS, num_sms) >= 8 else DECODE_SPLIT_CTAS_PER_SM
    return max(1, num_sms * per_sm // num_kv_heads)


def tile_keys(seq_lens, q_lens=None, *, tokens_per_tile: int = 1, capacity: int, window: int = 0) -> list[int]:
    """The keys each query tile sees, in the order ``locate_item`` enumerates the tiles: decode
    (``q_lens`` None) one tile per sequence; prefill ``ceil(q_len / tokens_per_tile)`` per
    sequence, its last tile (the most keys) first. A tile's keys run from its first token's
    window start (rounded down to 8) to its last token's position, within ``capacity``."""
    out = []
    for j, n in enumerate(seq_lens):
        n = max(0, int(n))
        ql = 1 if q_lens is None else int(q_lens[j])
        tiles = 1 if q_lens is None else cdiv(ql, tokens_per_tile)
        for t in reversed(range(tiles)):
            first, tok0 = n - ql, t * tokens_per_tile
            hi = min(min(n, capacity), first + tok0 + min(tokens_per_tile, ql - tok0))
            lo = max(0, first + tok0 - window + 1) & ~7 if window else 0
            out.append(max(0, hi - lo))
    return out


def work_items(
    seq_lens,
    q_lens=None,
    *,
    target: int,
    capacity: int,
    tokens_per_tile: int = 1,
    window: int = 0,
    min_chunk: int = DECODE_ITEM_KEYS,
    max_chunk: int = DECODE_MAX_CTA_KEYS,
    overhead: int = DECODE_ITEM_OVERHEAD,
):
    """Page-aware attention's work division: what ``locate_item`` makes on the device, here from
    host lengths (tests and benchmarks). Returns ``(c, keys per item of each tile, items per
    tile)``, tiles as ``tile_keys`` lists them (decode: one per sequence).

    In units of 64 keys: tile i sees ``w_i`` units. With ``u`` units per item it gets ``n_i =
    max(1, ceil(w_i / u))`` items, its keys shared evenly between them (a multiple of 64 each).
    It is *long* when ``2 w_i > u``. With ``S = target`` (the CTAs per KV head that run at once)
    and ``a = overhead / 64`` (an item's fixed cost), ``u`` is the smallest, at least
    ``min_chunk / 64``, such that the long tiles' items fit one wave (``sum n_i <= S`` over long
    i) and all the work fits S slots of one item's time (``sum (w_i + a n_i) <= S (u + a)``).
    With S or more tiles there are several waves whatever the split: decode takes ``u =
    ceil(sum w_i / S)``, lowered to ``max_chunk`` where the grid of ``target + B`` items still
    holds the items; prefill splits none (one item per tile). Decode's items run in the order
    ``work_order`` states (in one wave the long sequences' items first); prefill runs the long
    tiles' items first, then one item per short tile.
    """
    keys = tile_keys(seq_lens, q_lens, tokens_per_tile=tokens_per_tile, capacity=capacity, window=window)
    if q_lens is not None and len(keys) >= target:
        return 1 << 35, keys, [1] * len(keys)
    units = [cdiv(k, 64) for k in keys]
    n_units, total = len(units), sum(units)
    a, s = overhead // 64, max(1, target)
    min_u = max(1, min_chunk // 64)
    max_u = max(min_u, max_chunk // 64)

    def items(u: int) -> list[int]:
        return [max(1, cdiv(w, u)) for w in units]

    def fits(u: int) -> bool:
        counts = items(u)
        n_long = sum(n for n, w in zip(counts, units) if 2 * w > u)
        return n_long <= s and total + a * sum(counts) <= s * (u + a)

    if n_units >= target:  # decode of S or more sequences: several waves whatever the split
        u = max(min_u, cdiv(total, s))
        if u > max_u and sum(items(max_u)) <= target + n_units:
            u = max_u
    else:
        lo = max(min_u, (total + a * n_units) // s - a)
        u = lo
        if not fits(lo):
            hi = max(2 * max(units, default=0), cdiv(total + a * n_units, s)) + 1
            probe = max(lo + 1, cdiv(3 * total, s))
            if probe < hi and fits(probe):
                hi = probe
            while hi - lo > 1:
                mid = (lo + hi) // 2
                lo, hi = (lo, mid) if fits(mid) else (mid, hi)
            u = hi
    counts = items(u)
    per_item = [(cdiv(k, n) + 63) & ~63 for k, n in zip(keys, counts)]
    return 64 * u, per_item, counts


def work_order(keys: list[int], c: int, counts: list[int], *, target: int,
               classes: int | None = None) -> list[tuple[int, int]]:
    """The (sequence, item) that each CTA of one KV head runs in page-aware decode, in grid
    order, for a division that ``work_items`` returned (``c`` keys per item, ``counts`` items
    per sequence; ``keys`` per sequence as ``tile_keys`` lists them; ``target`` the wave).

    Largest items first, by size class: a sequence's items, of ``p`` units each (its units over
    its items, rounded up; ``u = c / 64``), fall in class 0 when ``2 p > u`` (the long
    sequences'), else ``floor(log2(u // max(p, 1)))``, at least 1 and at most
    ``classes - 1`` (default ``DECODE_ITEM_CLASSES``; at least two classes with fewer sequences
    than ``target``): class 1 holds items of (u/4, u/2] units, and so on. The classes in order,
    each in batch order (one class: batch order)."""
    classes = DECODE_ITEM_CLASSES if classes is None else classes
    last = min(ORDER_CLASSES, max(2 if len(keys) < target else 1, classes)) - 1
    u = c // 64

    def size_class(i: int) -> int:
        w = cdiv(keys[i], 64)
        p = cdiv(w, counts[i])
        return 0 if 2 * p > u else min(last, max(1, (u // max(p, 1)).bit_length() - 1))

    of = [size_class(i) for i in range(len(keys))]
    return [(i, s) for k in range(last + 1) for i, n in enumerate(counts) if of[i] == k for s in range(n)]


def plan_attention(
    a: AttentionArgs,
    *,
    prefill: bool,
    max_blocks: int,
    max_seq_len: int | None,
    num_sms: int,
    num_splits: int | None = None,
    variant: str | Variant | None = None,
    aligned_out: bool = True,
    wgmma: bool = False,
    clusters: bool = False,
    min_seq_len: int | None = None,
    tuning: Tuning = DEFAULT_TUNING,
) -> AttentionPlan:
    """Grid, split-KV and shared memory for one call (pure arithmetic on shapes).

    ``min_seq_len`` (with ``max_seq_len``): the caller's bounds on the lengths; decode of a
    batch whose keys they hold within 1/8 (``even_batch``) runs the fixed grid.
    ``aligned_out``: ``out`` starts on 4 bytes (the dedicated prefill kernel stores pairs of
    elements). ``wgmma``: the device has warpgroup MMA (sm_90a). ``clusters``:
    the device has thread block clusters (sm_90+), for the pair decode kernel. A forced
    ``num_splits`` plans a fixed grid (also for a page-aware variant). ``variant``: the kernel
    pipelines (``variant_pipelines``; None: the defaults'). ``tuning``: the planner's tunable
    rules (``Tuning``; the default: what production runs)."""
    geo = a.geo
    kf = kv_format(geo.dtype)
    # The query's dtype (out has it); planners' shape-only args may carry no out: the cache's.
    dt = _DT_CODE[a.out.dtype if a.out is not None else torch.bfloat16 if kf else geo.dtype]
    window = a.window
    plain = not kf and window == 0 and a.soft_cap == 0.0
    pipe = pipeline_for(variant, prefill=prefill, dt=dt, head_dim=geo.head_dim, plain=plain, kf=kf)
    capacity = max_blocks * geo.block_size
    max_kv = capacity if max_seq_len is None else max(1, min(int(max_seq_len), capacity))
    if (pipe.paged and not prefill and num_splits is None
            and (a.num_seqs == 1 or even_batch(min_seq_len, max_kv, window))):
        # No mix to balance: the fixed grid divides the batch alike without the device-side
        # division's latency (lengths, then the table) and its spare CTAs, and runs two splits
        # as a cluster pair.
        pipe = AUTO_DECODE
    bs_log2 = geo.block_size.bit_length() - 1
    if pipe.dedicated:
        plan = None
        if num_splits in (None, 1) and aligned_out:
            plan = plan_dedicated(a, pipe, num_sms, max_kv, bs_log2, wgmma=wgmma, w8_waves=tuning.w8_waves)
        if plan is not None:
            return plan
        pipe = GENERIC_PREFILL
    if pipe.stages == 0:
        stages = decode_stages(a.num_seqs * geo.num_kv_heads, max_kv, num_sms, 0 if prefill else kf)
        pipe = replace(pipe, stages=stages)
    if kf and not prefill:  # float8 rows are half as wide: twice the keys keep as many bytes in flight
        pipe = replace(pipe, keys=2 * pipe.keys)
    warps_kv = 1 if prefill else decode_warps_kv(dt, geo.head_dim, pipe, kf)
    smem = smem_bytes(dt, geo.head_dim, warps_kv, pipe, kf)
    tokens_per_cta = (16 * (WARPS // warps_kv)) // a.group
    if window:  # a tile's keys start at its first token's window
        max_kv = min(max_kv, window + tokens_per_cta + 7)
    tiles = max(1, cdiv(max_kv, pipe.keys))  # stages, the unit of a split
    if pipe.paged and num_splits is None:
        if prefill:
            # Page-aware prefill: items of query tiles (split by their own key counts while the
            # tiles alone leave the wave unfilled); a wave of as many CTAs as fit per SM.
            target = max(1, num_sms * ctas_per_sm(smem) // geo.num_kv_heads)
            items = max(a.num_tokens // tokens_per_cta + a.num_seqs, 2 * target)
            pipe, classes = replace(pipe, fused=True), 0
        else:
            target = decode_work(a.num_seqs, geo.num_kv_heads, tiles, num_sms, per_sm=tuning.decode_ctas_per_sm)
            items, tokens_per_cta, classes = target + a.num_seqs, 1, tuning.item_classes
        return AttentionPlan(
            dt=dt, head_dim=geo.head_dim, warps_kv=warps_kv, pipe=pipe, tokens_per_cta=tokens_per_cta,
            grid=(items * geo.num_kv_heads, 1, 1), num_splits=items, chunk=DECODE_MAX_CTA_KEYS, smem_bytes=smem,
            bs_log2=bs_log2, kf=kf, work_target=target, min_chunk=max(DECODE_ITEM_KEYS, pipe.keys * warps_kv),
            item_overhead=tuning.item_overhead, item_classes=classes,
        )  # fmt: skip
    if prefill:
        # sum over sequences of ceil(q_len / tq) <= T // tq + B
        grid_x = a.num_tokens // tokens_per_cta + a.num_seqs
    else:
        grid_x = a.num_seqs
    if num_splits is None:
        slots = num_sms * ctas_per_sm(smem)
        ctas = grid_x * geo.num_kv_heads
        if prefill:
            num_splits = choose_splits(ctas, tiles, warps_kv, max(slots, num_sms))
        else:
            planned = num_sms * max(1, min(DECODE_SPLIT_CTAS_PER_SM, slots // num_sms))
            num_splits = choose_splits(ctas, tiles, warps_kv, planned)
            # Where one CTA per SM already takes 8 or more splits (small batches), stop
            # there: the second CTA per SM costs more partials to merge than it gains
            # (benchmarks/NOTES-kernels.md). Larger batches keep the full wave.
            one_per_sm = choose_splits(ctas, tiles, warps_kv, num_sms)
            if one_per_sm >= 8:
                num_splits = one_per_sm
            if ctas * num_splits > max(slots, num_sms):
                num_splits = max(num_splits, cdiv(max_kv, DECODE_MAX_CTA_KEYS))
    num_splits = max(1, min(int(num_splits), tiles))
    chunk_tiles = cdiv(tiles, num_splits)
    num_splits = cdiv(tiles, chunk_tiles)
    # Two splits as a cluster pair where the extra shared memory seats as many CTAs per SM.
    pair = False
    if pipe.pair and pipe.fused and clusters and not prefill and num_splits == 2:
        paired = smem + pair_recv_bytes(smem, geo.head_dim, warps_kv, kf)
        if paired <= SMEM_LIMIT and ctas_per_sm(paired) == ctas_per_sm(smem):
            pair, smem = True, paired
    return AttentionPlan(
        dt=dt,
        head_dim=geo.head_dim,
        warps_kv=warps_kv,
        # The merge kernel does not know a tile's window start: windows merge in the kernel.
        pipe=replace(pipe, fused=True) if window else pipe,
        tokens_per_cta=tokens_per_cta,
        grid=(grid_x, geo.num_kv_heads, num_splits),
        num_splits=num_splits,
        chunk=chunk_tiles * pipe.keys,
        smem_bytes=smem,
        bs_log2=bs_log2,
        pair=pair,
        kf=kf,
    )


def even_batch(min_seq_len: int | None, max_kv: int, window: int = 0) -> bool:
    """Whether every sequence sees within 1/8 as many keys as the longest (``min_seq_len`` and
    ``max_kv`` bound the lengths; a window caps what each sees): a fixed grid of splits then
    leaves no CTA much longer than another."""
    if min_seq_len is None:
        return False
    lo, hi = min_seq_len, max_kv
    if window:
        lo, hi = min(lo, window), min(hi, window)
    return 8 * lo >= 7 * hi


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
