"""Triton kernels of ``kvpool.fused.ops`` (CUDA only): one launch per step where transformers runs several.

Every kernel reads its inputs once and writes each output once; arithmetic in
float32, stored in the activations' dtype.  One program per token row (and per
head for ``rotary_split``): the rows of a decode step are few and wide.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _add_rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, n_cols, eps,
                         HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        x += tl.load(res_ptr + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
        # the residual stream in the model's dtype, as transformers' add leaves it
        x_rounded = x.to(res_out_ptr.dtype.element_ty)
        tl.store(res_out_ptr + row * n_cols + cols, x_rounded, mask=mask)
        x = x_rounded.to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / n_cols + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * n_cols + cols, (x * inv * w).to(out_ptr.dtype.element_ty), mask=mask)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    x = x.contiguous()
    rows, cols = x.numel() // x.shape[-1], x.shape[-1]
    out = torch.empty_like(x)
    res_out = x if residual is None else torch.empty_like(x)
    res_in = x if residual is None else residual.contiguous()
    _add_rms_norm_kernel[(rows,)](x, res_in, weight, out, res_out, cols, eps,
                                  HAS_RESIDUAL=residual is not None, BLOCK=triton.next_power_of_2(cols),
                                  num_warps=_warps(cols))
    return out, res_out


@triton.jit
def _silu_and_mul_kernel(gu_ptr, out_ptr, n_cols, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    g = tl.load(gu_ptr + row * 2 * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(gu_ptr + row * 2 * n_cols + n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * n_cols + cols, (g / (1.0 + tl.exp(-g)) * u).to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate_up = gate_up.contiguous()
    n = gate_up.shape[-1] // 2
    rows = gate_up.numel() // gate_up.shape[-1]
    out = torch.empty(*gate_up.shape[:-1], n, dtype=gate_up.dtype, device=gate_up.device)
    block = 1024
    _silu_and_mul_kernel[(rows, triton.cdiv(n, block))](gate_up, out, n, BLOCK=block, num_warps=4)
    return out


@triton.jit
def _rotary_split_kernel(qkv_ptr, pos_ptr, cos_ptr, sin_ptr, q_ptr, k_ptr, v_ptr,
                         NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HALF: tl.constexpr,
                         BLOCK: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    dim = 2 * HALF
    width = (NUM_HEADS + 2 * NUM_KV_HEADS) * dim
    cols = tl.arange(0, BLOCK)
    mask = cols < HALF
    src = qkv_ptr + token * width + head * dim
    x1 = tl.load(src + cols, mask=mask, other=0.0)
    x2 = tl.load(src + HALF + cols, mask=mask, other=0.0)
    if head < NUM_HEADS + NUM_KV_HEADS:
        pos = tl.load(pos_ptr + token)
        c = tl.load(cos_ptr + pos * HALF + cols, mask=mask, other=0.0).to(tl.float32)
        s = tl.load(sin_ptr + pos * HALF + cols, mask=mask, other=0.0).to(tl.float32)
        a, b = x1.to(tl.float32), x2.to(tl.float32)
        o1 = (a * c - b * s).to(x1.dtype)
        o2 = (b * c + a * s).to(x1.dtype)
        if head < NUM_HEADS:
            dst = q_ptr + (token * NUM_HEADS + head) * dim
        else:
            dst = k_ptr + (token * NUM_KV_HEADS + head - NUM_HEADS) * dim
        tl.store(dst + cols, o1, mask=mask)
        tl.store(dst + HALF + cols, o2, mask=mask)
    else:
        dst = v_ptr + (token * NUM_KV_HEADS + head - NUM_HEADS - NUM_KV_HEADS) * dim
        tl.store(dst + cols, x1, mask=mask)
        tl.store(dst + HALF + cols, x2, mask=mask)


def rotary_split(qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 num_heads: int, num_kv_heads: int, head_dim: int
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    qkv = qkv.contiguous()
    t = qkv.shape[0]
    q = torch.empty(t, num_heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    k = torch.empty(t, num_kv_heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    v = torch.empty_like(k)
    half = head_dim // 2
    _rotary_split_kernel[(t, num_heads + 2 * num_kv_heads)](
        qkv, positions, cos, sin, q, k, v, NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, HALF=half,
        BLOCK=triton.next_power_of_2(half), num_warps=1)
    return q, k, v


def _warps(cols: int) -> int:
    return 4 if cols <= 2048 else 8
