"""kvpool.engine against transformers over generated scenarios: pools too small for the batch, lower tiers,
preemption by swap and by recompute, prefix hits, aborts, staggered arrivals, reserve and flush settings.

Each request's greedy tokens must equal transformers' ``generate`` on that prompt alone (float32); a
failure shrinks to a small scenario that hypothesis prints.  ``KVPOOL_DIFF_EXAMPLES`` sets how many
scenarios each test draws (CI's default keeps the file within a few minutes; raise it for a long run).
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, replace
from types import SimpleNamespace

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from daemonlib import Daemon
from differential import (Oracle, Req, Scenario, TempDaemon, check_outputs, check_pool_clean, check_scenario,
                          run_engine, scenarios)
from hf_models import eager_copy, make_model

import kvpool.engine as ke

EXAMPLES = int(os.environ.get("KVPOOL_DIFF_EXAMPLES", "20"))
DIFF = settings(max_examples=EXAMPLES, deadline=None, print_blob=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

pytestmark = pytest.mark.timeout(1800)


@pytest.fixture(scope="module")
def llama():
    model = make_model("llama")
    return model, Oracle(eager_copy(model))


def random_prompts(seed: int, n: int, lo: int, hi: int) -> tuple[Req, ...]:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(lo, hi + 1, (n,), generator=g).tolist()
    return tuple(Req(tuple(torch.randint(1, 256, (k,), generator=g).tolist()), 12) for k in lens)


#: a group of prompts admitted in one Create that the pool cannot hold all of: the failed all-or-none
#: create once left its never-written blocks behind as prefix hits for the same prompts admitted one by one
GROUP_CREATE_OVERFLOW = Scenario(block_size=16, pool_blocks=24, host_blocks=0, disk_blocks=0, max_num_seqs=12,
                                 max_num_batched_tokens=1024, flush_every=32, max_reserve_blocks=1024,
                                 requests=random_prompts(1, 8, 40, 64))


@DIFF
@example(GROUP_CREATE_OVERFLOW)
@given(scenarios())
def test_engine_tokens_equal_transformers_under_pressure(llama, scenario):
    check_scenario(*llama, scenario)


@settings(max_examples=max(3, EXAMPLES // 4), deadline=None, print_blob=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(prompt_len=st.integers(1, 40), block_size=st.sampled_from([8, 16]),
       continuations=st.lists(st.lists(st.integers(1, 255), min_size=1, max_size=10), min_size=1, max_size=3),
       parent_tail=st.lists(st.integers(1, 255), min_size=0, max_size=6), seed=st.integers(0, 2**16))
def test_forks_write_their_own_copy_of_a_shared_tail(llama, prompt_len, block_size, continuations, parent_tail,
                                                     seed):
    """Forks of one prompt continue with different tokens in one batch (copy-on-write of a partly filled
    shared block); every sequence's logits equal transformers' full forward on its own tokens."""
    from kvpool.hf import PagedModel

    model, oracle = llama
    prompt = torch.randint(1, 256, (prompt_len,), generator=torch.Generator().manual_seed(seed)).tolist()
    d = Daemon("--pool-bytes", "256KiB", "--chunk-bytes", "8KiB").start()
    try:
        with PagedModel.connect(model, d.socket, name="fork", model_id="diff-llama", block_size=block_size) as pm:
            (parent,), _ = pm.prefill([prompt])
            children = [pm.fork(parent) for _ in continuations]
            seqs, news = [parent, *children], [parent_tail or [1], *continuations]
            width = max(map(len, news))
            for j in range(width):  # one token each per step: every sequence appends into the shared tail
                live = [(s, n[j]) for s, n in zip(seqs, news) if j < len(n)]
                logits = pm.forward([s for s, _ in live], [t for _, t in live])
                for (s, _), row in zip(live, logits):
                    k = next(i for i, x in enumerate(seqs) if x is s)
                    full = prompt + news[k][:j + 1]
                    want = oracle.ref(input_ids=torch.tensor([full])).logits[0, -1]
                    torch.testing.assert_close(row.float(), want, rtol=1e-4, atol=1e-4)
            pm.free(seqs)
        check_pool_clean(d.socket)
    finally:
        d.stop()


def test_a_prompt_the_pool_can_never_hold_fails_alone_and_at_once(llama, daemon_factory):
    """A prompt longer than the whole pool ends with a clear error; the requests beside it are unaffected."""
    model, oracle = llama
    scenario = Scenario(block_size=8, pool_blocks=6, host_blocks=0, disk_blocks=0, max_num_seqs=4,
                        max_num_batched_tokens=64, flush_every=4, max_reserve_blocks=2,
                        requests=(Req(tuple(range(1, 61)), 4), *random_prompts(7, 3, 5, 12)))
    with TempDaemon(Daemon, scenario) as d:
        outputs, max_blocks = run_engine(model, d.socket, scenario)
        check_pool_clean(d.socket)
    assert max_blocks == 6
    assert outputs[0].finish_reason == "error" and "does not fit" in outputs[0].error and not outputs[0].token_ids
    check_outputs(scenario, outputs, oracle, max_blocks)
    assert [outputs[i].finish_reason for i in (1, 2, 3)] == ["length"] * 3


def test_engine_returns_its_reserve_when_a_lone_prompt_needs_every_block(llama):
    """The session's reserve holds free blocks the engine's next create needs: it gives them back."""
    model, oracle = llama
    small = Req(tuple(range(1, 9)), 2)
    whole = Req(tuple(range(10, 10 + 8 * 8 - 1)), 1, arrival=6)  # every block of the pool
    scenario = Scenario(block_size=8, pool_blocks=8, host_blocks=0, disk_blocks=0, max_num_seqs=2,
                        max_num_batched_tokens=64, flush_every=32, max_reserve_blocks=1024,
                        requests=(small, whole))
    with TempDaemon(Daemon, scenario) as d:
        outputs, max_blocks = run_engine(model, d.socket, scenario)
        check_pool_clean(d.socket)
    check_outputs(scenario, outputs, oracle, max_blocks)
    assert outputs[1].finish_reason == "length"


def test_a_failed_forward_leaves_no_prefix_hits_behind(llama, daemon_factory, monkeypatch):
    """A step whose forward raises ends its requests with an error and frees their blocks as unwritten:
    the same prompt, asked again, finds nothing cached and gets transformers' tokens."""
    model, oracle = llama
    d = daemon_factory("--pool-bytes", "256KiB", "--chunk-bytes", "8KiB")
    prompt = list(range(3, 3 + 40))
    eng = ke.Engine.connect(model, d.socket, name="boom", model_id="diff-llama", block_size=8,
                            config=ke.EngineConfig(max_num_seqs=2, max_num_batched_tokens=64))
    try:
        real = eng.runner.forward

        def failing(*args, **kw):
            raise RuntimeError("injected: the forward stopped before writing K/V")

        monkeypatch.setattr(eng.runner, "forward", failing)
        first = eng.generate([prompt], ke.SamplingParams(max_tokens=3, temperature=0))[0]
        assert first.finish_reason == "error" and "injected" in first.error
        monkeypatch.setattr(eng.runner, "forward", real)
        again = eng.generate([prompt], ke.SamplingParams(max_tokens=3, temperature=0))[0]
    finally:
        eng.close()
    assert again.num_cached_tokens == 0
    assert list(again.token_ids) == oracle.tokens(prompt, 3)
    check_pool_clean(d.socket)


