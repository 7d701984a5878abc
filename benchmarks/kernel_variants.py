"""Kernel variants that only benchmarks and tests run, and the planner's knobs they time.

``kvpool.kernels.cuda_attention.VARIANTS`` ships what the defaults run (``v9`` decode, ``v10``
prefill). The variants here are earlier pipelines and the planner's per-shape choices
forced whatever the shape, so that one GPU run can time them side by side
(``bench_decode.py --variants`` / ``--prefill-variants``, results in NOTES-kernels.md) and
the tests run every kernel path the planner may pick on small shapes too. They need no
kernel source of their own: each is a template instance of the shipped kernels. A variant
reaches the planner as ``variant=get(name)`` (``paged_attention``, ``plan_attention``).

* ``v7``: decode on the fixed (sequence x split) grid that the page-aware v9 replaced (splits
  from the longest sequence and the batch size; two splits as a cluster pair), prefill on the
  mma.sync kernels.
* ``v5``: 3-stage decode rings, prefill on the split-KV kernel.
* ``v6``: 2-stage decode rings (three CTAs per SM), prefill on the split-KV kernel.
* ``v7m1`` / ``v7m2``: v7 with 64 / 128 prefill rows per CTA on 4 warps, forced.
* ``v7w8``: v7 with 8 warps x 16 prefill rows per CTA (3-stage ring, Q in registers), forced.
* ``v7a``: v7 with two splits merged by the arrival counter instead of as a cluster pair.
* ``v8``: v7's decode, prefill as v9 (one CTA per query tile, not persistent).
* ``v8f``: v8 with the warpgroup-MMA prefill whatever the grid (where the device has it).
* ``v10f``: the persistent warpgroup-MMA prefill (v10's) whatever the grid.

``PROBES`` (benchmarks only, not in ``names()`` unless asked): ``v9s2`` / ``v9s3`` / ``v9s4``,
page-aware decode with 2 / 3 / 4 ring stages whatever the shape; ``v9k8``, with 8-key stages
(float8 caches only).

``tuning(per_sm, overhead, classes)``: page-aware decode planned with other knobs
(``cuda_attention.Tuning``), for ``bench_mixed_decode.py --sweep`` and ``bench_decode.py
--division``.

    import kernel_variants   # benchmarks/ on sys.path
    paged_attention(..., variant=kernel_variants.get("v7"), tuning=kernel_variants.tuning(per_sm=1))
"""

from __future__ import annotations

import argparse
from dataclasses import replace

from kvpool.kernels import cuda_attention as ca

EXTRA: dict[str, ca.Variant] = {
    "v7": ca.Variant(decode=ca.AUTO_DECODE, prefill=ca.DEDICATED),
    "v5": ca.Variant(decode=ca.Pipeline(3, 16, fused=True), prefill=ca.GENERIC_PREFILL),
    "v6": ca.Variant(decode=ca.Pipeline(2, 16, fused=True), prefill=ca.GENERIC_PREFILL),
    "v7m1": ca.Variant(decode=ca.AUTO_DECODE, prefill=ca.Pipeline(2, 64, dedicated=True, mtiles=1)),
    "v7m2": ca.Variant(decode=ca.AUTO_DECODE, prefill=ca.Pipeline(2, 64, dedicated=True, mtiles=2)),
    "v7w8": ca.Variant(decode=ca.AUTO_DECODE, prefill=ca.W8),
    "v7a": ca.Variant(decode=replace(ca.AUTO_DECODE, pair=False), prefill=ca.DEDICATED),
    "v8": ca.Variant(decode=ca.AUTO_DECODE, prefill=replace(ca.WGMMA, mtiles=0)),
    "v8f": ca.Variant(decode=ca.AUTO_DECODE, prefill=ca.WGMMA),
    "v10f": ca.Variant(decode=ca.AUTO_DECODE, prefill=replace(ca.WGMMA, persistent=True)),
}
# Probes that only benchmarks time (bench_mixed_decode.py --fp8-variants), on float8 caches:
# the page-aware decode with its ring stages fixed, and with 8-key stages (16 keys on float8,
# whose stages hold twice the keys; a 16-bit cache cannot run it: stages are whole 16-key steps).
_V9_PREFILL = replace(ca.WGMMA, mtiles=0)
PROBES: dict[str, ca.Variant] = {
    "v9s2": ca.Variant(decode=ca.Pipeline(2, 16, fused=True, paged=True), prefill=_V9_PREFILL),
    "v9s3": ca.Variant(decode=ca.Pipeline(3, 16, fused=True, paged=True), prefill=_V9_PREFILL),
    "v9s4": ca.Variant(decode=ca.Pipeline(4, 16, fused=True, paged=True), prefill=_V9_PREFILL),
    "v9k8": ca.Variant(decode=ca.Pipeline(3, 8, fused=True, paged=True), prefill=_V9_PREFILL),
}


def _table(probes: bool) -> dict[str, ca.Variant]:
    shadowed = ca.VARIANTS.keys() & (EXTRA.keys() | PROBES.keys())
    if shadowed:
        raise ValueError(f"kernel variants {sorted(shadowed)} ship with the package: name these otherwise")
    return {**ca.VARIANTS, **EXTRA, **(PROBES if probes else {})}


def names(probes: bool = False) -> list[str]:
    """Every variant's name: the shipped ones, ``EXTRA`` and, with ``probes``, ``PROBES``."""
    return sorted(_table(probes))


def get(name: str) -> ca.Variant:
    """The pipelines of the variant ``name`` (shipped, ``EXTRA`` or ``PROBES``)."""
    table = _table(probes=True)
    if name not in table:
        raise ValueError(f"unknown kernel variant {name!r}; choose from {sorted(table)}")
    return table[name]


def tuning(per_sm: int | None = None, overhead: int | None = None, classes: int | None = None) -> ca.Tuning:
    """Page-aware decode planned with other knobs: ``per_sm`` CTAs per SM for the wave that
    ``work_items`` aims at (None: ``decode_work``'s rule), ``overhead`` an item's fixed cost in
    keys (None: ``DECODE_ITEM_OVERHEAD``), ``classes`` the size classes of the item order
    (``work_order``; None: ``DECODE_ITEM_CLASSES``)."""
    default = ca.DEFAULT_TUNING
    return replace(
        default,
        decode_ctas_per_sm=per_sm,
        item_overhead=default.item_overhead if overhead is None else overhead,
        item_classes=default.item_classes if classes is None else classes,
    )


def name_list(text: str) -> list[str]:
    """A benchmark argument's comma-separated variant names, each one known (an argparse
    ``type``: an unknown name is a usage error that lists the known ones)."""
    names_given = [x for x in text.split(",") if x]
    for name in names_given:
        try:
            get(name)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
    return names_given
