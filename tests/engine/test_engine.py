"""kvpool.engine against transformers' eager generate, with a real daemon (CPU backend).

The models are the tiny random-weight Llama / Qwen2 of tests/hf (greedy
margins wide enough that tokens compare exactly).
"""

from __future__ import annotations

import signal

import pytest
import torch

from hf_models import ARCHS, eager_copy, make_model, reference_generate

import kvpool.engine as ke
from kvpool.errors import InvalidArgument

pytestmark = pytest.mark.timeout(120)


def tokens(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, 256, (n,), generator=g).tolist()


@pytest.fixture(scope="module", params=ARCHS)
def models(request):
    model = make_model(request.param)
    return request.param, model, eager_copy(model)


@pytest.fixture(scope="module")
def llama():
    """One architecture, for the tests whose subject is the scheduler rather than the model."""
    model = make_model("llama")
    return "llama", model, eager_copy(model)


def engine(model, daemon, model_id, **cfg):
    config = ke.EngineConfig(**{"max_num_seqs": 8, "max_num_batched_tokens": 32, **cfg})
    return ke.Engine.connect(model, daemon.socket, name=model_id, model_id=model_id, block_size=8, config=config)


GREEDY = ke.SamplingParams(max_tokens=8, temperature=0)


def finish(eng, *streams):
    """Step until every stream's request has ended; their final outputs."""
    for _ in range(1000):
        if all(s.last and s.last.finished for s in streams):
            return [s.result() for s in streams]
        eng.step()
    raise AssertionError("requests did not finish")


def run_staggered(eng, prompts, arrivals, params=GREEDY):
    """Add prompt i before step arrivals[i]; step until every request ends."""
    streams, step = {}, 0
    while len(streams) < len(prompts) or any(not s.last or not s.last.finished for s in streams.values()):
        for i, at in enumerate(arrivals):
            if at == step:
                streams[i] = eng.add_request(prompts[i], params)
        eng.step()
        step += 1
        assert step < 500
    return [streams[i].result() for i in range(len(prompts))]


def test_staggered_arrivals_match_eager_generate(daemon_factory, models):
    arch, model, ref = models
    d = daemon_factory()
    prompts = [tokens(n, seed=i) for i, n in enumerate([5, 40, 17, 3, 64, 9])]
    with engine(model, d, f"{arch}-stagger") as eng:
        outs = run_staggered(eng, prompts, [0, 0, 2, 3, 3, 7])
        assert eng.client.stats().sequences == 0
        assert max(t.num_tokens for t in eng.timings.steps) <= 32
        assert any(t.num_prefill_tokens and t.num_tokens > t.num_prefill_tokens for t in eng.timings.steps)
    for p, out in zip(prompts, outs):
        assert list(out.token_ids) == reference_generate(ref, p, 8)[0]
        assert out.finish_reason == "length"


def test_decode_steps_padded_to_graph_sizes_match_eager_generate(daemon_factory, llama):
    """The CUDA-graph runner's padding, run eagerly (the CPU): idle rows change no request's tokens."""
    arch, model, ref = llama
    d = daemon_factory()
    prompts = [tokens(n, seed=950 + i) for i, n in enumerate([6, 19, 11, 3, 25, 8])]
    with engine(model, d, f"{arch}-padded") as eng:
        b = eng.runner.buffers
        eng.step_loop.runner = ke.GraphRunner(eng.model, b.max_tokens, b.max_seqs, b.max_blocks, capture=False)
        assert eng.runner.sizes == [1, 2, 4, 8]
        outs = run_staggered(eng, prompts, [0, 1, 1, 5, 9, 12])
        decode = {t.num_seqs for t in eng.timings.steps if t.num_seqs and t.num_tokens == t.num_seqs}
        assert decode - {1, 2, 4, 8}, decode  # batches between the sizes ran padded
        assert eng.client.stats().sequences == 0
    for p, out in zip(prompts, outs):
        assert list(out.token_ids) == reference_generate(ref, p, 8)[0]