class Worker:
    """``engine_worker.py`` in its own process: a second model process on the scenario's daemon."""

    def __init__(self) -> None:
        import subprocess
        import sys
        from pathlib import Path

        self.proc = subprocess.Popen([sys.executable, str(Path(__file__).with_name("engine_worker.py"))],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert json.loads(self.proc.stdout.readline()) == {"ready": True}

    def send(self, socket: str, scenario: Scenario, prefix: str) -> None:
        self.proc.stdin.write(json.dumps({"socket": socket, "scenario": asdict(scenario), "prefix": prefix}) + "\n")
        self.proc.stdin.flush()

    def receive(self) -> dict:
        return json.loads(self.proc.stdout.readline())

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(60)


def worker_outputs(reply: dict):
    """(outputs by index, the session's max blocks) of a worker's reply; a worker's exception fails the test."""
    assert "exception" not in reply, reply
    return {int(i): SimpleNamespace(**o) for i, o in reply["outputs"].items()}, reply["max_blocks"]


@pytest.fixture(scope="module")
def workers():
    ws = [Worker(), Worker()]
    yield ws
    for w in ws:
        w.close()


@settings(max_examples=max(2, EXAMPLES // 5), deadline=None, print_blob=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(scenarios(max_requests=5), st.data())
def test_engines_in_three_processes_share_one_pool(llama, workers, scenario, data):
    """This process and two others each run an engine on one daemon; their requests (drawn alike, some
    with the same prompts, so prefix hits cross processes) compete for one pool."""
    from differential import requests

    model, oracle = llama
    others = [replace(scenario, requests=data.draw(requests(5), label=f"worker {k} requests")) for k in range(2)]
    biggest = max(scenario.blocks_needed(r) for s in [scenario, *others] for r in s.requests)
    scenario = replace(scenario, pool_blocks=max(scenario.pool_blocks, biggest))  # each fits once the others end
    others = [replace(o, pool_blocks=scenario.pool_blocks) for o in others]
    with TempDaemon(Daemon, scenario) as d:
        for k, (w, s) in enumerate(zip(workers, others)):
            w.send(d.socket, s, f"w{k}-")
        try:
            outputs, max_blocks = run_engine(model, d.socket, scenario, prefix="main-")
        finally:
            replies = [w.receive() for w in workers]  # every worker is done with this daemon before it stops
        check_pool_clean(d.socket)
    check_outputs(scenario, outputs, oracle, max_blocks)
    for s, reply in zip(others, replies):
        outs, ceiling = worker_outputs(reply)
        check_outputs(s, outs, oracle, ceiling)
