"""On the GPU (VMM pool): kvpool.engine against transformers over generated scenarios under memory pressure.

float32: every request's greedy tokens equal transformers' ``generate``.  bfloat16: each token the engine
chose is checked by teacher forcing against the float32 truth, within the spread transformers' own bfloat16
path shows on the same tokens.  And models of three geometries on one daemon, their engines stepping in
turn, compete for one pool.  ``KVPOOL_DIFF_EXAMPLES`` sets the number of scenarios.
"""

from __future__ import annotations

import copy
import os

import pytest
import torch
from hypothesis import HealthCheck, given, settings

from daemonlib import Daemon
from differential import (Oracle, Scenario, TempDaemon, check_outputs, check_pool_clean, check_scenario,
                          connect_engine, play_together, run_engine, scenarios)
from hf_models import COMMON, eager_copy, make_model

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(3600),
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

EXAMPLES = int(os.environ.get("KVPOOL_DIFF_EXAMPLES", "20"))
DIFF = settings(max_examples=EXAMPLES, deadline=None, print_blob=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
CHUNK = 2 << 20
#: head_dim 64 (the smallest the GPU kernels take); 8 layers make a block of 16 tokens 128 KiB in float32,
#: so a 2 MiB chunk holds 16 of them and a few chunks are a tight pool
SHAPE = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=8)


def bytes_per_token(shape: dict, dtype=torch.float32) -> int:
    """K and V of every layer for one token, for ``make_model``'s config with ``shape`` over tests/hf's COMMON."""
    c = {**COMMON, **shape}
    head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    return c["num_hidden_layers"] * 2 * c["num_key_value_heads"] * head_dim * dtype.itemsize


def gpu_scenarios(shape: dict, dtype=torch.float32, **kw):
    return scenarios(max_prompt=200, block_sizes=(16,), bytes_per_token=bytes_per_token(shape, dtype),
                     chunk_bytes=CHUNK, backend="cuda", **kw)


@pytest.fixture(scope="module")
def llama32():
    model = make_model("llama", device="cuda", **SHAPE)
    return model, Oracle(eager_copy(model))


@pytest.fixture(scope="module")
def llama_bf16():
    model = make_model("llama", device="cuda", dtype=torch.bfloat16, **SHAPE)
    truth = copy.deepcopy(eager_copy(model)).float()
    return model, eager_copy(model), truth


@DIFF
@given(scenario=gpu_scenarios(SHAPE))
def test_gpu_engine_tokens_equal_transformers_under_pressure(llama32, scenario):
    check_scenario(*llama32, scenario)


@torch.no_grad()
def check_teacher_forced(truth, eager_bf16, prompt, out) -> None:
    """Each chosen token's float32 logit is within twice bfloat16's own spread of the float32 best."""
    ids = torch.tensor([list(prompt) + list(out.token_ids)], device="cuda")
    n = len(out.token_ids)
    want = truth(input_ids=ids).logits[0, len(prompt) - 1:len(prompt) - 1 + n].float()
    eager = eager_bf16(input_ids=ids).logits[0, len(prompt) - 1:len(prompt) - 1 + n].float()
    spread = (eager - want).abs().max().item()
    chosen = want.gather(1, torch.tensor(list(out.token_ids), device="cuda")[:, None])[:, 0]
    gap = (want.max(1).values - chosen).max().item()
    assert gap <= 2 * spread + 1e-3, f"a chosen token is {gap:.3f} below the best; bfloat16's spread {spread:.3f}"


@settings(max_examples=max(3, EXAMPLES // 2), deadline=None, print_blob=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(scenario=gpu_scenarios(SHAPE, torch.bfloat16))
def test_gpu_bf16_engine_under_pressure_is_within_bf16_spread(llama_bf16, scenario):
    model, eager_bf16, truth = llama_bf16
    with TempDaemon(Daemon, scenario) as d:
        outputs, _ = run_engine(model, d.socket, scenario)
        check_pool_clean(d.socket)
    for i, req in enumerate(scenario.requests):
        out = outputs[i]
        assert out.finish_reason in ("length", "abort") or "does not fit" in (out.error or ""), (req, out)
        if out.token_ids:
            check_teacher_forced(truth, eager_bf16, req.prompt, out)


GEOMETRIES = {  # head_dim 64, 128 and 256 (float32, random weights)
    "hd64": dict(hidden_size=256, intermediate_size=512, num_hidden_layers=8),
    "hd128": dict(hidden_size=512, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4),
    "hd256": dict(hidden_size=512, intermediate_size=512, num_hidden_layers=2, num_attention_heads=2,
                  num_key_value_heads=1, head_dim=256),
}


@pytest.fixture(scope="module")
def three_models():
    out = {}
    for name, shape in GEOMETRIES.items():
        model = make_model("llama", device="cuda", seed=len(out), **shape)
        out[name] = (model, Oracle(eager_copy(model)))
    return out


@settings(max_examples=max(3, EXAMPLES // 4), deadline=None, print_blob=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(scenario=gpu_scenarios(GEOMETRIES["hd64"], max_requests=6))
def test_gpu_three_geometries_share_one_pool_under_pressure(three_models, scenario):
    """Three engines of three layouts on one VMM daemon whose pool is smaller than their need together:
    chunks move between the classes while they run; every request's tokens equal its model's."""
    pool_bytes = 4 * CHUNK  # at least one chunk a class, and a few to move between them
    scenario = Scenario(**{**scenario.__dict__, "pool_blocks": pool_bytes // scenario.block_bytes})
    with TempDaemon(Daemon, scenario) as d:
        engines = [connect_engine(model, d.socket, scenario, name=name, model_id=f"diff-{name}")
                   for name, (model, _) in three_models.items()]
        try:
            outputs = play_together([(eng, scenario.requests) for eng in engines])
            ceilings = [eng.client.max_blocks for eng in engines]
        finally:
            for eng in engines:
                eng.close()
        check_pool_clean(d.socket)
    for (model, oracle), outs, ceiling in zip(three_models.values(), outputs, ceilings):
        check_outputs(scenario, outs, oracle, ceiling)
