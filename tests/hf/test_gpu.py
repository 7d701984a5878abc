"""On the GPU: transformers models through kvpool's CUDA backend match transformers' eager path.

Run on a machine with an NVIDIA GPU:  python3 -m pytest -q -s -m gpu tests/hf

The daemon holds the pool in device memory (CUDA IPC); attention runs in
kvpool's CUDA kernels (CuPy).  Models have head_dim 64 (the GPU kernels take
64/128/256) and block size 16.  Tolerances:

* float32: tokens equal; logits within ``atol=2e-3, rtol=1e-3`` of eager
  float32 (cuBLAS, no TF32).  The float32 kernel multiplies with bfloat16
  hi+lo splits (about 16 mantissa bits), not full float32.
* bfloat16: teacher-forced against the float32 weights (``teacher_forced_errors``):
  kvpool's max logit error must be at most 1.5x transformers' eager bfloat16
  error + 0.05 (seen on the CPU kernels: 0.44 vs eager's 0.64, logits ~13).

``KVPOOL_HF_TEST_DEVICE=cpu`` runs this file against the CPU backend (to check
the test itself without a GPU).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hf_models import ARCHS, eager_copy, make_model, reference_generate, start_daemon, teacher_forced_errors

import kvpool.hf as kvpool_hf  # after hf_models, which skips the module without transformers

DEVICE = os.environ.get("KVPOOL_HF_TEST_DEVICE", "cuda")
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(DEVICE == "cuda" and not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
DAEMON_ARGS = ("--backend", "cuda", "--pool-bytes", "1GiB", "--chunk-bytes", "2MiB") if DEVICE == "cuda" else ()
SHAPE = dict(hidden_size=256, intermediate_size=512)  # 4 query heads, 2 KV heads, head_dim 64
ROOT = Path(__file__).resolve().parents[2]


def tokens(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, 256, (n,), generator=g).tolist()


@pytest.fixture(scope="module")
def gpu_pool(request):
    return start_daemon(request, *DAEMON_ARGS)


@pytest.fixture(scope="module", params=ARCHS)
def models(request):
    model = make_model(request.param, device=DEVICE, **SHAPE)
    return request.param, model, eager_copy(model)


def paged(model, pool, model_id: str):
    pm = kvpool_hf.PagedModel.connect(model, pool.socket, name=model_id, model_id=model_id, block_size=16)
    assert pm.kv.device.type == DEVICE
    return pm


def check(tag, ref, prompt, got_tokens, got_logits, n, atol=2e-3, rtol=1e-3):
    want_tokens, want_logits = reference_generate(ref, prompt, n)
    diff = (got_logits - want_logits).abs().max().item()
    print(f"[hf-{DEVICE}] {tag} prompt {len(prompt)}: tokens equal {got_tokens == want_tokens}, "
          f"max |logit diff| {diff:.2e} (max |logit| {want_logits.abs().max().item():.2f})")
    assert got_tokens == want_tokens
    torch.testing.assert_close(got_logits, want_logits, atol=atol, rtol=rtol)


def test_gpu_mixed_batch_matches_eager(gpu_pool, models):
    arch, model, ref = models
    prompts = [tokens(n, seed=i) for i, n in enumerate([16, 32, 19, 28, 5])]
    with paged(model, gpu_pool, f"gpu-{arch}-mixed") as pm:
        gen = pm.generate(prompts, max_new_tokens=10, output_logits=True)
    for p, t, lg in zip(prompts, gen.tokens, gen.logits):
        check(f"{arch} fp32 mixed", ref, p, t, lg, 10)


def test_gpu_cached_prefix_and_fork(gpu_pool, models):
    arch, model, ref = models
    system = tokens(40, seed=10)
    first, other = system + tokens(8, seed=11), system + tokens(7, seed=12)
    with paged(model, gpu_pool, f"gpu-{arch}-prefix") as pm:
        pm.generate([first], max_new_tokens=4)
    with paged(model, gpu_pool, f"gpu-{arch}-prefix") as pm:
        gen = pm.generate([other, first], max_new_tokens=6, output_logits=True)
        assert gen.num_cached_tokens == [32, 48]
        check(f"{arch} fp32 cached-prefix", ref, other, gen.tokens[0], gen.logits[0], 6)
        check(f"{arch} fp32 fully-cached", ref, first, gen.tokens[1], gen.logits[1], 6)
        (seq,), logits = pm.prefill([other])  # 47 tokens: a partly filled, shared tail after the fork
        a, b = logits[0].topk(2).indices.tolist()
        child = pm.fork(seq)
        fork = pm.continue_greedy([seq, child], [a, b], max_new_tokens=7, output_logits=True)
        pm.free([seq, child])
    for first_tok, t, lg in zip((a, b), fork.tokens, fork.logits):
        assert t[0] == first_tok
        check(f"{arch} fp32 fork", ref, other + [first_tok], t[1:], lg, 6)


def test_gpu_bfloat16_no_worse_than_eager(daemon_factory):
    pool = daemon_factory(*DAEMON_ARGS)  # a second layout class: its own daemon on the CUDA backend
    for arch in ARCHS:
        model = make_model(arch, dtype=torch.bfloat16, device=DEVICE, **SHAPE)
        prompts = [tokens(n, seed=60 + i) for i, n in enumerate([16, 37, 5])]
        with paged(model, pool, f"gpu-{arch}-bf16") as pm:
            ours, eager = teacher_forced_errors(pm, model, prompts)
        print(f"[hf-{DEVICE}] {arch} bf16 teacher-forced max |logit - fp32|: kvpool {ours:.3f}, eager {eager:.3f}")
        assert ours <= 1.5 * eager + 0.05


def test_gpu_two_processes_share_the_prefix(gpu_pool):
    """examples/hf_shared_prefix.py on the CUDA daemon: B maps A's blocks over CUDA IPC."""
    out = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "hf_shared_prefix.py"), "--socket", gpu_pool.socket,
         "--check", "--json", "--max-new-tokens", "8"],
        capture_output=True, text=True, timeout=240, cwd=ROOT,
    )
    assert out.returncode == 0, out.stderr[-4000:]
    print("\n".join(out.stdout.splitlines()[:3]))
    a, b = json.loads(out.stdout.strip().splitlines()[-1])["workers"]
    assert a["cached_tokens"] == 0 and b["cached_tokens"] > 0
    assert a["matches_eager"] is True and b["matches_eager"] is True
