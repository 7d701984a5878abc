"""Every causal LM architecture transformers ships runs exactly through kvpool.hf and kvpool.engine, or is
refused when it connects.

For each entry of ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`` (``arch_sweep.ARCHS``), a
tiny random float32 model (``arch_sweep.build``) either

* generates, greedily, the same tokens as transformers' own eager ``generate``
  (``reference_generate``, one prompt at a time) for two prompts of 21 and 34
  tokens batched together, 5 new tokens each, both through
  ``PagedModel.generate`` and through ``Engine`` (chunked prefill: 16 tokens a
  step); sliding windows are 8 tokens where the architecture has one, so they cut; or
* is in ``REFUSED`` and both ``PagedModel.connect`` and ``Engine.connect`` raise
  ``UnsupportedModel`` naming that reason, before any forward of kvpool's own,
  leaving the model's attention implementation as it was.

``EXCLUDED`` (not built, with the reason) and the twins ``arch_sweep.duplicate_of``
names (the same model class on the same config class as another entry, swept
there) are skipped.  Run as a script, this file prints docs/hf.md's list of
outcomes (the refusals as the probe gives them now, no daemon):

    .venv/bin/python tests/hf/test_arch_sweep.py
"""

from __future__ import annotations

import pytest
import torch

from hf_models import eager_copy, reference_generate, start_daemon, transformers

import arch_sweep
import kvpool.engine as ke
import kvpool.hf as kvpool_hf

pytestmark = pytest.mark.timeout(120)

NEW_TOKENS = 5
PROMPT_LENGTHS = (21, 34)

#: not built, with the reason
EXCLUDED = {
    "musicgen": "audio: a sequence's input_ids are one row per audio codebook, not one row of tokens",
    "musicgen_melody": "audio: a sequence's input_ids are one row per audio codebook, not one row of tokens",
    "gemma3n": "its vision tower (TimmWrapper) needs timm and pillow, which kvpool does not depend on; its text "
               "decoder is swept as gemma3n_text",
}

#: why kvpool.hf refuses an architecture: (what it is, words of the reason its UnsupportedModel names)
MLA = ("multi-head latent attention: values narrower than queries and keys",
       r"query/key head_dim 16 and value head_dim 8 differ \(e.g. multi-head latent attention\)")
STATE_SPACE = ("linear-attention or state-space (Mamba) layers",
               r"'linear_attention'\]: linear-attention or state-space \(Mamba\) layers")
HYBRID = ("attention beside a state-space path in one layer", r"layers running attention beside a state-space path")
CONV = ("convolution layers", r"\['conv'\]: convolution layers")
SPARSE = ("sparse (indexed) attention", r"\['indexed_attention'\]: sparse \(indexed\) attention")
COMPRESSED = ("compressed attention", r"compressed attention, compressed sparse attention")
NO_INTERFACE = ("attention of its own, not transformers' AttentionInterface", r"does not take a pluggable attention")
NO_ATTENTION = ("no layer calls the attention interface", r"no layer calls transformers' attention interface")
ROW_POSITIONS = ("learned positions counted along the row (past length + arange), not read from position_ids",
                 r"change when the tokens move along the row")
RUN_TWICE = ("an attention layer runs twice per forward (differential attention, looped blocks)",
             r"attention layer 0 runs more than once per forward")
SINKS = ("attention sinks", r"attention sinks \(s_aux\)")
KV_SHAPES = ("a different head_dim on the full-attention layers than on the sliding ones",
             r"different KV shapes \(heads, head_dim\)")
DRAFTER = ("a speculative-decoding drafter: every layer reads its target model's K/V",
           r"forward fails .*shared_kv_states cannot be None")

