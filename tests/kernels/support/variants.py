"""The kernel variants the GPU and emulated tests run: the shipped ones
(``cuda_attention.VARIANTS``) and the benchmark-only ones of
``benchmarks/kernel_variants.py``, registered here. The latter force, whatever the shape,
each choice the planner makes per shape (rows per prefill CTA, the warpgroup-MMA prefill,
the merge by counter), so that small test shapes reach every path of the shipped kernels."""

from benchmarks import kernel_variants
from kvpool.kernels import cuda_attention

ALL = kernel_variants.register()
# variants that differ in their decode / prefill pipeline (v7m1 / v7m2 / v7w8 decode exactly like v7)
DECODE = sorted({cuda_attention.VARIANTS[v][0]: v for v in reversed(ALL)}.values())
PREFILL = sorted({cuda_attention.VARIANTS[v][1]: v for v in reversed(ALL)}.values())
