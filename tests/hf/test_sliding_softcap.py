"""Sliding-window and soft-capped transformers models through kvpool.hf match transformers' eager path.

Models (random weights, float32, built here): Mistral (every layer slides),
Qwen2 with ``use_sliding_window`` (the layers from ``max_window_layers`` on
slide), Gemma 2 (sliding / full layers alternate, attention logit soft cap,
``query_pre_attn_scalar`` scale, final logit soft cap) and a Gemma 3 text model
(``layer_types`` mixing both kinds, a RoPE per layer type).  Windows are 8
tokens and prompts up to 30 + 12 generated tokens, so the windows cut in the
prefill and in every decode step.

Reference: ``model.generate`` with ``attn_implementation="eager"`` (transformers'
own sliding-window masks and caches), one prompt at a time.  kvpool: one
batch of prompts of different lengths.  Tokens are equal and logits agree
within ``atol=rtol=1e-4`` (as in test_generate.py).

fp8: a ``float8_e4m3fn`` pool for a float32 model (Gemma 2, so the window and
soft cap run on dequantized keys) is teacher-forced along the float32 pool's
greedy tokens; each step's logits stay within 0.05 * the spread (max - min)
of the float32 pool's logits (seen up to 0.014: e4m3 keeps 3 mantissa bits, up to
~6% error per element, which attention averages down), and the first token,
chosen from the prefill, is the same.
"""

from __future__ import annotations

import pytest
import torch

from hf_models import eager_copy, reference_generate, start_daemon, transformers

import kvpool
import kvpool.hf as kvpool_hf  # after hf_models, which skips the module without transformers

ATOL = RTOL = 1e-4
WINDOW = 8
NEW_TOKENS = 12
#: prompt lengths of one batch: shorter than the window, around it, and several windows long
LENGTHS = (30, 5, 9, 17)

SMALL = dict(
    hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    vocab_size=256, max_position_embeddings=512, bos_token_id=None, eos_token_id=None, pad_token_id=None,
    initializer_range=0.2,  # clear greedy margins (see hf_models.make_model)
)


def _mistral(**shape):
    return transformers.MistralForCausalLM(transformers.MistralConfig(
        **{**SMALL, **shape}, num_hidden_layers=2, sliding_window=WINDOW, tie_word_embeddings=False))


def _qwen2(**shape):
    cfg = transformers.Qwen2Config(**{**SMALL, **shape}, num_hidden_layers=3, use_sliding_window=True,
                                   sliding_window=WINDOW, max_window_layers=1, tie_word_embeddings=False)
    assert cfg.layer_types == ["full_attention", "sliding_attention", "sliding_attention"]
    return transformers.Qwen2ForCausalLM(cfg)


def _gemma2(**shape):
    cfg = transformers.Gemma2Config(**{**SMALL, **shape}, num_hidden_layers=2, sliding_window=WINDOW,
                                    query_pre_attn_scalar=24, attn_logit_softcapping=3.0, final_logit_softcapping=30.0)
    assert cfg.layer_types == ["sliding_attention", "full_attention"]
    return transformers.Gemma2ForCausalLM(cfg)


def _gemma3(**shape):
    cfg = transformers.Gemma3TextConfig(
        **{**SMALL, **shape}, num_hidden_layers=3, sliding_window=WINDOW, query_pre_attn_scalar=24,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                         "full_attention": {"rope_type": "linear", "rope_theta": 1_000_000.0, "factor": 4.0}},
    )
    return transformers.Gemma3ForCausalLM(cfg)


BUILDERS = {"mistral": _mistral, "qwen2": _qwen2, "gemma2": _gemma2, "gemma3": _gemma3}


def make(arch: str, seed: int = 0, **shape):
    """``shape`` overrides ``SMALL`` (the GPU tests: head_dim 64)."""
    torch.manual_seed(seed)
    return BUILDERS[arch](**shape).eval()


def tokens(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 256, (n,), generator=g).tolist()


@pytest.fixture(scope="module")
def pool(request):
    return start_daemon(request)


def paged(model, pool, model_id: str, **kw):
    return kvpool_hf.PagedModel.connect(model, pool.socket, name=model_id, model_id=model_id, block_size=8, **kw)


def check_windowed_batch(pm, ref, *, atol: float = ATOL, rtol: float = RTOL) -> None:
    """One batch of ``LENGTHS`` prompts through ``pm``: tokens equal to ``ref``'s eager generate of each
    prompt alone, logits within ``atol`` / ``rtol``."""
    prompts = [tokens(n, seed=i) for i, n in enumerate(LENGTHS)]
    gen = pm.generate(prompts, max_new_tokens=NEW_TOKENS, output_logits=True)
    for p, got_tokens, got_logits in zip(prompts, gen.tokens, gen.logits):
        want_tokens, want_logits = reference_generate(ref, p, NEW_TOKENS)
        assert got_tokens == want_tokens
        torch.testing.assert_close(got_logits, want_logits.cpu(), atol=atol, rtol=rtol)