REFUSED = {
    **dict.fromkeys(("axk1", "deepseek_v2", "deepseek_v3", "glm4_moe_lite", "longcat_flash", "mimo_v2_flash",
                     "minicpm3", "sarvam_mla", "youtu"), MLA),
    **dict.fromkeys(("bailing_hybrid", "bamba", "falcon_mamba", "granitemoehybrid", "jamba", "kimi_linear",
                     "lara_mini", "mamba", "mamba2", "minimax", "nemotron_h", "olmo_hybrid", "qwen3_5_moe_text",
                     "qwen3_5_text", "qwen3_next", "qwen4_exp_text", "recurrent_gemma"), STATE_SPACE),
    **dict.fromkeys(("falcon_h1", "inkling2_loop_text", "inkling2_text", "inkling_text", "zaya", "zamba", "zamba2"),
                    HYBRID),
    **dict.fromkeys(("lfm2", "lfm2_moe", "lfm3"), CONV),
    **dict.fromkeys(("axk2", "deepseek_v32", "dots3_note_text", "glm_moe_dsa", "hy_v4", "kolibri1_1"), SPARSE),
    **dict.fromkeys(("big_bird", "bloom", "cpmant", "gpt_neo", "gpt_neox_japanese", "megatron-bert", "mpt", "mvp",
                     "openai-gpt", "prophetnet", "reformer", "rembert", "roformer", "rwkv", "trocr", "xglm", "xlm",
                     "xlnet"), NO_INTERFACE),
    **dict.fromkeys(("git", "xlstm"), NO_ATTENTION),
    **dict.fromkeys(("bart", "bigbird_pegasus", "blenderbot", "blenderbot-small", "marian", "mbart", "pegasus",
                     "plbart"), ROW_POSITIONS),
    **dict.fromkeys(("diffllama", "dory", "hrm_text"), RUN_TWICE),
    **dict.fromkeys(("flint", "gpt_oss", "granite_swa", "granitemoe_swa"), SINKS),
    **dict.fromkeys(("gemma4", "gemma4_text", "gemma4_unified", "gemma4_unified_text"), KV_SHAPES),
    **dict.fromkeys(("gemma4_assistant", "gemma4_unified_assistant"), DRAFTER),
    "blt": ("byte-level local and global transformers, no one stack of layers",
            r"its text config \(BltConfig\) has no num_hidden_layers"),
    "deepseek_v4": COMPRESSED,
    "doge": ("a learned bias (dynamic mask) on the attention scores",
             r"attention layer 0 adds a bias to the attention scores"),
    "llama4_text": ("chunked attention", r"\['chunked_attention'\]: chunked attention"),
    "moshi": ("a window its cache keeps but its attention layers are not told of (refused where the window is "
              "shorter than max_position_embeddings)",
              r"a sliding window of 8 on layer types \['sliding_attention'\] \(layers \[0, 1\]\) that its "
              r"attention layers do not pass"),
    "whisper": ("its forward takes no logits_to_keep (nor position_ids)",
                r"does not take logits_to_keep as a tensor of rows"),
}


@pytest.fixture(scope="module")
def pool(request):
    return start_daemon(request, "--max-classes", "0", "--max-classes-per-tenant", "0")


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny matrices: a second intra-op thread only waits for a core the other tests hold."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def tokens(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(4, 256, (n,), generator=g).tolist()


def paged(model, pool, model_id: str):
    return kvpool_hf.PagedModel.connect(model, pool.socket, name=model_id, model_id=model_id, block_size=8)


def engine(model, pool, model_id: str):
    config = ke.EngineConfig(max_num_seqs=4, max_num_batched_tokens=16)
    return ke.Engine.connect(model, pool.socket, name=model_id, model_id=model_id, block_size=8, config=config)


def check_generates_like_transformers(model, pool, arch: str) -> None:
    prompts = [tokens(n, seed=i) for i, n in enumerate(PROMPT_LENGTHS)]
    ref = eager_copy(model)
    want = [reference_generate(ref, p, NEW_TOKENS)[0] for p in prompts]
    with paged(model, pool, f"{arch}-sweep") as pm:
        assert pm.generate(prompts, max_new_tokens=NEW_TOKENS).tokens == want
    with engine(model, pool, f"{arch}-sweep") as eng:
        outs = eng.generate(prompts, ke.SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True))
    assert [list(o.token_ids) for o in outs] == want