@pytest.mark.parametrize("host_tier", [False, True], ids=["recompute", "swap"])
def test_preempted_requests_resume_with_the_same_tokens(daemon_factory, llama, host_tier):
    """A pool of 32 blocks of 8 tokens for 8 requests of up to 6 blocks each: some must be preempted."""
    arch, model, ref = llama
    d = daemon_factory("--pool-bytes", "128KiB", "--max-reserve-blocks", "4",
                       *(["--host-bytes", "1MiB"] if host_tier else []))
    prompts = [tokens(n, seed=100 + i) for i, n in enumerate([20, 25, 14, 30, 22, 9, 27, 18])]
    params = ke.SamplingParams(max_tokens=16, temperature=0)
    with engine(model, d, f"{arch}-preempt", flush_every=4) as eng:
        assert eng.swap is host_tier
        outs = run_staggered(eng, prompts, [0, 0, 0, 1, 1, 2, 2, 3], params)
        st = eng.stats()
        assert st.preemptions > 0
        assert (st.swaps > 0) is host_tier and (st.recomputes == 0) is host_tier
        assert eng.client.stats().sequences == 0
    for p, out in zip(prompts, outs):
        assert list(out.token_ids) == reference_generate(ref, p, 16)[0]


def test_prefix_hit_skips_its_prefill(daemon_factory, models):
    arch, model, ref = models
    d = daemon_factory()
    first = tokens(40, seed=200)
    other = first[:32] + tokens(5, seed=201)
    with engine(model, d, f"{arch}-prefix") as eng:
        (a,) = eng.generate([first], GREEDY)
        (b,) = eng.generate([other], GREEDY)
        (c,) = eng.generate([first], GREEDY)
        assert eng.stats().prefix_hit_tokens == 32 + 40
    assert (a.num_cached_tokens, b.num_cached_tokens, c.num_cached_tokens) == (0, 32, 40)
    assert list(b.token_ids) == reference_generate(ref, other, 8)[0]
    assert a.token_ids == c.token_ids == tuple(reference_generate(ref, first, 8)[0])


def test_seeded_sampling_is_reproducible_whatever_runs_beside_it(daemon_factory, models):
    arch, model, _ = models
    d = daemon_factory()
    prompt = tokens(12, seed=300)
    sampled = ke.SamplingParams(max_tokens=12, temperature=1.5, top_k=50, top_p=0.9, seed=7)
    with engine(model, d, f"{arch}-seed") as eng:
        (alone,) = eng.generate([prompt], sampled)
        s = eng.add_request(prompt, sampled)
        others = [eng.add_request(tokens(20, seed=301 + i), ke.SamplingParams(max_tokens=12, seed=i)) for i in range(3)]
        beside, *_ = finish(eng, s, *others, eng.add_request(tokens(7, seed=310), GREEDY))
        (reseeded,) = eng.generate([prompt], ke.SamplingParams(max_tokens=12, temperature=1.5, seed=8))
    assert alone.token_ids == beside.token_ids
    assert reseeded.token_ids != alone.token_ids


def test_stop_token_ids_and_stop_strings(daemon_factory, models):
    from kvpool.serve.demo_model import demo_tokenizer as make_tokenizer

    arch, model, ref = models
    d = daemon_factory()
    tok = make_tokenizer()
    prompt = tokens(10, seed=400)
    want = reference_generate(ref, prompt, 10)[0]
    stop_id = want[4]
    stop_word = tok.convert_ids_to_tokens(want[6])
    cut = want.index(stop_id)
    with ke.Engine.connect(model, d.socket, name="stop", model_id=f"{arch}-stop", tokenizer=tok) as eng:
        by_id = eng.add_request(prompt, ke.SamplingParams(max_tokens=10, temperature=0, stop_token_ids=[stop_id]))
        deltas = []
        by_str = eng.add_request(prompt, ke.SamplingParams(max_tokens=10, temperature=0, stop=[" " + stop_word]),
                                 callback=lambda out: deltas.append(out.new_text))
        a, b = finish(eng, by_id, by_str)
        streamed = "".join(deltas)
    assert list(a.token_ids) == want[: cut + 1] and a.finish_reason == "stop"
    assert stop_id not in tok(a.text)["input_ids"] or want[:cut].count(stop_id)
    words = tok.convert_ids_to_tokens(want)
    first = words.index(stop_word)
    assert b.finish_reason == "stop" and b.text == " ".join(words[:first])
    assert streamed == b.text


