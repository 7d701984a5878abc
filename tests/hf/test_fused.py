"""kvpool.fused on the CPU: the fused Llama / Qwen2 forward gives transformers' logits, without Triton.

The fused forward runs the torch versions of its elementwise steps here
(``kvpool.fused.ops``), which round where transformers does, so float32
logits agree with the unfused PagedModel within ``1e-4`` (as in
test_generate.py: only the summation order of the merged matmuls differs) and
the greedy tokens are equal.  The Triton kernels: tests/hf/test_fused_gpu.py.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from hf_models import ARCHS, make_model, start_daemon

import kvpool.engine as ke
import kvpool.fused
import kvpool.hf as kvpool_hf
from kvpool.errors import InvalidArgument

ATOL = RTOL = 1e-4


@pytest.fixture(scope="module")
def pool(request):
    return start_daemon(request)


def tokens(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, 256, (n,), generator=g).tolist()


def paged(model, pool, model_id: str):
    return kvpool_hf.PagedModel.connect(model, pool.socket, name=model_id, model_id=model_id, block_size=8)


@pytest.mark.parametrize("arch", ARCHS)
def test_fused_forward_matches_transformers_layers(pool, arch):
    model = make_model(arch)
    prompts = [tokens(n, seed=i) for i, n in enumerate([8, 19, 3, 12])]
    with paged(model, pool, f"fused-ref-{arch}") as pm:
        want = pm.generate(prompts, max_new_tokens=8, output_logits=True)
    with paged(model, pool, f"fused-{arch}") as pm:
        assert kvpool.fused.install(pm, max_positions=512)
        # the merged weights are views: transformers' modules still read the very same values
        attn = model.model.layers[0].self_attn
        assert attn.k_proj.weight.untyped_storage().data_ptr() == attn.q_proj.weight.untyped_storage().data_ptr()
        got = pm.generate(prompts, max_new_tokens=8, output_logits=True)
    assert got.tokens == want.tokens
    for g, w in zip(got.logits, want.logits):
        torch.testing.assert_close(g, w, atol=ATOL, rtol=RTOL)


def test_engine_with_fused_layers_matches_without(pool):
    model = make_model("llama")
    prompts = [tokens(n, seed=10 + i) for i, n in enumerate([5, 17, 30, 9, 2])]
    params = ke.SamplingParams(max_tokens=10, temperature=0)
    outs = {}
    for fused in (False, True):
        cfg = ke.EngineConfig(max_num_seqs=4, max_num_batched_tokens=16, max_model_len=128, fused_layers=fused)
        with ke.Engine.connect(model, pool.socket, name=f"fused-engine-{fused}", model_id=f"fused-engine-{fused}",
                               config=cfg) as eng:
            assert (eng.model.fused is not None) == fused
            outs[fused] = [list(r.token_ids) for r in eng.generate(prompts, params)]
    assert outs[True] == outs[False]


def test_fused_auto_is_off_on_the_cpu_and_on_refuses_what_it_cannot_run(pool):
    with paged(make_model("llama"), pool, "fused-default") as pm:
        assert not kvpool.fused.install(pm, max_positions=64, mode=None)
        assert pm.fused is None
    gelu = make_model("llama", hidden_act="gelu")
    with paged(gelu, pool, "fused-gelu") as pm:
        with pytest.raises(InvalidArgument, match="activation 'gelu' is not silu"):
            kvpool.fused.install(pm, max_positions=64)
        assert pm.fused is None


def test_the_cpu_path_never_imports_triton(pool):
    """With every import of triton failing, the fused forward still runs on the CPU."""
    script = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(Path(__file__).resolve().parent)!r})

        class NoTriton:
            def find_spec(self, name, path=None, target=None):
                if name == "triton" or name.startswith("triton."):
                    raise ImportError("triton must not be imported on the CPU")

        sys.meta_path.insert(0, NoTriton())
        sys.modules.pop("triton", None)
        from hf_models import make_model
        import kvpool.fused, kvpool.hf
        pm = kvpool.hf.PagedModel.connect(make_model("llama"), {pool.socket!r}, name="no-triton",
                                          model_id="no-triton", block_size=8)
        assert kvpool.fused.install(pm, max_positions=64)
        print(pm.generate([[1, 2, 3, 4, 5]], max_new_tokens=3).tokens)
        pm.close()
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("[[")
