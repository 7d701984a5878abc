"""The fused layers' elementwise steps: plain torch (CPU, and the reference), Triton kernels on CUDA.

Each function computes what transformers' Llama-family modules compute
between two matmuls, in one pass over the activations where Triton runs:

* ``add_rms_norm``: the residual add and the next RMSNorm (the new residual
  is kept for the add after the next block);
* ``silu_and_mul``: ``silu(gate) * up`` from the merged gate/up projection;
* ``rotary_split``: the merged QKV projection split into contiguous
  ``q [T, Hq, D]``, ``k``, ``v [T, Hkv, D]`` with RoPE applied to q and k
  (the half-rotation layout of transformers' ``rotate_half``), from a table of
  ``cos`` / ``sin`` halves indexed by position.

The torch versions round where transformers does (bf16 products, a float32
norm), so on the CPU the fused forward gives transformers' logits; the
Triton kernels compute in float32 and round once.  Triton is imported only
for CUDA tensors.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _triton():
    from . import triton_ops  # noqa: PLC0415 - CUDA only: the CPU path never imports triton

    return triton_ops


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``r = x + residual`` (``x`` alone when ``residual`` is None); returns ``(rms_norm(r) * weight, r)``."""
    if x.is_cuda:
        return _triton().add_rms_norm(x, residual, weight, eps)
    r = x if residual is None else x + residual
    h = r.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(r.dtype), r


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for ``gate_up = [gate | up]`` along the last dimension."""
    if gate_up.is_cuda:
        return _triton().silu_and_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def rotary_split(qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 num_heads: int, num_kv_heads: int, head_dim: int
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``qkv [T, (Hq + 2 Hkv) D]`` -> contiguous ``q [T, Hq, D]``, ``k``, ``v [T, Hkv, D]``, RoPE on q and k.

    ``cos``, ``sin``: ``[positions, D / 2]`` in the model's dtype (both halves
    of transformers' table are equal).
    """
    if qkv.is_cuda:
        return _triton().rotary_split(qkv, positions, cos, sin, num_heads, num_kv_heads, head_dim)
    t = qkv.shape[0]
    q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
    c = torch.cat([cos[positions], cos[positions]], -1)[:, None, :]
    s = torch.cat([sin[positions], sin[positions]], -1)[:, None, :]

    def rope(x: torch.Tensor, heads: int) -> torch.Tensor:
        x = x.reshape(t, heads, head_dim)
        x1, x2 = x[..., : head_dim // 2], x[..., head_dim // 2:]
        return (x * c + torch.cat((-x2, x1), dim=-1) * s).contiguous()

    return rope(q, num_heads), rope(k, num_kv_heads), v.reshape(t, num_kv_heads, head_dim).contiguous()
