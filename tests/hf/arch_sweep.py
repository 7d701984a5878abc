"""Every causal LM architecture transformers ships, built tiny with random weights (no downloads).

``ARCHS`` lists ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`` (config name -> class).
``build(arch)`` makes a float32 model of 2-4 layers, hidden size 64, a
vocabulary of 256, sliding windows of 8 where the architecture has one and a
wide init (clear greedy margins); ``duplicate_of`` names the entries that are
another's model class on another's config class.  test_arch_sweep.py runs them.
"""

from __future__ import annotations

import functools

import torch
import transformers
from transformers import CONFIG_MAPPING, AutoConfig
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

ARCHS = dict(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)

#: the common tiny shape: a config takes those of its keys it has (``attribute_map`` names included)
SMALL = dict(
    num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
    head_dim=16, vocab_size=256, max_position_embeddings=512, sliding_window=8, hidden_size_global=64,
    num_experts=4, num_local_experts=4, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
    shared_expert_intermediate_size=32, n_group=1, topk_group=1,
    # multi-head latent attention: values narrower than queries and keys (16), as in DeepSeek-V2/V3
    kv_lora_rank=32, q_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=8, qk_head_dim=16, v_head_dim=8,
    # the decoder (and encoder) of encoder-decoder families, whose decoder also runs alone
    decoder_layers=2, decoder_attention_heads=4, decoder_ffn_dim=128, encoder_layers=2, encoder_attention_heads=4,
    encoder_ffn_dim=128,
    tie_word_embeddings=False,
    # a wider init than the usual 0.02 gives logits with clear margins, so greedy choices are decided by
    # the model, not by float rounding between near-ties
    initializer_range=0.2,
)

#: special tokens inside the small vocabulary, where the config has them (generation ignores eos, see build)
TOKEN_IDS = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)

#: per architecture: keys over SMALL's (a sub-config's dict is merged into the shrunk one)
OVERRIDES: dict[str, dict] = {
    # BERT-style models run as causal decoders with is_decoder (else they are bidirectional encoders)
    **{a: dict(is_decoder=True) for a in (
        "bert", "bert-generation", "big_bird", "camembert", "data2vec-text", "electra", "ernie", "megatron-bert",
        "rembert", "roberta", "roberta-prelayernorm", "roc_bert", "roformer", "xlm-roberta", "xlm-roberta-xl",
        "xmod")},
    "codegen": dict(rotary_dim=8),
    "gptj": dict(rotary_dim=8),
    "modernbert-decoder": dict(local_attention=8),
    "cohere_compass_text": dict(rope_parameters={
        t: {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}
        for t in ("full_attention", "sliding_attention")}),
    # LFM2 checkpoints mix convolution and attention layers (the default config has no convolution layer;
    # LFM2-MoE's none at all)
    "lfm2": dict(layer_types=["conv", "full_attention"]),
    "lfm2_moe": dict(layer_types=["conv", "full_attention"], num_dense_layers=1),
    # clip_qkv None fails in transformers' DBRX
    "dbrx": dict(d_model=64, n_heads=4, n_layers=2, attn_config=dict(kv_n_heads=2, rope_theta=10000.0, clip_qkv=8.0),
                 ffn_config=dict(hidden_size=64, ffn_hidden_size=128, moe_num_experts=4, moe_top_k=2)),
    "dots1": dict(n_shared_experts=1),
    "dots3_note_text": dict(num_key_value_heads=4, index_head_dim=16, index_n_heads=2, index_topk=8),
    "gemma3n_text": dict(num_hidden_layers=4, num_kv_shared_layers=2, vocab_size_per_layer_input=256,
                         hidden_size_per_layer_input=16, laurel_rank=8, intermediate_size=[128] * 4,
                         layer_types=["sliding_attention", "full_attention"] * 2, altup_num_inputs=2),
    "gemma4_text": dict(vocab_size_per_layer_input=256, hidden_size_per_layer_input=16, global_head_dim=32),
    "gemma4_assistant": dict(text_config=dict(hidden_size_per_layer_input=0, vocab_size_per_layer_input=0)),
    "gpt_neo": dict(attention_types=[[["global", "local"], 1]], window_size=8),
    "kolibri1_1": dict(index_num_heads=1),
    "mamba2": dict(num_heads=4, head_dim=32, n_groups=1, state_size=16),
    "reformer": dict(is_decoder=True, axial_pos_embds_dim=[32, 32], axial_pos_shape=[16, 32],
                     attn_layers=["local", "lsh"]),
    "xlnet": dict(d_head=16),
    "zaya": dict(num_experts_per_tok=1),
    # a layer of each kind: recurrent (Mamba) and attention
    "jamba": dict(attn_layer_period=2, attn_layer_offset=1),
    "recurrent_gemma": dict(num_hidden_layers=3),
    # its default config leaves the sparse layers' indexer unsized
    "qwen4_exp_text": dict(indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=16, indexer_budget=16,
                           indexer_compress_ratio=4),
    "blt": dict(encoder_hash_byte_group_vocab=64),
}

