"""The CUDA sources as package data (``kvpool/kernels/cuda/*.cu``) and the variant table
that ships with the planner."""

import re

import pytest

from kvpool.kernels import cuda_attention, cuda_runtime, cuda_source


def test_sources_are_read_behind_their_file_names():
    """NVRTC (through CuPy, which names every program ``kern.cu``) and the emulator's g++
    report errors against the ``.cu`` file and its own line numbers."""
    for name in (cuda_source.PAGED_ATTENTION, cuda_source.PAGED_ATTENTION_SM90, cuda_source.BLOCK_COPY):
        src = cuda_source.read(name)
        assert src.startswith(f'#line 1 "{name}"\n')
        assert "__global__" in src
    assert cuda_runtime.SOURCE == cuda_source.read(cuda_source.PAGED_ATTENTION)
    assert cuda_runtime.SOURCE_SM90 == cuda_source.read(cuda_source.PAGED_ATTENTION_SM90)
    assert cuda_runtime.SOURCE.endswith("\n")  # the sm_90a source is appended to it


def test_sm90_source_declares_the_shape_the_planner_sizes():
    src = cuda_source.read_sm90()
    shape = re.search(r"constexpr int WG_GROUPS = (\d+), WG_KEYS = (\d+), WG_STAGES = (\d+);", src)
    assert tuple(map(int, shape.groups())) == (cuda_source.WG_GROUPS, cuda_source.WG_KEYS, cuda_source.WG_STAGES)


def test_attention_source_declares_the_item_order_classes_the_host_mirrors():
    src = cuda_source.read_attention()
    (n,) = re.findall(r"constexpr int ORDER_CLASSES = (\d+);", src)
    assert int(n) == cuda_source.ORDER_CLASSES == cuda_attention.ORDER_CLASSES
    with pytest.raises(RuntimeError, match="does not declare what cuda_source.py mirrors"):
        cuda_source.read_declaring(cuda_source.PAGED_ATTENTION, f"constexpr int ORDER_CLASSES = {int(n) + 1};")


def test_shipped_variants_are_what_the_defaults_run():
    """The package keeps the variants ``variant=None`` runs, and only those; the others live in
    benchmarks/kernel_variants.py under names of their own."""
    shipped = {cuda_attention.DEFAULT_DECODE_VARIANT, cuda_attention.DEFAULT_PREFILL_VARIANT}
    assert shipped == {"v9", "v10"} == set(cuda_attention.VARIANTS)
    defaults = cuda_attention.variant_pipelines(None)
    assert defaults.decode == cuda_attention.VARIANTS["v9"].decode
    assert defaults.prefill == cuda_attention.VARIANTS["v10"].prefill
    from benchmarks import kernel_variants

    assert not shipped & (set(kernel_variants.EXTRA) | set(kernel_variants.PROBES))
    assert kernel_variants.get("v9") is cuda_attention.VARIANTS["v9"]
    with pytest.raises(ValueError, match="unknown kernel variant 'v7'"):
        cuda_attention.variant_pipelines("v7")  # benchmark-only: passed as a Variant


def _operands(n: int, first: int = 0) -> str:
    return ", ".join(f"%{first + i}" for i in range(n))


def _wgmma_wrappers() -> str:
    """The ``Wg<N, DT>`` specializations as written in paged_attention_sm90.cu: a macro per N
    (``ss``: A and B from shared memory, S = Q K^T; ``ss0``: its first k-step, D only
    written; ``rs``: A from registers, B transposed, O += P V), instantiated per type."""
    out = []
    for n in (64, 128):
        regs = n // 2
        acc = ", ".join(f'"+f"(d[{i}])' for i in range(regs))
        mma = f'            "wgmma.mma_async.sync.aligned.m64n{n}k16.f32." AB "." AB " {{{_operands(regs)}}}, '
        ss_head = f'        asm volatile("{{\\n.reg .pred p;\\nsetp.ne.b32 p, %{regs + 2}, 0;\\n"'
        ss_mma = mma + f'%{regs}, %{regs + 1}, p, 1, 1, 0, 0;\\n}}\\n"'
        fn = "    static __device__ __forceinline__ void"
        lines = [
            f"#define KVPOOL_WG_{n}(DT, AB)",
            f"template <> struct Wg<{n}, DT> {{",
            f"{fn} ss(float (&d)[{regs}], u64 a, u64 b, int accumulate) {{",
            ss_head, ss_mma, f"            : {acc}", '            : "l"(a), "l"(b), "r"(accumulate));',
            "    }",
            f"{fn} ss0(float (&d)[{regs}], u64 a, u64 b) {{",
            ss_head, ss_mma, f'            : {acc.replace("+f", "=f")}', '            : "l"(a), "l"(b), "r"(0));',
            "    }",
            f"{fn} rs(float (&d)[{regs}], u32 a0, u32 a1, u32 a2, u32 a3, u64 b) {{",
            f'        asm volatile("{{\\n.reg .pred p;\\nsetp.ne.b32 p, %{regs + 5}, 0;\\n"',
            mma + f'{{%{regs}, %{regs + 1}, %{regs + 2}, %{regs + 3}}}, %{regs + 4}, p, 1, 1, 1;\\n}}\\n"',
            f"            : {acc}",
            '            : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(b), "r"(1));',
            "    }",
            "};",
        ]
        out.append(" \\\n".join(lines) + "\n")
    for n in (64, 128):
        for dt, ab in ((1, "f16"), (2, "bf16")):
            out.append(f'KVPOOL_WG_{n}({dt}, "{ab}")\n')
    return "".join(out)


def test_wgmma_wrappers_are_the_generated_ones():
    """Inline PTX names every accumulator register, so the ``Wg`` specializations are
    written out in the source; this generator is how they were made (and how to change them)."""
    src = cuda_source.read(cuda_source.PAGED_ATTENTION_SM90)
    assert src.count("template <> struct Wg<") == 2
    assert _wgmma_wrappers() in src
