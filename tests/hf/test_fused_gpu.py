"""kvpool.fused on the GPU: the Triton kernels against their torch reference, fused against unfused forwards.

Run on a machine with an NVIDIA GPU:  bash scripts/gpu_tests.sh tests/hf/test_fused_gpu.py

Tolerances as tests/hf/test_gpu.py: float32 tokens equal and logits within
``atol=2e-3, rtol=1e-3`` of the unfused forward; bfloat16 teacher-forced
against the float32 weights, max logit error <= 1.5x transformers' eager
bfloat16 error + 0.05.  The kernels alone: float32 to 1e-5, bfloat16 to a
few units of its last place.
"""

from __future__ import annotations

import pytest
import torch

from hf_models import ARCHS, make_model, start_daemon, teacher_forced_errors

import kvpool.engine as ke
import kvpool.fused
import kvpool.hf as kvpool_hf
from kvpool.fused import ops

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(600),
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
SHAPE = dict(hidden_size=256, intermediate_size=512)  # head_dim 64, the smallest the GPU kernels take


@pytest.fixture(scope="module")
def gpu_pool(request):
    return start_daemon(request, "--backend", "cuda", "--pool-bytes", "1GiB", "--chunk-bytes", "2MiB")


def tokens(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, 256, (n,), generator=g).tolist()


def paged(model, pool, model_id: str):
    return kvpool_hf.PagedModel.connect(model, pool.socket, name=model_id, model_id=model_id)


def cpu_reference(fn, *args):
    """``fn``'s torch path on float64 copies of the CUDA inputs (the CPU takes it), back in float32."""
    out = fn(*[a.cpu().double() if isinstance(a, torch.Tensor) and a.is_floating_point() else
               a.cpu() if isinstance(a, torch.Tensor) else a for a in args])
    return [o.float() for o in (out if isinstance(out, tuple) else (out,))]


def assert_near(got, want, dtype):
    got = [g.float().cpu() for g in (got if isinstance(got, tuple) else (got,))]
    for g, w in zip(got, want, strict=True):
        assert torch.isfinite(g).all()
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(g, w, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 37])
def test_kernels_match_the_torch_reference(dtype, rows):
    g = torch.Generator(device="cuda").manual_seed(rows)
    rnd = lambda *s: torch.randn(*s, generator=g, device="cuda").to(dtype)  # noqa: E731
    x, res, w = rnd(rows, 4096), rnd(rows, 4096), rnd(4096)
    for residual in (res, None):
        assert_near(ops.add_rms_norm(x, residual, w, 1e-5), cpu_reference(ops.add_rms_norm, x, residual, w, 1e-5),
                    dtype)
    gu = rnd(rows, 2 * 1536)
    assert_near(ops.silu_and_mul(gu), cpu_reference(ops.silu_and_mul, gu), dtype)
    hq, hkv, d = 8, 2, 128
    qkv = rnd(rows, (hq + 2 * hkv) * d)
    pos = torch.randint(0, 300, (rows,), generator=g, device="cuda")
    angle = torch.rand(300, d // 2, generator=g, device="cuda") * 6
    cos, sin = angle.cos().to(dtype), angle.sin().to(dtype)
    assert_near(ops.rotary_split(qkv, pos, cos, sin, hq, hkv, d),
                cpu_reference(ops.rotary_split, qkv, pos, cos, sin, hq, hkv, d), dtype)


@pytest.mark.parametrize("arch", ARCHS)
def test_fused_float32_matches_unfused(gpu_pool, arch):
    model = make_model(arch, device="cuda", **SHAPE)
    prompts = [tokens(n, seed=i) for i, n in enumerate([16, 37, 5, 64])]
    with paged(model, gpu_pool, f"gpu-unfused-{arch}") as pm:
        want = pm.generate(prompts, max_new_tokens=10, output_logits=True)
    with paged(model, gpu_pool, f"gpu-fused-{arch}") as pm:
        assert kvpool.fused.install(pm, max_positions=512)
        got = pm.generate(prompts, max_new_tokens=10, output_logits=True)
    assert got.tokens == want.tokens
    for g, w in zip(got.logits, want.logits):
        torch.testing.assert_close(g, w, atol=2e-3, rtol=1e-3)


@pytest.mark.parametrize("arch", ARCHS)
def test_fused_bfloat16_error_is_transformers_own(gpu_pool, arch):
    model = make_model(arch, dtype=torch.bfloat16, device="cuda", **SHAPE)
    prompts = [tokens(n, seed=60 + i) for i, n in enumerate([16, 37, 5])]
    with paged(model, gpu_pool, f"gpu-fused-bf16-{arch}") as pm:
        assert kvpool.fused.install(pm, max_positions=512)
        ours, eager = teacher_forced_errors(pm, model, prompts)
    print(f"[fused] {arch} bf16 teacher-forced max |logit - fp32|: fused {ours:.3f}, eager {eager:.3f}")
    assert ours <= 1.5 * eager + 0.05


def test_engine_graphs_with_fused_layers_match_without(gpu_pool):
    """Decode steps replayed as CUDA graphs of the fused forward give the unfused engine's greedy tokens."""
    model = make_model("llama", device="cuda", **SHAPE)
    prompts = [tokens(n, seed=80 + i) for i, n in enumerate([5, 40, 17, 3, 64, 9, 33, 21, 12, 50, 7])]
    params = ke.SamplingParams(max_tokens=12, temperature=0)
    outs = {}
    for fused in (False, True):
        cfg = ke.EngineConfig(max_num_seqs=16, max_num_batched_tokens=64, max_model_len=256, fused_layers=fused)
        with ke.Engine.connect(model, gpu_pool.socket, name=f"gpu-fused-engine-{fused}",
                               model_id=f"gpu-fused-engine-{fused}", config=cfg) as eng:
            assert (eng.model.fused is not None) == fused
            eng.warm_up()
            outs[fused] = [list(r.token_ids) for r in eng.generate(prompts, params)]
    assert outs[True] == outs[False]
