"""On the GPU: the engine's CUDA-graph decode against transformers' eager generate and the eager engine.

Run on a machine with an NVIDIA GPU:  python3 -m pytest -q -m gpu tests/engine

float32 models (tokens compare exactly, as in tests/hf/test_gpu.py), head_dim 64,
block size 16, a CUDA daemon of this module.
"""

from __future__ import annotations

import pytest
import torch

from hf_models import eager_copy, make_model, reference_generate, start_daemon

import kvpool.engine as ke

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(600),
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
SHAPE = dict(hidden_size=256, intermediate_size=512)


def tokens(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, 256, (n,), generator=g).tolist()


@pytest.fixture(scope="module")
def gpu_pool(request):
    return start_daemon(request, "--backend", "cuda", "--pool-bytes", "1GiB", "--chunk-bytes", "2MiB")


@pytest.fixture(scope="module")
def llama():
    model = make_model("llama", device="cuda", **SHAPE)
    return model, eager_copy(model)


def engine(model, pool, model_id: str, **cfg):
    config = ke.EngineConfig(**{"max_num_seqs": 16, "max_num_batched_tokens": 64, "max_model_len": 256, **cfg})
    return ke.Engine.connect(model, pool.socket, name=model_id, model_id=model_id, config=config)


def run_staggered(eng, prompts, arrivals, params):
    streams, step = {}, 0
    while len(streams) < len(prompts) or any(not s.last or not s.last.finished for s in streams.values()):
        for i, at in enumerate(arrivals):
            if at == step:
                streams[i] = eng.add_request(prompts[i], params[i] if isinstance(params, list) else params)
        eng.step()
        step += 1
        assert step < 1000
    return [streams[i].result() for i in range(len(prompts))]


def test_graph_decode_matches_eager_generate(gpu_pool, llama):
    model, ref = llama
    prompts = [tokens(n, seed=i) for i, n in enumerate([5, 40, 17, 3, 64, 9, 33, 21, 12, 50, 7])]
    params = ke.SamplingParams(max_tokens=12, temperature=0)
    with engine(model, gpu_pool, "gpu-engine-graphs") as eng:
        assert isinstance(eng.runner, ke.GraphRunner)
        eng.warm_up()
        assert eng.runner.captured_sizes == ke.graph_batch_sizes(16)
        eng.runner.time_replays()
        outs = run_staggered(eng, prompts, [0, 0, 1, 2, 2, 4, 6, 6, 9, 13, 20], params)
        decode = [t.num_seqs for t in eng.timings.steps if t.num_seqs and t.num_tokens == t.num_seqs]
        assert set(decode) - set(ke.graph_batch_sizes(16)), decode  # padded replays ran
        replays = eng.runner.replay_ms()  # one timed replay per decode step, at its padded size
        assert [(n, size) for n, size, _ in replays] == [(n, eng.runner.size_for(n)) for n in decode]
        assert all(ms > 0 for _, _, ms in replays)
        assert eng.client.stats().sequences == 0
    for p, out in zip(prompts, outs):
        assert list(out.token_ids) == reference_generate(ref, p, 12)[0]


def test_graphs_and_eager_engine_sample_the_same(gpu_pool, llama):
    """Seeded sampling and greedy through graphs equal the eager engine's, a graph captured on first use."""
    model, _ = llama
    prompts = [tokens(n, seed=40 + i) for i, n in enumerate([14, 30, 8, 22, 17])]
    params = [ke.SamplingParams(max_tokens=16, temperature=0.8, top_k=40, top_p=0.9, seed=i) for i in range(4)]
    params.append(ke.SamplingParams(max_tokens=16, temperature=0))
    results = {}
    for graphs in (False, True):
        with engine(model, gpu_pool, f"gpu-engine-sample-{graphs}", cuda_graphs=graphs) as eng:
            results[graphs] = [list(o.token_ids) for o in run_staggered(eng, prompts, [0, 0, 1, 3, 3], params)]
            assert isinstance(eng.runner, ke.GraphRunner) is graphs
            if graphs:
                assert eng.runner.captured_sizes  # captured lazily, no warm_up
    assert results[True] == results[False]


def test_graph_decode_survives_preemption(gpu_pool, llama, request):
    """64 blocks of 16 tokens for 8 requests of 9 to 14 blocks: requests are freed and recomputed, block tables
    change under the graphs."""
    model, ref = llama
    small = start_daemon(request, "--backend", "cuda", "--pool-bytes", "2MiB", "--chunk-bytes", "2MiB",
                         "--max-reserve-blocks", "4")
    prompts = [tokens(n, seed=70 + i) for i, n in enumerate([150, 170, 130, 190, 160, 140, 180, 120])]
    params = ke.SamplingParams(max_tokens=24, temperature=0)
    with engine(model, small, "gpu-engine-preempt", flush_every=4) as eng:
        outs = run_staggered(eng, prompts, [0, 0, 0, 1, 1, 2, 2, 3], params)
        assert eng.stats().preemptions > 0
    for p, out in zip(prompts, outs):
        assert list(out.token_ids) == reference_generate(ref, p, 24)[0]


def test_overlapped_graph_steps_equal_serial_ones(gpu_pool, llama):
    """Steps queued before the last one's tokens are read back (EngineConfig.overlap_steps) give the serial loop's
    tokens, with seeded sampling, a stop token and staggered arrivals, and most decode steps are planned ahead."""
    model, _ = llama
    prompts = [tokens(n, seed=70 + i) for i, n in enumerate([14, 30, 8, 22, 17, 40])]
    params = [ke.SamplingParams(max_tokens=24, temperature=0.8, top_k=40, seed=i) for i in range(3)]
    params += [ke.SamplingParams(max_tokens=24, temperature=0) for _ in range(3)]
    results, stats = {}, {}
    for overlap in (False, True):
        with engine(model, gpu_pool, f"gpu-engine-overlap-{overlap}", overlap_steps=overlap) as eng:
            assert eng.step_loop.overlap is overlap
            results[overlap] = run_staggered(eng, prompts, [0, 0, 1, 3, 3, 5], params)
            stats[overlap] = eng.stats()
        if not overlap:  # a stop token the serial run draws at request 4's 6th token ends it early in both runs
            params[4] = ke.SamplingParams(max_tokens=24, temperature=0,
                                          stop_token_ids=[results[False][4].token_ids[5]])
            with engine(model, gpu_pool, "gpu-engine-overlap-stop", overlap_steps=False) as eng:
                results[False] = run_staggered(eng, prompts, [0, 0, 1, 3, 3, 5], params)
    assert [o.token_ids for o in results[True]] == [o.token_ids for o in results[False]]
    assert results[True][4].finish_reason == "stop" and len(results[True][4].token_ids) <= 6
    assert stats[False].steps_ahead == 0 and stats[True].steps_ahead >= 10, stats[True]