def check_fp8_close(connect, prompts: list[list[int]], steps: int = 6) -> None:
    """A model on an fp8 pool, teacher-forced along its greedy tokens on a pool of its own dtype: the first
    token is the same and each step's logits stay within 0.05 of the spread of the reference's.
    ``connect(name, **kw)`` makes a ``PagedModel`` of the model (``kw``: ``kv_dtype``)."""
    with connect("fp8-reference") as pm:
        want = pm.generate(prompts, max_new_tokens=steps + 1, output_logits=True)
    with connect("fp8", kv_dtype="float8_e4m3fn") as pm:
        assert pm.layout.dtype == "float8_e4m3fn" and pm.kv.dtype == torch.float8_e4m3fn
        seqs, first = pm.prefill(prompts)
        got = [first.float().cpu()]
        for j in range(steps):  # teacher-forced along the reference pool's tokens
            got.append(pm.forward(seqs, [t[j] for t in want.tokens]).float().cpu())
        pm.free(seqs)
    got = torch.stack(got, 1)
    for i, w in enumerate(want.logits):
        assert int(got[i, 0].argmax()) == want.tokens[i][0]
        err = (got[i] - w).abs().max().item()
        assert err <= 0.05 * (w.max() - w.min()).item(), err


@pytest.mark.parametrize("arch", list(BUILDERS))
def test_windowed_batch_matches_eager(pool, arch):
    model = make(arch)
    ref = eager_copy(model)
    with paged(model, pool, f"{arch}-window") as pm:
        check_windowed_batch(pm, ref)


def test_cached_prefix_with_windows(pool):
    """A prefill that starts at num_cached_tokens, past the window: its queries still see their windows."""
    model = make("gemma2")
    ref = eager_copy(model)
    first = tokens(27, seed=20)
    other = first[:24] + tokens(5, seed=21)
    with paged(model, pool, "gemma2-prefix") as pm:
        pm.generate([first], max_new_tokens=1)
        gen = pm.generate([other], max_new_tokens=6, output_logits=True)
    assert gen.num_cached_tokens == [24]
    want_tokens, want_logits = reference_generate(ref, other, 6)
    assert gen.tokens[0] == want_tokens
    torch.testing.assert_close(gen.logits[0], want_logits, atol=ATOL, rtol=RTOL)


def test_window_really_cuts():
    """The same Mistral with a window past every length generates other tokens: the window decides."""
    prompt = tokens(30, seed=0)
    windowed = reference_generate(eager_copy(make("mistral")), prompt, NEW_TOKENS)[0]
    model = make("mistral")
    model.config.sliding_window = 4096
    assert reference_generate(eager_copy(model), prompt, NEW_TOKENS)[0] != windowed


@torch.no_grad()
def test_fp8_pool_close_to_float32_pool(pool):
    model = make("gemma2", seed=1)
    prompts = [tokens(n, seed=10 + i) for i, n in enumerate((21, 6))]
    check_fp8_close(lambda name, **kw: paged(model, pool, f"gemma2-{name}", **kw), prompts)


def test_fp8_scales_and_dtype_checks(pool):
    model = make("mistral")
    with pytest.raises(kvpool.InvalidArgument, match="kv_dtype must be one of"):
        kvpool_hf.layout_for(model, "m", kv_dtype="int8")
    with pytest.raises(kvpool.InvalidArgument, match="float8_e4m3fn KV cache"):
        kvpool_hf.layout_for(model, "m", kv_dtype=torch.float16)
    layout = kvpool_hf.layout_for(model, "mistral-fp8-scales", block_size=8, kv_dtype=torch.float8_e4m3fn)
    with kvpool.connect(pool.socket, name="scales", layout=layout) as client:
        with pytest.raises(kvpool.InvalidArgument, match="pair or 2 of them"):
            kvpool_hf.PagedModel(model, client, kv_scales=[(1.0, 1.0)] * 3)
        with pytest.raises(kvpool.InvalidArgument, match="finite and > 0"):
            kvpool_hf.PagedModel(model, client, kv_scales=(0.0, 1.0))
        pm = kvpool_hf.PagedModel(model, client, kv_scales=[(0.5, 2.0), (1.0, 1.0)])
        assert pm.kv_scales == [(0.5, 2.0), (1.0, 1.0)]
        assert kvpool_hf.PagedModel(model, client, kv_scales=(1.0, 1.0)).kv_scales is None


def test_unsupported_attention_is_refused(pool):
    model = make("gemma3")
    model.config.use_bidirectional_attention = True
    with pytest.raises(NotImplementedError, match="causal attention only"):
        with paged(model, pool, "gemma3-bidir"):
            pass
    model = make("gemma3")
    model.config.layer_types = ["sliding_attention", "chunked_attention", "full_attention"]
    with pytest.raises(NotImplementedError, match="chunked_attention"):
        with paged(model, pool, "gemma3-chunked"):
            pass
    with pytest.raises(NotImplementedError, match="attention sinks"):
        kvpool_hf.kvpool_attention(model.model.layers[0].self_attn, *[torch.zeros(1, 2, 1, 16)] * 3, None,
                                   kvpool_batch=object(), s_aux=torch.zeros(2))