def check_refused(model, pool, arch: str, reason: str) -> None:
    before = model.config._attn_implementation
    with pytest.raises(kvpool_hf.UnsupportedModel, match=reason) as refusal:
        paged(model, pool, f"{arch}-sweep")
    assert str(refusal.value).startswith(f"{type(model).__name__}: ")
    with pytest.raises(kvpool_hf.UnsupportedModel, match=reason):
        engine(model, pool, f"{arch}-sweep")
    assert model.config._attn_implementation == before


@pytest.mark.parametrize("arch", list(arch_sweep.ARCHS))
def test_architecture(pool, arch):
    if arch in EXCLUDED:
        pytest.skip(f"excluded: {EXCLUDED[arch]}")
    if twin := arch_sweep.duplicate_of(arch):
        pytest.skip(f"the same model class on the same config class as {twin}, swept there")
    model = arch_sweep.build(arch)
    if arch in REFUSED:
        check_refused(model, pool, arch, REFUSED[arch][1])
    else:
        check_generates_like_transformers(model, pool, arch)


def test_tables_name_only_known_architectures():
    assert set(REFUSED) <= set(arch_sweep.ARCHS) and set(EXCLUDED) <= set(arch_sweep.ARCHS)
    assert not set(REFUSED) & set(EXCLUDED)


# -- the checks one at a time, on models made to fail them ------------------------------------------------------
def stablelm_80():
    """A StableLM of head_dim 80, as StableLM 2 / 3B."""
    config = transformers.StableLmConfig(
        num_hidden_layers=2, hidden_size=160, intermediate_size=128, num_attention_heads=2, num_key_value_heads=2,
        vocab_size=256, initializer_range=0.2, bos_token_id=None, eos_token_id=None, tie_word_embeddings=False)
    torch.manual_seed(0)
    return transformers.StableLmForCausalLM(config).eval()


def test_stablelm_runs_although_its_layers_drop_keyword_arguments(pool):
    """StableLM's decoder layer calls its attention without the forward's keyword arguments; the batch
    reaches kvpool's attention anyway."""
    model = stablelm_80()
    assert "kvpool_batch" not in _attention_kwargs(model, kvpool_batch="a forward's keyword argument")
    assert kvpool_hf.layout_for(model, "stablelm").head_dim == 80
    check_generates_like_transformers(model, pool, "stablelm-80")


def _attention_kwargs(model, **kwargs) -> set[str]:
    """The keyword arguments that reach the attention function of a forward given ``kwargs``."""
    seen: set[str] = set()

    def spy(module, query, key, value, attention_mask, **kw):
        seen.update(kw)
        return transformers.modeling_utils.ALL_ATTENTION_FUNCTIONS["sdpa"](
            module, query, key, value, attention_mask, **kw)

    transformers.AttentionInterface.register("kwargs_spy", spy)
    before = model.config._attn_implementation
    model.set_attn_implementation("kwargs_spy")
    try:
        with torch.no_grad():
            model(input_ids=torch.tensor([[5, 6, 7]]), use_cache=False, **kwargs)
    finally:
        model.set_attn_implementation(before)
    return seen


class _TokenShift(torch.nn.Module):
    """An MLP that also reads the previous token of the row (RWKV's token shift): it mixes tokens."""

    def __init__(self, mlp):
        super().__init__()
        self.mlp = mlp

    def forward(self, x):
        shifted = torch.cat([torch.zeros_like(x[:, :1]), x[:, :-1]], dim=1)
        return self.mlp(x + shifted)


