"""Small random-weight transformers models and their reference generation (no downloads).

The reference is transformers' own path: eager attention and its DynamicCache,
through ``model.generate`` (greedy), one prompt at a time (no padding).
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

ROOT_CONFTEST = str(Path(__file__).resolve().parents[1] / "conftest.py")

#: small GQA geometry: 4 query heads over 2 KV heads, head_dim 16
COMMON = dict(
    num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
    vocab_size=256, max_position_embeddings=512, bos_token_id=None, eos_token_id=None, pad_token_id=None,
    tie_word_embeddings=False,
)
ARCHS = ("llama", "qwen2")


def make_model(arch: str, *, seed: int = 0, dtype=torch.float32, device: str = "cpu", **overrides):
    """A Llama- or Qwen2-style causal LM with random weights (the same for the same seed).

    ``overrides`` change the config (e.g. ``hidden_size=256`` for head_dim 64,
    the smallest the GPU kernels take).
    """
    kw = {**COMMON, **overrides}
    if arch == "llama":
        config = transformers.LlamaConfig(**kw, rope_theta=10000.0)
        cls = transformers.LlamaForCausalLM
    elif arch == "qwen2":
        config = transformers.Qwen2Config(**kw, rope_theta=1000000.0, use_sliding_window=False)
        cls = transformers.Qwen2ForCausalLM
    else:
        raise ValueError(arch)
    # a wider init than the default 0.02 gives logits with clear margins, so greedy
    # choices are decided by the model, not by float rounding between near-ties
    config.initializer_range = 0.2
    torch.manual_seed(seed)
    model = cls(config).to(dtype=dtype, device=device).eval()
    return model


def eager_copy(model):
    """The same weights with transformers' eager attention."""
    ref = copy.deepcopy(model)
    ref.set_attn_implementation("eager")
    return ref


@torch.no_grad()
def reference_generate(ref, prompt: list[int], max_new_tokens: int) -> tuple[list[int], torch.Tensor]:
    """Greedy tokens and the raw logits of each step, from transformers' generate (DynamicCache)."""
    ids = torch.tensor([prompt], device=ref.device)
    out = ref.generate(
        ids, max_new_tokens=max_new_tokens, min_new_tokens=0, do_sample=False, use_cache=True,
        output_logits=True, return_dict_in_generate=True, attention_mask=torch.ones_like(ids),
    )
    tokens = out.sequences[0, len(prompt):].tolist()
    logits = torch.stack([step[0] for step in out.logits]).float().cpu()
    return tokens, logits


def start_daemon(request, *args: str):
    """A kvpoold for a whole test module (the root conftest's ``Daemon``), stopped at its end."""
    root = request.config.pluginmanager.get_plugin(ROOT_CONFTEST)
    d = root.Daemon(*args).start()
    request.addfinalizer(d.stop)
    return d


@torch.no_grad()
def teacher_forced_errors(pm, model, prompts: list[list[int]], steps: int = 5) -> tuple[float, float]:
    """Low-precision check: (kvpool's, transformers eager's) max |logit error| against float32.

    The float32 "truth" is the same weights upcast, eager attention, greedy.
    Both low-precision paths are fed the truth's tokens (teacher forcing), so a
    near-tie cannot send them down another continuation: kvpool through ``pm``
    (prefill, then ``steps`` decode steps), transformers' eager attention in one
    forward over prompt + tokens.  Only attention differs between the two paths
    (the projections and MLPs are the same torch ops), so kvpool's error should
    be no larger than eager's.
    """
    eager = eager_copy(model)
    truth = copy.deepcopy(eager).float()
    refs = [reference_generate(truth, p, steps + 1) for p in prompts]
    want = torch.stack([r[1] for r in refs])  # [B, steps + 1, vocab]
    eager_logits = torch.stack([
        eager(input_ids=torch.tensor([p + t[:steps]], device=model.device)).logits[0, len(p) - 1:].float().cpu()
        for p, (t, _) in zip(prompts, refs)
    ])
    seqs, logits = pm.prefill(prompts)
    got = [logits.float().cpu()]
    for j in range(steps):
        got.append(pm.forward(seqs, [r[0][j] for r in refs]).float().cpu())
    pm.free(seqs)
    got = torch.stack(got, 1)
    return (got - want).abs().max().item(), (eager_logits - want).abs().max().item()