def test_abort_frees_the_sequence_at_once(daemon_factory, models):
    arch, model, _ = models
    d = daemon_factory()
    with engine(model, d, f"{arch}-abort").start() as eng:
        stream = eng.add_request(tokens(30, seed=500), ke.SamplingParams(max_tokens=400, temperature=0))
        for out in stream:
            if len(out.token_ids) >= 3:
                assert eng.client.stats().sequences == 1
                eng.abort(out.request_id)
                break
        final = stream.result()
        assert final.finish_reason == "abort" and len(final.token_ids) < 400
        assert eng.client.stats().sequences == 0
        assert eng.stats().running == 0


def test_async_streams_from_the_background_thread(daemon_factory, models):
    import asyncio

    arch, model, ref = models
    d = daemon_factory()
    prompts = [tokens(9, seed=600), tokens(21, seed=601)]

    async def consume(eng, prompt):
        got = []
        async for out in eng.add_request_async(prompt, GREEDY):
            got.extend(out.new_token_ids)
        return got

    async def main(eng):
        return await asyncio.gather(*(consume(eng, p) for p in prompts))

    with engine(model, d, f"{arch}-async").start() as eng:
        outs = asyncio.run(main(eng))
    for p, got in zip(prompts, outs):
        assert got == reference_generate(ref, p, 8)[0]


def test_a_daemon_that_goes_away_ends_the_requests_with_an_error(daemon_factory):
    model = make_model("llama")
    d = daemon_factory()
    eng = engine(model, d, "gone").start()
    try:
        stream = eng.add_request(tokens(10, seed=700), ke.SamplingParams(max_tokens=480, temperature=0))
        next(iter(stream))
        d.stop(signal.SIGKILL)
        final = stream.result()
        assert final.finish_reason == "error" and final.error
        assert eng.running  # the engine thread lives on
    finally:
        eng.stop()


@pytest.mark.parametrize("host_tier", [False, True], ids=["recompute", "swap"])
def test_a_request_the_pool_cannot_hold_ends_with_an_error(daemon_factory, llama, host_tier):
    """32 blocks of 8 tokens: a 200-token prompt fits, its growth to 400 tokens does not."""
    _, model, _ = llama
    d = daemon_factory("--pool-bytes", "128KiB", "--max-reserve-blocks", "4",
                       *(["--host-bytes", "1MiB"] if host_tier else []))
    with engine(model, d, "too-big", flush_every=4) as eng:
        s = eng.add_request(tokens(200, seed=800), ke.SamplingParams(max_tokens=200, temperature=0))
        small = eng.add_request(tokens(5, seed=801), ke.SamplingParams(max_tokens=4, temperature=0))
        out, ok = finish(eng, s, small)
        assert out.finish_reason == "error" and "does not fit" in out.error and 0 < len(out.token_ids) < 200
        assert ok.finish_reason == "length"
        assert eng.client.stats().sequences == 0


def test_prompts_admitted_together_share_their_prefix_in_one_forward(daemon_factory, llama):
    """One Create for both: the second finds the first's blocks, written by the same forward that reads them."""
    _, model, ref = llama
    d = daemon_factory()
    shared = tokens(16, seed=900)
    prompts = [shared + tokens(3, seed=901), shared + tokens(4, seed=902), list(shared)]
    with engine(model, d, "together", max_num_batched_tokens=64) as eng:
        streams = [eng.add_request(p, GREEDY) for p in prompts]
        eng.step()
        assert eng.timings.steps[-1].num_tokens == 19 + 4 + 1  # the third recomputes only its last query
        outs = finish(eng, *streams)
    assert [o.num_cached_tokens for o in outs] == [0, 16, 16]
    for p, out in zip(prompts, outs):
        assert list(out.token_ids) == reference_generate(ref, p, 8)[0]


def test_generate_takes_one_sampling_params_per_prompt(daemon_factory, llama):
    arch, model, ref = llama
    d = daemon_factory()
    prompts = [tokens(n, seed=1000 + i) for i, n in enumerate([7, 15, 11])]
    sampled = ke.SamplingParams(max_tokens=4, temperature=1.2, top_k=40, seed=3)
    per_prompt = [ke.SamplingParams(max_tokens=3, temperature=0), ke.SamplingParams(max_tokens=6, temperature=0),
                  sampled]
    with engine(model, d, f"{arch}-per-prompt") as eng:
        short, long, drawn = eng.generate(prompts, per_prompt)
        (alone,) = eng.generate((prompts[2],), (sampled,))
    assert list(short.token_ids) == reference_generate(ref, prompts[0], 3)[0]
    assert list(long.token_ids) == reference_generate(ref, prompts[1], 6)[0]
    assert len(drawn.token_ids) == 4 and drawn.token_ids == alone.token_ids


