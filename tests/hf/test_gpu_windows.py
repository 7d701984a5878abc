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

from hf_models import eager_copy, start_daemon
from test_sliding_softcap import BUILDERS, check_fp8_close, check_windowed_batch, make, tokens

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
    with paged(model, gpu_pool, f"gpu-{arch}-window") as pm:
        check_windowed_batch(pm, ref, atol=2e-3, rtol=1e-3)


@torch.no_grad()
def test_gpu_fp8_pool_close_to_bfloat16_pool(gpu_pool):
    model = make("gemma2", seed=1, **GPU_SHAPE).to(device="cuda", dtype=torch.bfloat16)
    prompts = [tokens(n, seed=10 + i) for i, n in enumerate((21, 6, 40))]
    check_fp8_close(lambda name, **kw: paged(model, gpu_pool, f"gpu-gemma2-{name}", **kw), prompts)