#: what a default config needs to be valid: a drafter's text config has no per-layer inputs
DEFAULTS = {"gemma4_assistant": dict(text_config=dict(
    model_type="gemma4_text", hidden_size_per_layer_input=0, vocab_size_per_layer_input=0))}

#: calls a model needs before it runs (what a user of it calls too)
SETUP = {"xmod": lambda model: model.set_default_language("en_XX")}


def _default(arch: str):
    """``arch``'s default config, or its text part where the model takes only that."""
    cls = getattr(transformers, ARCHS[arch])
    default = AutoConfig.for_model(arch, **DEFAULTS.get(arch, {}))
    return default if isinstance(default, cls.config_class) else default.get_text_config(decoder=True)


def _config_class(arch: str) -> type:
    """The class of ``_default(arch)``, without making one."""
    config_class, cls = CONFIG_MAPPING[arch], getattr(transformers, ARCHS[arch])
    composite = not issubclass(config_class, cls.config_class) and "text_config" in config_class.sub_configs
    return cls.config_class if composite else config_class


def _small_keys(default) -> dict:
    """``SMALL``'s keys that ``default`` (a config) has, its sub-configs' (vision, audio towers) shrunk alike."""
    keys = set(default.to_dict()) | set(getattr(default, "attribute_map", {}))
    kw = {k: v for k, v in SMALL.items() if k in keys}
    kw.update({k: v for k, v in TOKEN_IDS.items() if getattr(default, k, None) is not None})
    if "kv_lora_rank" in keys:
        kw["num_key_value_heads"] = SMALL["num_attention_heads"]  # latent attention expands K/V to every head
        kw["head_dim"] = SMALL["qk_rope_head_dim"]  # what their rotary embedding spans
    if getattr(default, "sliding_window", None) is None:
        kw.pop("sliding_window", None)  # a window only where the architecture has one
    types = list(dict.fromkeys(getattr(default, "layer_types", None) or ()))
    field = getattr(default, "attribute_map", {}).get("layer_types", "layer_types")
    settable = not isinstance(getattr(type(default), field, None), property)
    if len(types) > 1 and settable and "num_hidden_layers" in kw:  # a layer of each type, in their first order
        kw.update(layer_types=types, num_hidden_layers=len(types))
    for name in getattr(default, "sub_configs", {}):
        sub = getattr(default, name, None)
        if sub is not None and hasattr(sub, "to_dict"):
            kw[name] = {"model_type": sub.model_type, **_small_keys(sub)}
    return kw


def tiny_config(arch: str):
    """``arch``'s config with ``SMALL``'s keys it has and its ``OVERRIDES`` (a sub-config's merged in)."""
    default = _default(arch)
    kw = _small_keys(default)
    for k, v in OVERRIDES.get(arch, {}).items():
        kw[k] = {**kw[k], **v} if isinstance(v, dict) and isinstance(kw.get(k), dict) else v
    return type(default)(**kw)


def duplicate_of(arch: str) -> str | None:
    """The architecture swept instead of ``arch``: the same model class on the same config class."""
    twins = _twins()[(_config_class(arch), ARCHS[arch])]
    # the one the config class is named for (gpt2 rather than gpt-sw3), else the first listed
    first = next((a for a in twins if _config_class(a).model_type == a), twins[0])
    return None if first == arch else first


@functools.cache
def _twins() -> dict[tuple, list[str]]:
    out: dict[tuple, list[str]] = {}
    for a in ARCHS:
        out.setdefault((_config_class(a), ARCHS[a]), []).append(a)
    return out


def build(arch: str, seed: int = 0):
    """The tiny float32 model of ``arch`` (the same weights for the same seed), in eval mode."""
    cls = getattr(transformers, ARCHS[arch])
    config = tiny_config(arch)
    torch.manual_seed(seed)
    model = cls(config).eval()
    model.generation_config.eos_token_id = None  # generate the asked number of tokens
    SETUP.get(arch, lambda _: None)(model)
    return model
