"""The planner of the GPU attention: grid, split-KV and shared memory of one call, from shapes
alone (``plan_attention``), and the checks of what the kernels support (``check_gpu_limits``)."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

from kvpool.protocol.sizes import cdiv

from ._validate import AttentionArgs
from .cuda_pipelines import (
    AUTO_DECODE, CTAS_PER_SM, DECODE_ITEM_KEYS, DECODE_MAX_CTA_KEYS, DECODE_SPLIT_CTAS_PER_SM, DEDICATED,
    DEFAULT_TUNING, GENERIC_PREFILL, HEAD_DIMS, MAX_GROUP, PERSISTENT_MAX_KV_PER_NEW_TOKEN, PERSISTENT_QUEUE_BYTES,
    SMEM_LIMIT, SM_SMEM, TILE, W8, WARPS, WGMMA, Pipeline, Tuning, Variant, kv_element_bytes, kv_format, padded_dim,
    variant_pipelines,
)
from .cuda_work import choose_splits, decode_work, even_batch

_DT_CODE = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}


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
