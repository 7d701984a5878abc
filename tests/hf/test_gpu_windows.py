"""On the GPU: sliding-window, soft-capped and fp8-cached models through kvpool.hf.

Run on a machine with an NVIDIA GPU:  python3 -m pytest -q -m gpu tests/hf/test_gpu_windows.py

The models of test_sliding_softcap.py (Mistral, Qwen2 with sliding layers,
Gemma 2, Gemma 3; 8-token windows) with head_dim 64, on a CUDA daemon.  float32:
tokens equal to transformers' eager ``generate`` and logits within the
tolerances of test_gpu.py (the float32 kernel multiplies bfloat16 hi+lo
splits).  fp8: a bfloat16 Gemma 2 on a ``float8_e4m3fn`` pool, teacher-forced
along the bfloat16 pool's tokens, each step's logits within 0.05 of the spread
(as the CPU test; the GPU kernels read fp8 with a 16-bit query).
"""

from __future__ import annotations

import pytest
import torch

from hf_models import eager_copy, reference_generate, start_daemon
from test_sliding_softcap import BUILDERS, LENGTHS, NEW_TOKENS, make, tokens

import kvpool.hf as kvpool_hf

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
GPU_SHAPE = dict(hidden_size=256, head_dim=64)  # 4 query heads, 2 KV heads of 64: a head_dim the GPU kernels take


@pytest.fixture(scope="module")
def gpu_pool(request):
    return start_daemon(request, "--backend", "cuda", "--pool-bytes", "1GiB", "--chunk-bytes", "2MiB")


def paged(model, pool, model_id: str, **kw):
    pm = kvpool_hf.PagedModel.connect(model, pool.socket, name=model_id, model_id=model_id, block_size=16, **kw)
    assert pm.kv.device.type == "cuda"
    return pm


@pytest.mark.parametrize("arch", list(BUILDERS))
def test_gpu_windowed_batch_matches_eager(gpu_pool, arch):
    model = make(arch, **GPU_SHAPE).cuda()
    ref = eager_copy(model)
    prompts = [tokens(n, seed=i) for i, n in enumerate(LENGTHS)]
    with paged(model, gpu_pool, f"gpu-{arch}-window") as pm:
        gen = pm.generate(prompts, max_new_tokens=NEW_TOKENS, output_logits=True)
    for p, got_tokens, got_logits in zip(prompts, gen.tokens, gen.logits):
        want_tokens, want_logits = reference_generate(ref, p, NEW_TOKENS)
        assert got_tokens == want_tokens
        torch.testing.assert_close(got_logits, want_logits.cpu(), atol=2e-3, rtol=1e-3)


@torch.no_grad()
def test_gpu_fp8_pool_close_to_bfloat16_pool(gpu_pool):
    model = make("gemma2", seed=1, **GPU_SHAPE).to(device="cuda", dtype=torch.bfloat16)
    prompts = [tokens(n, seed=10 + i) for i, n in enumerate((21, 6, 40))]
    steps = 6
    with paged(model, gpu_pool, "gpu-gemma2-bf16-for-fp8") as pm:
        want = pm.generate(prompts, max_new_tokens=steps + 1, output_logits=True)
    with paged(model, gpu_pool, "gpu-gemma2-fp8", kv_dtype="float8_e4m3fn") as pm:
        assert pm.kv.dtype == torch.float8_e4m3fn
        seqs, first = pm.prefill(prompts)
        got = [first.float().cpu()]
        for j in range(steps):  # teacher-forced along the bfloat16 pool's tokens
            got.append(pm.forward(seqs, [t[j] for t in want.tokens]).float().cpu())
        pm.free(seqs)
    got = torch.stack(got, 1)
    for i, w in enumerate(want.logits):
        assert int(got[i, 0].argmax()) == want.tokens[i][0]
        err = (got[i] - w).abs().max().item()
        assert err <= 0.05 * (w.max() - w.min()).item(), err
