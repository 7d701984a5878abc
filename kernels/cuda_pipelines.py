"""The GPU attention kernels' limits and pipelines: how K/V stream through shared memory
(``Pipeline``), the shipped variants (``VARIANTS``) and the planner's tunable rules (``Tuning``)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import NamedTuple

import torch

from .cuda_runtime import THREADS
from .cuda_source import WG_GROUPS, WG_KEYS, WG_STAGES

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
_FP8 = getattr(torch, "float8_e4m3fn", None)
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