def test_gpu_kernel_limits_are_checked_at_connect():
    """What a CUDA model's PagedModel checks before its first forward (the check itself needs no GPU)."""
    from kvpool.hf_support import check_gpu_kernels

    with pytest.raises(kvpool_hf.UnsupportedModel, match=r"head_dim 16 \(kvpool's GPU kernels take 64, 80, 96"):
        check_gpu_kernels(arch_sweep.build("llama"), 16, "float32")
    model = stablelm_80()
    check_gpu_kernels(model, 80, "float32")
    with pytest.raises(kvpool_hf.UnsupportedModel, match="a float32 model on a float8_e4m3fn pool"):
        check_gpu_kernels(model, 80, "float8_e4m3fn")
    check_gpu_kernels(model.to(torch.bfloat16), 80, "float8_e4m3fn")


def test_token_mixing_outside_the_attention_is_refused(pool):
    model = arch_sweep.build("llama")
    model.model.layers[1].mlp = _TokenShift(model.model.layers[1].mlp)
    check_refused(model, pool, "llama-shift", r"a token's outputs change when a neighbouring token changes")


def test_a_bidirectional_encoder_is_refused(pool):
    """BERT without is_decoder attends both ways: its mask is not the kernels' causal one."""
    config = arch_sweep.tiny_config("bert")
    config.is_decoder = False
    model = transformers.BertLMHeadModel(config).eval()
    check_refused(model, pool, "bert-encoder", r"attention layer 0's mask is not causal attention")


def test_a_window_no_sequence_reaches_needs_not_be_passed(pool):
    """Moshi's cache keeps a window its attention is not told of; one of max_position_embeddings never cuts."""
    model = arch_sweep.build("moshi")
    model.config.sliding_window = model.config.max_position_embeddings
    check_generates_like_transformers(model, pool, "moshi-long-window")


# -- docs/hf.md's list -------------------------------------------------------------------------------------------------
def outcomes() -> tuple[list[str], dict[str, list[str]], list[str]]:
    """What the connect-time check says of every architecture: (accepted, refused by reason, not swept).

    A refusal that ``REFUSED`` does not foresee is listed under its own message.
    """
    import re

    accepted, refused, skipped = [], {}, []
    for arch in arch_sweep.ARCHS:
        twin = arch_sweep.duplicate_of(arch)
        if arch in EXCLUDED or twin:
            skipped.append(f"`{arch}` ({EXCLUDED[arch] if arch in EXCLUDED else f'as `{twin}`'})")
            continue
        try:
            kvpool_hf.layout_for(arch_sweep.build(arch), arch)
            accepted.append(arch)
        except kvpool_hf.UnsupportedModel as exc:
            title, words = REFUSED.get(arch, (None, None))
            refused.setdefault(title if words and re.search(words, str(exc)) else f"UNFORESEEN: {exc}", []).append(arch)
    return accepted, refused, skipped


def markdown() -> str:
    import textwrap

    accepted, refused, skipped = outcomes()
    names = lambda archs: ", ".join(f"`{a}`" for a in archs)  # noqa: E731
    item = lambda text, indent="": textwrap.fill(  # noqa: E731
        text, 100, initial_indent=f"{indent}- ", subsequent_indent=f"{indent}  ", break_on_hyphens=False)
    intro = (f"Swept with transformers {transformers.__version__}: every entry of `MODEL_FOR_CAUSAL_LM_MAPPING_NAMES` "
             f"({len(arch_sweep.ARCHS)}) as a tiny random float32 model (BERT-style ones as decoders, "
             "`is_decoder=True`); `tests/hf/test_arch_sweep.py` checks each line and, run as a script, prints them.")
    return "\n".join([
        textwrap.fill(intro, 100, break_on_hyphens=False),
        "",
        item(f"**Same greedy tokens as transformers' `generate`**, through `kvpool.hf` and `kvpool.engine` "
             f"({len(accepted)}): {names(accepted)}."),
        item(f"**Refused at connect** ({sum(map(len, refused.values()))}):"),
        *(item(f"{title}: {names(archs)}", "  ") for title, archs in sorted(refused.items(), key=lambda kv: -len(kv[1]))),
        item(f"**Not swept** ({len(skipped)}): {'; '.join(skipped)}."),
    ])


if __name__ == "__main__":
    transformers.logging.set_verbosity_error()
    torch.set_num_threads(1)
    print(markdown())
