"""kvpool.vllm.blocks: vLLM CPU_ATTN blocks <-> pool blocks (torch only; runs without vLLM)."""

from __future__ import annotations

import pytest
import torch

from kvpool.vllm.blocks import copy_pool_to_vllm, copy_vllm_to_pool


def _cpu_attn_cache(num_blocks, heads, kbs, d, seed):
    """A CPU_ATTN layer cache with random K/V, and the same as key[b, h, t, :], value[b, h, t, :] per kernel block."""
    g = torch.Generator().manual_seed(seed)
    cache = torch.randn(num_blocks, heads, kbs, 2 * d, generator=g).to(torch.bfloat16)
    kv = cache.view(num_blocks, heads, 2 * kbs, d)  # how CPUAttentionBackendImpl reads it
    key, value = kv.chunk(2, dim=2)
    return cache, key, value


@pytest.mark.parametrize("r", [1, 2])
def test_round_trip_matches_cpu_attn_semantics(r):
    layers, heads, d, kbs = 3, 2, 32, 32
    bs = r * kbs
    n_vllm, n_pool = 6, 5
    caches = [_cpu_attn_cache(n_vllm * r, heads, kbs, d, seed=l) for l in range(layers)]
    pool = torch.zeros(n_pool, layers, 2, heads, bs, d, dtype=torch.bfloat16)
    vllm_ids, pool_ids = [4, 1, 3], [0, 3, 2]
    for l, (cache, key, value) in enumerate(caches):
        copy_vllm_to_pool(cache, bs, pool, l, vllm_ids, pool_ids)
    for l, (cache, key, value) in enumerate(caches):
        for vb, pb in zip(vllm_ids, pool_ids):
            for j in range(r):  # vLLM block vb is kernel blocks vb*r .. vb*r+r-1
                kb = vb * r + j
                assert torch.equal(pool[pb, l, 0, :, j * kbs:(j + 1) * kbs], key[kb])
                assert torch.equal(pool[pb, l, 1, :, j * kbs:(j + 1) * kbs], value[kb])
    # and back, into other vLLM blocks of fresh caches
    for l, (cache, key, value) in enumerate(caches):
        fresh = torch.zeros_like(cache)
        copy_pool_to_vllm(pool, l, fresh, bs, pool_ids, [0, 2, 5])
        for src, dst in zip(vllm_ids, [0, 2, 5]):
            assert torch.equal(fresh.view(n_vllm, r, heads, kbs, 2 * d)[dst], cache.view(n_vllm, r, heads, kbs, 2 * d)[src])
        untouched = [b for b in range(n_vllm) if b not in (0, 2, 5)]
        assert not fresh.view(n_vllm, -1)[untouched].any()


def test_refuses_other_layouts():
    pool = torch.zeros(2, 1, 2, 2, 32, 32)
    with pytest.raises(ValueError):
        copy_vllm_to_pool(torch.zeros(4, 2, 32, 32, 2), 32, pool, 0, [0], [0])  # not 4-d
    with pytest.raises(ValueError):
        copy_vllm_to_pool(torch.zeros(4, 2, 32, 64), 48, pool, 0, [0], [0])  # block size not a multiple


def test_kvpool_vllm_imports_without_vllm():
    import subprocess
    import sys

    code = ("import sys, kvpool, kvpool.vllm, kvpool.vllm.blocks; "
            "assert 'vllm' not in sys.modules, 'kvpool.vllm pulled in vllm'")
    subprocess.run([sys.executable, "-c", code], check=True)
