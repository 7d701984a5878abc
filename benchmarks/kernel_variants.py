"""Kernel variants that only benchmarks and tests run, registered into the planner's table.

``kvpool.kernels.cuda_attention.VARIANTS`` ships what the defaults run (``v9`` decode, ``v10``
prefill). The variants here are earlier pipelines and the planner's per-shape choices
forced whatever the shape, so that one GPU run can time them side by side
(``bench_decode.py --variants`` / ``--prefill-variants``, results in NOTES-kernels.md) and
the tests run every kernel path the planner may pick on small shapes too. They need no
kernel source of their own: each is a template instance of the shipped kernels.

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

``PROBES`` (``register(probes=True)``, benchmarks only): ``v9s2`` / ``v9s3`` / ``v9s4``, page-aware
decode with 2 / 3 / 4 ring stages whatever the shape; ``v9k8``, with 8-key stages (float8 caches only).

    import kernel_variants; kernel_variants.register()   # benchmarks/ on sys.path
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import replace

from kvpool.kernels import cuda_attention as ca

EXTRA: dict[str, tuple[ca.Pipeline, ca.Pipeline]] = {
    "v7": (ca.AUTO_DECODE, ca.DEDICATED),
    "v5": (ca.Pipeline(3, 16, True), ca.GENERIC_PREFILL),
    "v6": (ca.Pipeline(2, 16, True), ca.GENERIC_PREFILL),
    "v7m1": (ca.AUTO_DECODE, ca.Pipeline(2, 64, dedicated=True, mtiles=1)),
    "v7m2": (ca.AUTO_DECODE, ca.Pipeline(2, 64, dedicated=True, mtiles=2)),
    "v7w8": (ca.AUTO_DECODE, ca.W8),
    "v7a": (replace(ca.AUTO_DECODE, pair=False), ca.DEDICATED),
    "v8": (ca.AUTO_DECODE, replace(ca.WGMMA, mtiles=0)),
    "v8f": (ca.AUTO_DECODE, ca.WGMMA),
    "v10f": (ca.AUTO_DECODE, replace(ca.WGMMA, persistent=True)),
}
# Probes that only benchmarks time (bench_mixed_decode.py --fp8-variants), on float8 caches:
# the page-aware decode with its ring stages fixed, and with 8-key stages (16 keys on float8,
# whose stages hold twice the keys; a 16-bit cache cannot run it: stages are whole 16-key steps).
PROBES: dict[str, tuple[ca.Pipeline, ca.Pipeline]] = {
    "v9s2": (ca.Pipeline(2, 16, True, paged=True), replace(ca.WGMMA, mtiles=0)),
    "v9s3": (ca.Pipeline(3, 16, True, paged=True), replace(ca.WGMMA, mtiles=0)),
    "v9s4": (ca.Pipeline(4, 16, True, paged=True), replace(ca.WGMMA, mtiles=0)),
    "v9k8": (ca.Pipeline(3, 8, True, paged=True), replace(ca.WGMMA, mtiles=0)),
}


def register(probes: bool = False) -> list[str]:
    """Adds ``EXTRA`` (and with ``probes``, ``PROBES``) to ``cuda_attention.VARIANTS``
    (idempotent); returns every variant name."""
    for name, pipes in {**EXTRA, **(PROBES if probes else {})}.items():
        if ca.VARIANTS.setdefault(name, pipes) != pipes:
            raise ValueError(f"kernel variant {name!r} is already registered with other pipelines")
    return sorted(ca.VARIANTS)


@contextmanager
def division(per_sm: int | None = None, overhead: int | None = None, classes: int | None = None):
    """Page-aware decode planned with other knobs while the block runs (the planner reads them
    at each call, so a CUDA graph captured inside keeps them): ``per_sm`` CTAs per SM for the
    wave that ``work_items`` aims at (None: ``decode_work``'s rule), ``overhead`` an item's
    fixed cost in keys (None: ``DECODE_ITEM_OVERHEAD``), ``classes`` the size classes of the
    item order (``work_order``; None: ``DECODE_ITEM_CLASSES``)."""
    saved = ca.decode_work, ca.DECODE_ITEM_OVERHEAD, ca.DECODE_ITEM_CLASSES
    if per_sm is not None:
        ca.decode_work = lambda num_seqs, num_kv_heads, tiles, num_sms: max(1, num_sms * per_sm // num_kv_heads)
    if overhead is not None:
        ca.DECODE_ITEM_OVERHEAD = overhead
    if classes is not None:
        ca.DECODE_ITEM_CLASSES = classes
    try:
        yield
    finally:
        ca.decode_work, ca.DECODE_ITEM_OVERHEAD, ca.DECODE_ITEM_CLASSES = saved
