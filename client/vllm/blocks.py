"""vLLM's per-layer KV cache blocks and kvpool's pool blocks: views and copies (torch only).

vLLM's CPU attention backend (``CPU_ATTN``) keeps one tensor per attention
layer, ``[num_kernel_blocks, num_kv_heads, kernel_block_size, 2 * head_dim]``,
which it reads as ``[blocks, heads, 2 * kernel_block_size, head_dim]``: per
block and head, the keys of its tokens, then their values.  A vLLM
(scheduler) block of ``block_size`` tokens is ``r = block_size /
kernel_block_size`` consecutive kernel blocks (``r == 1`` when the two are
equal, the usual case: CPU_ATTN wants multiples of 32 and takes the cache's).

kvpool's pool block is ``[layer, k|v, kv head, token, dim]``
(``kvpool.Layout.block_shape``) with the same ``block_size`` as vLLM's.

Both are viewed as ``[block, k|v, head, r, kernel_block_size, dim]`` (no
copy); a block of one layer is then moved with one strided copy of
``2 * heads * block_size * head_dim`` elements.  Cost: one pass over the
bytes moved (read + write), no temporary; per load or save one gather or
scatter per layer for all of a step's blocks.
"""

from __future__ import annotations

import torch

__all__ = ["vllm_block_view", "pool_layer_view", "copy_pool_to_vllm", "copy_vllm_to_pool"]


def vllm_block_view(kv_layer: torch.Tensor, block_size: int) -> torch.Tensor:
    """``[num_blocks, 2, heads, r, kernel_block_size, head_dim]`` view of one CPU_ATTN layer tensor.

    ``kv_layer``: ``[num_kernel_blocks, heads, kernel_block_size, 2 * head_dim]``, contiguous.
    ``block_size``: vLLM's (scheduler) block size, a multiple of the kernel's.
    """
    if kv_layer.dim() != 4 or not kv_layer.is_contiguous():
        raise ValueError(
            f"expected a contiguous [blocks, kv heads, block size, 2 * head dim] CPU_ATTN cache, got "
            f"{tuple(kv_layer.shape)} (contiguous={kv_layer.is_contiguous()})")
    nkb, heads, kbs, two_d = kv_layer.shape
    if block_size % kbs or two_d % 2:
        raise ValueError(f"block size {block_size} is not a multiple of the kernel's {kbs}, or odd 2*head_dim")
    r = block_size // kbs
    if nkb % r:
        raise ValueError(f"{nkb} kernel blocks do not make whole blocks of {r}")
    d = two_d // 2
    # memory order: block, sub-block j, head, k|v, token, dim
    v = kv_layer.view(nkb // r, r, heads, 2, kbs, d)
    return v.permute(0, 3, 2, 1, 4, 5)  # block, k|v, head, j, token, dim


def pool_layer_view(pool: torch.Tensor, layer: int, r: int) -> torch.Tensor:
    """``[num_blocks, 2, heads, r, block_size / r, head_dim]`` view of one layer of the pool.

    ``pool``: ``client.kv_cache()``, ``[num_blocks, layers, 2, heads, block_size, head_dim]``.
    """
    nb, _, two, heads, bs, d = pool.shape
    return pool[:, layer].view(nb, two, heads, r, bs // r, d)


def _runs(src_ids, dst_ids):
    """(src start, dst start, length) runs where both id lists go up by one together."""
    if len(src_ids) != len(dst_ids):
        raise ValueError("pool_blocks and vllm_blocks differ in length")
    runs = []
    for s, d in zip(map(int, src_ids), map(int, dst_ids)):
        if runs and runs[-1][0] + runs[-1][2] == s and runs[-1][1] + runs[-1][2] == d:
            runs[-1][2] += 1
        else:
            runs.append([s, d, 1])
    return runs


def _copy(dst: torch.Tensor, dst_ids, src: torch.Tensor, src_ids) -> None:
    # one strided copy_ per run of consecutive blocks: ~3-3.8 GB/s on the CPU here, where an
    # indexed gather + scatter (dst[ids] = src[ids]) made 1.6-2 GB/s (NOTES-vllm.md)
    for s, d, n in _runs(src_ids, dst_ids):
        dst[d:d + n].copy_(src[s:s + n])


def copy_pool_to_vllm(pool: torch.Tensor, layer: int, kv_layer: torch.Tensor, block_size: int,
                      pool_blocks, vllm_blocks) -> None:
    """Copy pool blocks ``pool_blocks`` of ``layer`` into vLLM blocks ``vllm_blocks`` (same order)."""
    v = vllm_block_view(kv_layer, block_size)
    _copy(v, vllm_blocks, pool_layer_view(pool, layer, v.shape[3]), pool_blocks)


def copy_vllm_to_pool(kv_layer: torch.Tensor, block_size: int, pool: torch.Tensor, layer: int,
                      vllm_blocks, pool_blocks) -> None:
    """Copy vLLM blocks ``vllm_blocks`` into pool blocks ``pool_blocks`` of ``layer`` (same order)."""
    v = vllm_block_view(kv_layer, block_size)
    _copy(pool_layer_view(pool, layer, v.shape[3]), pool_blocks, v, vllm_blocks)
