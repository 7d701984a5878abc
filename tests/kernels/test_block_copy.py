"""Batched block copy / gather / scatter against plain torch indexing, CPU and GPU."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpool.kernels.block_copy import copy_blocks, gather_blocks, scatter_blocks


def _has_gpu() -> bool:
    try:
        import cupy  # noqa: F401
    except ImportError:
        return False
    return torch.cuda.is_available()


def needs_gpu(f):
    return pytest.mark.gpu(pytest.mark.skipif(not _has_gpu(), reason="needs a CUDA GPU and CuPy")(f))


def _random_pairs(num_blocks: int, p: int, seed: int) -> torch.Tensor:
    """P (src, dst) pairs obeying the rule: dst unique, no dst is a src."""
    perm = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed))
    dst = perm[:p]
    src_pool = perm[p:]
    src = src_pool[torch.randint(0, len(src_pool), (p,), generator=torch.Generator().manual_seed(seed + 1))]
    return torch.stack([src, dst], 1)


def _pool(shape, dtype, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, shape, dtype=torch.uint8, generator=g).view(-1).view(dtype).view(
        shape[0], *shape[1:-1], -1).to(device)


# ----------------------------------------------------------------------------- CPU

@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float8_e4m3fn])
def test_cpu_copy_matches_indexing(dtype):
    pool = _pool((64, 2, 2, 4, 16, 8 * 4), torch.uint8).view(dtype)
    ref = pool.clone()
    pairs = _random_pairs(64, 20, seed=1)
    copy_blocks(pool, pairs)
    ref[pairs[:, 1]] = ref[pairs[:, 0]]
    assert torch.equal(pool.view(torch.uint8), ref.view(torch.uint8))


def test_cpu_gather_scatter_roundtrip():
    pool = _pool((32, 2, 2, 1, 16, 64), torch.uint8).view(torch.bfloat16)
    ids = torch.tensor([5, 1, 5, 30])
    out = torch.empty((4, *pool.shape[1:]), dtype=pool.dtype)
    gather_blocks(pool, ids, out)
    assert torch.equal(out.view(torch.uint8), pool[ids].view(torch.uint8))
    # scatter through a staging buffer of another dtype with the same row size
    staging = out.reshape(4, -1).view(torch.uint8)
    dst = torch.tensor([0, 2, 3, 4])
    ref = pool.clone()
    ref[dst] = ref[ids]
    scatter_blocks(pool, dst, staging)
    assert torch.equal(pool.view(torch.uint8), ref.view(torch.uint8))


def test_cpu_strided_pool_rows():
    base = _pool((40, 4096), torch.uint8)
    pool = base[::2]  # blocks 4096 B apart 8192 B: rows contiguous, pool not
    ref = pool.clone()
    pairs = torch.tensor([[0, 3], [1, 4], [19, 5]])
    copy_blocks(pool, pairs)
    ref[pairs[:, 1]] = ref[pairs[:, 0]]
    assert torch.equal(pool, ref)
    assert torch.equal(base[1::2], _pool((40, 4096), torch.uint8)[1::2])  # gaps untouched


@settings(max_examples=60, deadline=None)
@given(st.integers(2, 40), st.integers(1, 64), st.data())
def test_cpu_copy_property(num_blocks, block_bytes, data):
    p = data.draw(st.integers(0, num_blocks // 2))
    pool = _pool((num_blocks, block_bytes), torch.uint8, seed=num_blocks)
    ref = pool.clone()
    pairs = _random_pairs(num_blocks, p, seed=data.draw(st.integers(0, 1000)))
    copy_blocks(pool, pairs.numpy().tolist() if p else [])
    if p:
        ref[pairs[:, 1]] = ref[pairs[:, 0]]
    assert torch.equal(pool, ref)


def test_validation_errors():
    pool = torch.zeros(8, 4, 16)
    with pytest.raises(ValueError, match="both a src and a dst"):
        copy_blocks(pool, [[1, 2], [2, 3]])
    with pytest.raises(ValueError, match="dst block ids must be unique"):
        copy_blocks(pool, [[1, 2], [3, 2]])
    with pytest.raises(IndexError, match="out of range"):
        copy_blocks(pool, [[0, 8]])
    with pytest.raises(ValueError, match=r"\[P, 2\]"):
        copy_blocks(pool, [1, 2, 3])
    with pytest.raises(TypeError, match="integers"):
        copy_blocks(pool, torch.zeros(1, 2))
    with pytest.raises(ValueError, match="contiguous"):
        copy_blocks(pool.transpose(1, 2), [[0, 1]])
    with pytest.raises(ValueError, match="rows hold"):
        gather_blocks(pool, [0, 1], torch.empty(2, 4, 8))
    with pytest.raises(ValueError, match="2 rows"):
        gather_blocks(pool, [0, 1], torch.empty(3, 4, 16))
    with pytest.raises(ValueError, match="unique"):
        scatter_blocks(pool, [1, 1], torch.empty(2, 4, 16))
    copy_blocks(pool, torch.empty(0, 2, dtype=torch.int64))  # empty batch: a no-op


# ----------------------------------------------------------------------------- GPU

@needs_gpu
@pytest.mark.parametrize("block_bytes", [32 * 1024, 2 * 1024 * 1024], ids=["32KiB", "2MiB"])
def test_gpu_copy_matches_indexing(block_bytes):
    n = 256 if block_bytes > 1 << 20 else 4096
    pool = torch.randint(0, 256, (n, block_bytes), dtype=torch.uint8, device="cuda").view(torch.bfloat16)
    pool = pool.view(n, 2, 2, -1, 64)  # [blocks, layers, k|v, ..., dim]
    ref = pool.clone()
    pairs = _random_pairs(n, n // 3, seed=7)
    copy_blocks(pool, pairs)
    ref[pairs[:, 1].cuda()] = ref[pairs[:, 0].cuda()]
    torch.cuda.synchronize()
    assert torch.equal(pool.view(torch.uint8), ref.view(torch.uint8))


@needs_gpu
@pytest.mark.parametrize("kernel", ["kvpool_copy_v16_u4", "kvpool_copy_v16_u4_cg", "kvpool_copy_v16_u8_cg",
                                    "kvpool_copy_v16_u4_cs", "kvpool_copy_v16_u8_cs"])
def test_gpu_every_variant_is_correct(kernel):
    pool = torch.randint(0, 256, (512, 48 * 1024 + 16), dtype=torch.uint8, device="cuda")
    ref = pool.clone()
    pairs = _random_pairs(512, 200, seed=3).cuda()
    copy_blocks(pool, pairs, check=False, kernel=kernel, chunk=16 * 1024, threads=128)
    ref[pairs[:, 1]] = ref[pairs[:, 0]]
    assert torch.equal(pool, ref)


@needs_gpu
def test_gpu_gather_scatter_and_side_stream():
    pool = torch.randint(0, 256, (1024, 32 * 1024), dtype=torch.uint8, device="cuda")
    ids = torch.randperm(1024)[:300]
    out = torch.empty(300, 32 * 1024, dtype=torch.uint8, device="cuda")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    gather_blocks(pool, ids, out, stream=s)
    s.synchronize()
    assert torch.equal(out, pool[ids.cuda()])
    dst = torch.randperm(1024)[:300].cuda()
    ref = pool.clone()
    ref[dst] = out
    scatter_blocks(pool, dst, out)
    assert torch.equal(pool, ref)


@needs_gpu
def test_gpu_unaligned_and_odd_sizes_use_the_byte_path():
    raw = torch.randint(0, 256, (100 * 37 + 1,), dtype=torch.uint8, device="cuda")
    pool = raw[1:].view(100, 37)  # base not 16-aligned, 37-byte blocks
    ref = pool.clone()
    pairs = _random_pairs(100, 30, seed=5)
    copy_blocks(pool, pairs)
    ref[pairs[:, 1].cuda()] = ref[pairs[:, 0].cuda()]
    assert torch.equal(pool, ref)


@needs_gpu
def test_gpu_offsets_past_4GiB():
    block = 2 * 1024 * 1024
    n = 2200  # 4.3 GiB: byte offsets need 64 bits
    pool = torch.empty(n, block, dtype=torch.uint8, device="cuda")
    pool[n - 1].random_(0, 256)
    pool[0].zero_()
    copy_blocks(pool, [[n - 1, 0], [1, n - 2]])
    assert torch.equal(pool[0], pool[n - 1]) and torch.equal(pool[n - 2], pool[1])


@needs_gpu
def test_gpu_wrong_device_staging_is_a_clear_error():
    pool = torch.zeros(8, 1024, dtype=torch.uint8, device="cuda")
    with pytest.raises(ValueError, match="stage on the pool's device"):
        gather_blocks(pool, [0, 1], torch.empty(2, 1024, dtype=torch.uint8))


@needs_gpu
def test_gpu_copy_on_an_ipc_mapped_pool_in_a_client_process():
    """The real use: a client maps the daemon's CUDA arena and runs copy-on-write copies on it."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    from kvpoold.memory.cuda_ipc import CudaBackend

    backend = CudaBackend(0)
    try:
        shape = (64, 2, 2, 8, 16, 128)  # [blocks, layers, k|v, heads, tokens, dim] bf16: 128 KiB blocks
        arena = backend.create_arena("c0", 64 * 128 * 1024)
        pool = arena.as_tensor("bfloat16", shape)
        pool.copy_(torch.randn(shape, device="cuda").to(torch.bfloat16))
        ref = pool.clone()
        torch.cuda.synchronize()
        pairs = _random_pairs(64, 20, seed=11)
        d = {k: "hex:" + v.hex() if isinstance(v, bytes) else v for k, v in arena.descriptor.to_dict().items()}
        code = (
            "import json, sys, torch\n"
            "from kvpool.ipc import open_arena\n"
            "from kvpool.protocol import ArenaDescriptor\n"
            "from kvpool.kernels.block_copy import copy_blocks\n"
            "d = {k: bytes.fromhex(v[4:]) if isinstance(v, str) and v.startswith('hex:') else v\n"
            "     for k, v in json.loads(sys.argv[1]).items()}\n"
            "m = open_arena(ArenaDescriptor(**d))\n"
            f"pool = m.as_tensor('bfloat16', {shape!r})\n"
            "copy_blocks(pool, json.loads(sys.argv[2]))\n"
            "torch.cuda.synchronize()\n"
        )
        env = dict(os.environ)
        repo = str(Path(__file__).resolve().parents[2])
        env["PYTHONPATH"] = os.pathsep.join([repo, env.get("PYTHONPATH", "")])
        out = subprocess.run([sys.executable, "-c", code, json.dumps(d), json.dumps(pairs.tolist())],
                             env=env, capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        ref[pairs[:, 1].cuda()] = ref[pairs[:, 0].cuda()]
        assert torch.equal(pool.view(torch.uint8), ref.view(torch.uint8))
    finally:
        backend.close()
