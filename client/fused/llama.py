"""The forward of a Llama-family transformers model with its layers' small kernels fused.

transformers runs each decoder layer as some forty kernels: the matmuls, and
between them RMSNorm (six elementwise ops), RoPE (slices, a concatenation,
products), the transposes to the attention's layout, SiLU, the gate product
and the residual adds.  At a decode step's few rows each costs a launch's
worth of GPU time, more than the weights they touch.  ``FusedLlama`` runs the
same model with, per layer, four matmuls (QKV, O, gate/up, down, each on a
merged weight), kvpool's K/V write and attention, and three fused
elementwise steps (``kvpool.fused.ops``).  The weights stay the model's: the
q/k/v and gate/up projections' parameters become views of one merged tensor
each (same values, no second copy), so transformers' own forward still runs
on them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..hf import PagedBatch, paged_attention
from . import ops

#: model types whose decoder layers are pre-norm attention + gated SiLU MLP with RMSNorm, nothing else
_FAMILY = ("llama", "mistral", "qwen2")
#: RoPE types whose frequencies do not depend on the sequence's length (one table serves every step)
_STATIC_ROPE = ("default", "linear", "llama3", "yarn")


class UnsupportedFusion(Exception):
    """The model is not one ``FusedLlama`` computes exactly; the message says why."""


def fusion_blocker(model) -> str | None:
    """Why ``FusedLlama`` cannot run ``model`` (a transformers causal LM), or ``None`` when it can."""
    cfg = model.config
    if getattr(cfg, "model_type", None) not in _FAMILY:
        return f"model type {getattr(cfg, 'model_type', None)!r} is not one of {_FAMILY}"
    if getattr(cfg, "hidden_act", "silu") != "silu":
        return f"activation {cfg.hidden_act!r} is not silu"
    inner = getattr(model, "model", None)
    rope = getattr(getattr(inner, "rotary_emb", None), "rope_type", None)
    if rope not in _STATIC_ROPE:
        return f"RoPE type {rope!r} is not one of {_STATIC_ROPE}"
    for layer in inner.layers:
        attn = layer.self_attn
        if getattr(attn, "sliding_window", None) is not None:
            return "a layer has a sliding window"
        if any(hasattr(attn, n) for n in ("q_norm", "k_norm")):
            return "the attention normalizes q / k"
        if set(dict(layer.named_children())) != {"self_attn", "mlp", "input_layernorm", "post_attention_layernorm"}:
            return f"decoder layer {type(layer).__name__} has other parts"
    return None


def _merge(linears: list[torch.nn.Linear]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One weight (and bias) for ``linears`` side by side; their parameters become views of it."""
    weight = torch.cat([m.weight.data for m in linears])
    has_bias = [m.bias is not None for m in linears]
    bias = None
    if any(has_bias):
        bias = torch.cat([m.bias.data if m.bias is not None else torch.zeros(m.out_features, dtype=weight.dtype,
                                                                                device=weight.device)
                          for m in linears])
    row = 0
    for m, hb in zip(linears, has_bias):
        m.weight.data = weight[row:row + m.out_features]
        if hb:
            m.bias.data = bias[row:row + m.out_features]
        row += m.out_features
    return weight, bias


class _Layer:
    """One decoder layer's merged weights and shapes."""

    def __init__(self, layer, index: int) -> None:
        attn, mlp = layer.self_attn, layer.mlp
        self.index = index
        self.qkv_w, self.qkv_b = _merge([attn.q_proj, attn.k_proj, attn.v_proj])
        self.gate_up_w, self.gate_up_b = _merge([mlp.gate_proj, mlp.up_proj])
        self.o, self.down = attn.o_proj, mlp.down_proj
        self.in_norm, self.post_norm = layer.input_layernorm, layer.post_attention_layernorm
        self.scaling = attn.scaling
        self.head_dim = attn.head_dim
        self.num_heads = attn.q_proj.out_features // attn.head_dim
        self.num_kv_heads = attn.k_proj.out_features // attn.head_dim


def _eps(norm) -> float:
    return getattr(norm, "variance_epsilon", None) or getattr(norm, "eps")


class FusedLlama:
    """``PagedModel.run_batch``'s forward for a Llama-family model, with fused elementwise steps.

    Args:
        model: the transformers causal LM (``fusion_blocker`` must pass).
        max_positions: the longest sequence it will run (rows of the RoPE table).

    Raises:
        UnsupportedFusion: the model is not one this forward computes exactly.
    """

    def __init__(self, model, max_positions: int) -> None:
        reason = fusion_blocker(model)
        if reason is not None:
            raise UnsupportedFusion(f"{type(model).__name__}: {reason}")
        inner = model.model
        self.embed, self.final_norm, self.lm_head = inner.embed_tokens, inner.norm, model.lm_head
        self.layers = [_Layer(layer, i) for i, layer in enumerate(inner.layers)]
        self.cos, self.sin = _rope_table(inner.rotary_emb, max_positions, self.layers[0].head_dim,
                                         self.embed.weight)
        self.max_positions = max_positions

    @torch.no_grad()
    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: PagedBatch,
                 logits_index: torch.Tensor) -> torch.Tensor:
        """The logits of rows ``logits_index`` of the packed tokens ``input_ids`` (as ``PagedModel.run_batch``)."""
        x, residual = self.embed(input_ids), None
        for layer in self.layers:
            h, residual = ops.add_rms_norm(x, residual, layer.in_norm.weight, _eps(layer.in_norm))
            q, k, v = ops.rotary_split(F.linear(h, layer.qkv_w, layer.qkv_b), positions, self.cos, self.sin,
                                       layer.num_heads, layer.num_kv_heads, layer.head_dim)
            attn = paged_attention(batch, layer.index, q, k, v, scaling=layer.scaling)
            x = layer.o(attn.view(attn.shape[0], -1))
            h, residual = ops.add_rms_norm(x, residual, layer.post_norm.weight, _eps(layer.post_norm))
            x = layer.down(ops.silu_and_mul(F.linear(h, layer.gate_up_w, layer.gate_up_b)))
        h, _ = ops.add_rms_norm(x[logits_index], residual[logits_index], self.final_norm.weight,
                                _eps(self.final_norm))
        return self.lm_head(h)


def _rope_table(rotary_emb, max_positions: int, head_dim: int, like: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' own ``cos`` / ``sin`` for positions ``0..max_positions-1``, first halves (``[P, D/2]``)."""
    pos = torch.arange(max_positions, device=like.device)[None]
    cos, sin = rotary_emb(like[:1], pos)  # computed in float32, rounded to the model's dtype
    cos, sin = cos[0], sin[0]
    half = head_dim // 2
    if cos.shape[-1] != head_dim or not torch.equal(cos[:, :half], cos[:, half:]):
        raise UnsupportedFusion("the RoPE table does not rotate the two halves of every head")
    return cos[:, :half].contiguous(), sin[:, :half].contiguous()