@pytest.mark.parametrize("bad", [
    pytest.param(lambda p: [p] * 2, id="too-few"),
    pytest.param(lambda p: [p] * 4, id="too-many"),
    pytest.param(lambda p: [p, p, {"max_tokens": 3}], id="not-sampling-params"),
    pytest.param(lambda p: {"max_tokens": 3}, id="a-dict"),
])
def test_generate_refuses_params_that_are_not_one_per_prompt(daemon_factory, llama, bad):
    arch, model, _ = llama
    d = daemon_factory()
    with engine(model, d, f"{arch}-bad-params") as eng:
        with pytest.raises(InvalidArgument, match="SamplingParams"):
            eng.generate([tokens(5, seed=i) for i in range(3)], bad(GREEDY))
        assert eng.stats().waiting == 0 and eng.client.stats().sequences == 0


def test_generate_queues_nothing_when_one_prompt_is_refused(daemon_factory, llama):
    arch, model, _ = llama
    d = daemon_factory()
    with engine(model, d, f"{arch}-all-or-nothing") as eng:
        with pytest.raises(InvalidArgument, match="empty"):
            eng.generate([tokens(5, seed=1), [], tokens(6, seed=2)], GREEDY)
        with pytest.raises(InvalidArgument, match="tokenizer"):
            eng.generate([tokens(5, seed=1), tokens(6, seed=2)], [GREEDY, ke.SamplingParams(stop=["x"])])
        assert eng.stats().waiting == 0
        eng.step()
        assert eng.stats().generation_tokens == 0 and eng.client.stats().sequences == 0


def test_stats_difference_is_the_work_between_two_snapshots(daemon_factory, llama):
    arch, model, _ = llama
    d = daemon_factory()
    first = tokens(24, seed=1100)
    with engine(model, d, f"{arch}-delta") as eng:
        eng.generate([first], GREEDY)
        before = eng.stats()
        outs = eng.generate([first[:16] + tokens(4, seed=1101), tokens(9, seed=1102)],
                            ke.SamplingParams(max_tokens=5, temperature=0))
        after = eng.stats()
        waiting = eng.add_request(tokens(3, seed=1103), GREEDY)
        delta = eng.stats() - before
        finish(eng, waiting)
    assert before.prefix_hit_tokens == 0 and before.steps > 0
    assert [o.num_cached_tokens for o in outs] == [16, 0]
    assert (delta.prompt_tokens, delta.generation_tokens, delta.finished_requests) == (20 + 9, 10, 2)
    assert (delta.prefix_hit_tokens, delta.steps) == (16, after.steps - before.steps)
    assert (delta.waiting, delta.running, delta.swapped) == (1, 0, 0)  # gauges: the later snapshot's
    with pytest.raises(TypeError):
        after - 1


def test_timings_reset_starts_a_new_stretch(daemon_factory, llama):
    arch, model, _ = llama
    d = daemon_factory()
    with engine(model, d, f"{arch}-timings") as eng:
        eng.generate([tokens(30, seed=1200)], GREEDY)
        assert eng.timings.summary()["steps"] > 0
        eng.timings.reset()
        assert eng.timings.summary()["steps"] == 0 and not eng.timings.steps
        before, calls = eng.stats(), eng.client.rpcs
        eng.generate([tokens(5, seed=1201)], ke.SamplingParams(max_tokens=3, temperature=0))
        summary = eng.timings.summary()
        calls = eng.client.rpcs - calls
    assert summary["steps"] == (eng.stats() - before).steps == 3  # a 5-token prefill, then 2 decodes
    assert summary["num_tokens"] == 5 + 2 and summary["forward"] > 0
    assert summary["gpu_wait"] == summary["chunk_sync"] == 0.0  # on the CPU a call has no device to wait for
    assert summary["daemon_calls"] == calls >= 2  # the create and the free at least, every one in a step
