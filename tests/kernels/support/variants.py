"""The kernel variants the GPU and emulated tests run, by name: the shipped ones
(``cuda_attention.VARIANTS``) and the benchmark-only ones of
``benchmarks/kernel_variants.py``. The latter force, whatever the shape, each choice the
planner makes per shape (rows per prefill CTA, the warpgroup-MMA prefill, the merge by
counter), so that small test shapes reach every path of the shipped kernels. The tests
pass ``pipelines(name)`` as ``variant=``."""

import re

from benchmarks import kernel_variants
from kvpool.kernels import cuda_attention


def _version(name: str) -> tuple[int, str]:
    """v7 < v7a < v9 < v10 < v10f: where variants share a pipeline, the earliest names it."""
    return int(re.match(r"v(\d+)", name)[1]), name


def pipelines(name: str | None) -> cuda_attention.Variant | None:
    """What a test passes as ``variant=`` for the variant ``name`` (None: the defaults)."""
    return None if name is None else kernel_variants.get(name)


ALL = sorted(kernel_variants.names(), key=_version)
# variants that differ in their decode / prefill pipeline (v7m1 / v7m2 / v7w8 decode exactly like v7)
DECODE = sorted({pipelines(v).decode: v for v in reversed(ALL)}.values(), key=_version)
PREFILL = sorted({pipelines(v).prefill: v for v in reversed(ALL)}.values(), key=_version)
# The variants whose pipelines ship (what the planner picks without a variant, v9's prefill
# where v10's persistent one is not picked): the emulated tests run these under both cp.async
# orders, the rest under one (CI time). Page-aware decode runs the fixed grid (AUTO_DECODE)
# for one sequence and for even batches.
_SHIPPED = cuda_attention.VARIANTS.values()
SHIPPED_DECODE = sorted({v for v in DECODE if pipelines(v).decode in {*(s.decode for s in _SHIPPED),
                                                                      cuda_attention.AUTO_DECODE}}, key=_version)
SHIPPED_PREFILL = sorted({v for v in PREFILL if pipelines(v).prefill in {*(s.prefill for s in _SHIPPED),
                                                                        cuda_attention.DEDICATED}}, key=_version)
# What the emulated tests run. Benchmark-only variants that the emulator cannot tell from a
# shipped path are left to the GPU tests: v5's decode is v7's with three stages (what the
# planner picks on the emulator's small shapes), v7a's decode merges by counter as v9 does,
# and v8f's and v10's prefill, with no warpgroup MMA on the emulator, fall back to v8's.
EMULATED_DECODE = [v for v in DECODE if v not in ("v5", "v7a")]
EMULATED_PREFILL = [v for v in PREFILL if v not in ("v8f", "v10", "v10f")]
