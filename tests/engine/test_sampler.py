"""The engine's sampler: batched temperature / top-k / top-p draws against a float64 reference."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from kvpool.engine import SamplingParams
from kvpool.engine.sampler import Sampler, draw_keys, exponential_noise


def req(seed: int = 0, position: int = 0, **params):
    return SimpleNamespace(params=SamplingParams(**params), seed=seed, output=[0] * position)


def allowed(logits: np.ndarray, p: SamplingParams) -> set[int]:
    """Tokens a request may draw, in float64: the top-k values, then the smallest top-p set (ties either way)."""
    z = logits.astype(np.float64) / p.temperature
    keep = np.flatnonzero(z >= np.sort(z)[::-1][p.top_k - 1]) if p.top_k else np.arange(z.size)
    probs = np.exp(z[keep] - z[keep].max())
    probs /= probs.sum()
    before = np.array([probs[z[keep] > z[t]].sum() for t in keep])  # the mass of strictly likelier tokens
    return {int(t) for t, b in zip(keep, before) if b < p.top_p + 1e-5}


def test_noise_is_exponential_and_keyed():
    keys = torch.tensor([draw_keys(7, i) for i in range(64)])
    e = exponential_noise(keys, 4096)
    assert e.shape == (64, 4096) and torch.all(e > 0) and torch.isfinite(e).all()
    assert abs(e.mean().item() - 1.0) < 0.01 and abs(e.var().item() - 1.0) < 0.03
    assert abs((e > 1.0).float().mean().item() - np.exp(-1.0)) < 0.01
    assert torch.equal(exponential_noise(keys[5:6], 4096), e[5:6])  # a row alone: the same draw
    assert not torch.equal(e[0], e[1])
    assert draw_keys(7, 3) != draw_keys(8, 3) and draw_keys(2**40, 0) != draw_keys(0, 0)


def test_draw_frequencies_follow_the_probabilities():
    probs = np.array([0.5, 0.3, 0.15, 0.05])
    logits = torch.tensor(np.log(probs), dtype=torch.float32)[None].repeat(4000, 1)
    got = Sampler().sample(logits, [req(seed=11, position=i) for i in range(4000)])
    freq = np.bincount(got, minlength=4) / 4000
    assert np.abs(freq - probs).max() < 0.03, freq


def test_top_k_and_top_p_cut_the_tail():
    probs = np.array([0.5, 0.3, 0.15, 0.05])
    logits = torch.tensor(np.log(probs), dtype=torch.float32)[None].repeat(2000, 1)
    s = Sampler()
    top_k = s.sample(logits, [req(seed=1, position=i, top_k=2) for i in range(2000)])
    assert set(top_k) == {0, 1}
    top_p = s.sample(logits, [req(seed=2, position=i, top_p=0.7) for i in range(2000)])
    assert set(top_p) == {0, 1}  # 0.5 before token 1 is < 0.7; 0.8 before token 2 is not
    cold = s.sample(logits, [req(seed=3, position=i, temperature=0.05) for i in range(200)])
    assert set(cold) == {0}


def test_a_row_draws_the_same_whatever_runs_beside_it():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 300, generator=g)
    rows = [req(seed=5, position=3, temperature=0.9, top_p=0.95), req(temperature=0),
            req(seed=9, position=0, top_k=20), req(seed=5, position=4, temperature=0.9, top_p=0.95),
            req(seed=1, position=7, temperature=2.0, top_k=5, top_p=0.5), req(temperature=0)]
    together = Sampler().sample(logits, rows)
    alone = [Sampler().sample(logits[i:i + 1], [r])[0] for i, r in enumerate(rows)]
    assert together == alone
    assert together[1] == int(logits[1].argmax()) and together[5] == int(logits[5].argmax())


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**64 - 1),
    position=st.integers(0, 10_000),
    temperature=st.floats(0.05, 4.0),
    top_k=st.integers(0, 40),
    top_p=st.floats(0.05, 1.0),
    logits_seed=st.integers(0, 1000),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
)
def test_draws_stay_in_the_allowed_set(seed, position, temperature, top_k, top_p, logits_seed, dtype):
    g = torch.Generator().manual_seed(logits_seed)
    logits = (torch.randn(1, 50, generator=g) * 3).to(dtype)
    r = req(seed=seed, position=position, temperature=temperature, top_k=top_k, top_p=top_p)
    (tok,) = Sampler().sample(logits, [r])
    assert tok in allowed(logits[0].float().numpy(), r.params)


@pytest.mark.parametrize("vocab", [2, 257])
def test_greedy_rows_take_the_argmax(vocab):
    logits = torch.randn(5, vocab, generator=torch.Generator().manual_seed(vocab))
    assert Sampler().sample(logits, [req(temperature=0)] * 5) == logits.argmax(-1).tolist()
