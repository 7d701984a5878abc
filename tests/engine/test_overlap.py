"""Overlapped steps (``EngineConfig.overlap_steps``) against the serial loop, on a real daemon (CPU backend).

The serial loop reads each step's tokens before it plans the next; the overlapped one plans decode steps ahead
with tokens of unknown id.  Both must give every request the same tokens and the same end, whatever the
sampling, stop tokens, arrivals, aborts and pool pressure; steps must really be planned ahead.
``KVPOOL_OVERLAP_EXAMPLES`` sets how many workloads hypothesis draws (12 by default, for CI's time; a longer run
is one variable away).
"""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from daemonlib import Daemon
from hf_models import make_model

import kvpool.engine as ke

pytestmark = pytest.mark.timeout(900)


@pytest.fixture(scope="module")
def llama():
    return make_model("llama")


def prompt(n: int, seed: int) -> list[int]:
    return torch.randint(1, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@st.composite
def workloads(draw):
    n = draw(st.integers(1, 7))
    reqs = []
    for i in range(n):
        sampled = draw(st.booleans())
        params = dict(max_tokens=draw(st.integers(1, 14)), temperature=0.9 if sampled else 0.0, seed=i,
                      top_k=draw(st.sampled_from([0, 5])) if sampled else 0)
        reqs.append((prompt(draw(st.integers(1, 40)), draw(st.integers(0, 10**6))), params,
                     draw(st.integers(0, 6)),  # arrival step
                     draw(st.one_of(st.none(), st.integers(0, 5)))))  # stop at this output index (None: never)
    config = dict(max_num_seqs=draw(st.integers(1, 6)), max_num_batched_tokens=draw(st.sampled_from([16, 64])),
                  flush_every=draw(st.sampled_from([2, 5, 32])))
    pool_blocks = draw(st.sampled_from([12, 40, 400]))
    return reqs, config, pool_blocks


def play(llama, socket, name, reqs, config, overlap, aborts=None, syncs=None):
    """Step one engine by hand through ``reqs``; (final outputs, engine stats).  ``syncs``: a list that gets,
    for each time the client makes the device's writes visible to the daemon, whether a step was in flight."""
    eng = ke.Engine.connect(llama, socket, name=name, model_id=name, block_size=8,
                            config=ke.EngineConfig(**config, overlap_steps=overlap))
    if syncs is not None:
        mapping, sync = eng.client._mapping, eng.client._mapping.sync_device
        mapping.sync_device = lambda: (syncs.append(eng.step_loop._in_flight is not None), sync())[1]
    try:
        streams, step = {}, 0
        while len(streams) < len(reqs) or not all(s.last and s.last.finished for s in streams.values()):
            for i, (ids, params, arrival, _) in enumerate(reqs):
                if arrival == step:
                    streams[i] = eng.add_request(ids, ke.SamplingParams(**params), request_id=f"q{i}")
                if aborts and aborts.get(i) == step and i in streams:
                    eng.abort(f"q{i}")
            eng.step()
            step += 1
            assert step < 2000, "requests did not finish"
        return [streams[i].result() for i in range(len(reqs))], eng.stats()
    finally:
        eng.close()


EXAMPLES = int(os.environ.get("KVPOOL_OVERLAP_EXAMPLES", "12"))


@settings(max_examples=EXAMPLES, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(workloads(), st.data())
def test_overlapped_steps_give_the_serial_loops_tokens(llama, workload, data):
    reqs, config, pool_blocks = workload
    block_bytes = 8 * 2 * 2 * 2 * 16 * 4  # 8 tokens of the tiny Llama (2 layers, K and V, 2 heads of 16, float32)
    daemon = Daemon("--pool-bytes", str(pool_blocks * block_bytes), "--chunk-bytes", str(block_bytes)).start()
    try:
        compare_loops(llama, daemon, reqs, config, data)
    finally:
        daemon.stop()


def compare_loops(llama, daemon, reqs, config, data):
    free_run, _ = play(llama, daemon.socket, "probe", reqs, config, overlap=False)
    # stop tokens the requests really draw: a request that was to stop at output k stops at its k-th token
    with_stops = []
    for (ids, params, arrival, stop_at), out in zip(reqs, free_run):
        stops = [out.token_ids[stop_at]] if stop_at is not None and stop_at < len(out.token_ids) else []
        with_stops.append((ids, {**params, "stop_token_ids": stops}, arrival, stop_at))
    serial, _ = play(llama, daemon.socket, "serial", with_stops, config, overlap=False)
    overlapped, stats = play(llama, daemon.socket, "overlapped", with_stops, config, overlap=True)
    for i, (a, b) in enumerate(zip(serial, overlapped)):
        assert (b.token_ids, b.finish_reason, b.error) == (a.token_ids, a.finish_reason, a.error), f"request {i}"
    assert stats.running == stats.waiting == 0

    # aborts land at other steps in the two loops: an aborted request's tokens are a prefix of the serial ones
    aborts = {i: data.draw(st.integers(0, 12), label=f"abort {i}") for i in range(len(reqs)) if data.draw(
        st.booleans(), label=f"aborts {i}")}
    aborted, _ = play(llama, daemon.socket, "aborted", with_stops, config, overlap=True, aborts=aborts)
    for i, (a, b) in enumerate(zip(serial, aborted)):
        if b.finish_reason == "abort":
            assert i in aborts and a.token_ids[:len(b.token_ids)] == b.token_ids, f"request {i}"
        else:
            assert (b.token_ids, b.finish_reason) == (a.token_ids, a.finish_reason), f"request {i}"


def test_a_steady_decode_is_planned_ahead_and_a_stop_drops_the_token_computed_ahead(llama, daemon):
    config = dict(max_num_seqs=4, max_num_batched_tokens=64, flush_every=32)
    reqs = [(prompt(9 + i, i), dict(max_tokens=20, temperature=0.0), 0, None) for i in range(3)]
    reqs.append((prompt(12, 3), dict(max_tokens=6, temperature=0.0), 4, None))  # joins a step planned ahead
    probe, _ = play(llama, daemon.socket, "probe", reqs, config, overlap=False)
    drawn = probe[1].token_ids
    at = next(k for k in range(3, len(drawn)) if drawn[k] not in drawn[:k])  # its first time, mid-decode
    reqs[1] = (reqs[1][0], dict(max_tokens=20, temperature=0.0, stop_token_ids=[drawn[at]]), 0, None)
    serial, s_stats = play(llama, daemon.socket, "serial", reqs, config, overlap=False)
    syncs = []
    overlapped, o_stats = play(llama, daemon.socket, "overlapped", reqs, config, overlap=True, syncs=syncs)
    assert [o.token_ids for o in overlapped] == [o.token_ids for o in serial]
    assert overlapped[1].finish_reason == "stop" and len(overlapped[1].token_ids) == at + 1
    # no daemon call that says blocks are written (on a GPU: a synchronize) while a step is queued on the device
    assert syncs and not any(syncs), syncs
    assert len(overlapped[0].token_ids) == len(overlapped[2].token_ids) == 20 and len(overlapped[3].token_ids) == 6
    assert s_stats.steps_ahead == 0
    # every step is planned ahead but the first prefill, the last read and one read when the reserve runs low
    # (a Step tops it up): neither the late prompt (one Create, no Step) nor the stop and its free break the run
    # (the others go on from the last step's sampled ids)
    assert o_stats.steps_ahead >= o_stats.steps - 3, o_stats


@pytest.mark.parametrize("setting, overlaps", [(None, False), (True, True), (False, False)])
def test_overlap_follows_the_setting_and_is_off_by_default_on_the_cpu(llama, daemon, setting, overlaps):
    """The default (``None``) overlaps only on a GPU: here the forward runs on the cores the host work would use."""
    assert ke.EngineConfig().overlap_steps is None
    eng = ke.Engine.connect(llama, daemon.socket, name=f"overlap-{setting}", model_id="overlap-setting", block_size=8,
                            config=ke.EngineConfig(overlap_steps=setting))
    try:
        assert eng.step_loop.overlap is overlaps
    finally:
        eng.close()
