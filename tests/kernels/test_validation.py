"""The wrappers reject bad arguments with errors that name the argument."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvpool.kernels import paged_decode_attention, paged_prefill_attention, write_kv
from kvpool.kernels._validate import check_attention
from tests.kernels.support.testing import make_case


@pytest.fixture
def case():
    return make_case([5, 20], num_kv_heads=2, block_size=8, head_dim=64)


def _decode(case, **over):
    args = dict(
        q=torch.randn(2, 4, 64),
        k_cache=case.k_cache,
        v_cache=case.v_cache,
        block_tables=case.block_tables,
        seq_lens=case.seq_lens,
    )
    args.update(over)
    return paged_decode_attention(**args)


@pytest.mark.parametrize(
    "over, exc, words",
    [
        (dict(q=[[1.0]]), TypeError, "q must be a torch.Tensor"),
        (dict(q=torch.randn(2, 4)), ValueError, "q must have 3 dimensions"),
        (dict(q=torch.randn(2, 4, 64, dtype=torch.float16)), TypeError, "q dtype"),
        (dict(q=torch.randn(2, 3, 64)), ValueError, "multiple of the cache's 2 KV heads"),
        (dict(q=torch.randn(2, 4, 32)), ValueError, "head_dim 32"),
        (dict(q=torch.randn(3, 4, 64)), ValueError, "one query per sequence"),
        (dict(q=torch.randn(2, 64, 4).transpose(1, 2)), ValueError, "q must be contiguous along head_dim"),
        (dict(q=torch.randn(2, 4, 64, device="meta")), ValueError, "q is on meta"),
        (dict(block_tables="x"), TypeError, "block_tables must be a torch.Tensor"),
        (dict(seq_lens=torch.tensor([5, 20])), TypeError, "seq_lens must have dtype torch.int32"),
        (dict(seq_lens=torch.tensor([5], dtype=torch.int32)), ValueError, "seq_lens has 1 entries"),
        (dict(seq_lens=torch.tensor([5, -1], dtype=torch.int32)), ValueError, "seq_lens must be >= 0"),
        (dict(seq_lens=torch.tensor([5, 999], dtype=torch.int32)), ValueError, "capacity"),
        (dict(scale="big"), TypeError, "scale must be a finite float"),
        (dict(out=torch.empty(2, 4, 63)), ValueError, "out must have shape"),
        (dict(out=torch.empty(2, 4, 64, dtype=torch.float16)), TypeError, "out dtype"),
        (dict(out=torch.empty(2, 64, 4).transpose(1, 2)), ValueError, "out must be contiguous"),
        (dict(max_seq_len=-2), ValueError, "max_seq_len must be >= 0"),
        (dict(min_seq_len=1.5), TypeError, "min_seq_len must be an int"),
        (dict(min_seq_len=-1), ValueError, "min_seq_len must be >= 0"),
        (dict(max_seq_len=4, min_seq_len=5), ValueError, "min_seq_len 5 exceeds max_seq_len 4"),
    ],
)
def test_decode_argument_errors(case, over, exc, words):
    with pytest.raises(exc, match=words):
        _decode(case, **over)


def test_cache_layout_errors(case):
    k, v = case.k_cache, case.v_cache
    with pytest.raises(ValueError, match="k_cache must be contiguous inside a block"):
        _decode(case, k_cache=k.transpose(1, 2).contiguous().transpose(1, 2))  # token-major
    with pytest.raises(TypeError, match="v_cache dtype"):
        _decode(case, v_cache=v.double())
    with pytest.raises(ValueError, match="v_cache shape"):
        _decode(case, v_cache=v[:-1])
    with pytest.raises(ValueError, match="k_cache must have 4 dimensions"):
        _decode(case, k_cache=case.kv_cache)
    with pytest.raises(TypeError, match="k_cache must have dtype"):
        _decode(case, k_cache=k.to(torch.int16), v_cache=v.to(torch.int16))


def test_block_table_value_errors(case):
    bt = case.block_tables.clone()
    bt[1, 1] = case.kv_cache.shape[0]  # in use (seq 1 has 3 blocks) and past the pool
    with pytest.raises(ValueError, match="block_tables entries in use"):
        _decode(case, block_tables=bt)
    with pytest.raises(TypeError, match="block_tables must have dtype torch.int32"):
        _decode(case, block_tables=case.block_tables.long())
    with pytest.raises(ValueError, match="block_tables has|seq_lens has"):
        _decode(case, block_tables=case.block_tables[:1])


def test_prefill_cu_seqlens_errors(case):
    q = torch.randn(6, 4, 64)
    base = (q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens)
    with pytest.raises(ValueError, match="cu_seqlens_q must have num_seqs \\+ 1 = 3 entries"):
        paged_prefill_attention(*base, torch.tensor([0, 6], dtype=torch.int32))
    with pytest.raises(TypeError, match="cu_seqlens_q must have dtype torch.int32"):
        paged_prefill_attention(*base, torch.tensor([0, 2, 6]))
    with pytest.raises(ValueError, match="end at T=6"):
        paged_prefill_attention(*base, torch.tensor([0, 2, 5], dtype=torch.int32))


def test_write_kv_errors(case):
    key = torch.randn(3, 2, 64)
    slots = torch.tensor([0, 1, 2])
    with pytest.raises(TypeError, match="slot_mapping must have dtype torch.int64"):
        write_kv(key, key, case.k_cache, case.v_cache, slots.int())
    with pytest.raises(ValueError, match=r"key must have shape \[T, 2, 64\]"):
        write_kv(torch.randn(3, 4, 64), key, case.k_cache, case.v_cache, slots)
    with pytest.raises(ValueError, match="value shape"):
        write_kv(key, key[:2], case.k_cache, case.v_cache, slots)
    with pytest.raises(ValueError, match="slot_mapping has 2 entries"):
        write_kv(key, key, case.k_cache, case.v_cache, slots[:2])
    with pytest.raises(TypeError, match="value dtype"):
        write_kv(key, key.half(), case.k_cache, case.v_cache, slots)
    with pytest.raises(ValueError, match="past the pool's last slot"):
        write_kv(key, key, case.k_cache, case.v_cache, torch.tensor([0, 1, 10**6]))


def test_gpu_limits_are_checked_before_launch(case):
    """The GPU-only limits raise clearly (checked on CPU tensors: no GPU needed)."""
    from kvpool.kernels.cuda_attention import check_gpu_limits

    c = make_case([5], num_kv_heads=1, block_size=8, head_dim=72)
    q = torch.randn(1, 1, 72)
    a = check_attention(q, c.k_cache, c.v_cache, c.block_tables, c.seq_lens, None, None, None)
    with pytest.raises(ValueError, match="head_dim 64, 80, 96, 112, 128, 192, 256; got 72"):
        check_gpu_limits(a, q)
    c = make_case([5], num_kv_heads=1, block_size=4, head_dim=64)
    q = torch.randn(1, 1, 64)
    a = check_attention(q, c.k_cache, c.v_cache, c.block_tables, c.seq_lens, None, None, None)
    with pytest.raises(ValueError, match="block_size >= 8; got 4"):
        check_gpu_limits(a, q)
    c = make_case([5], num_kv_heads=1, block_size=8, head_dim=64)
    q = torch.randn(1, 32, 64)
    a = check_attention(q, c.k_cache, c.v_cache, c.block_tables, c.seq_lens, None, None, None)
    with pytest.raises(ValueError, match="groups up to 16; got 32"):
        check_gpu_limits(a, q)
    q = torch.randn(1, 8, 66)[..., :64]  # head stride 66 * 4 = 264 bytes: not 16-byte aligned
    a = check_attention(q, c.k_cache, c.v_cache, c.block_tables, c.seq_lens, None, None, None)
    with pytest.raises(ValueError, match="q.stride.1. in bytes = 264 must be a multiple of 16"):
        check_gpu_limits(a, q)


def test_cpu_path_never_imports_cupy_or_numba_cuda():
    code = (
        "import sys, torch\n"
        "from kvpool.kernels import paged_decode_attention\n"
        "from tests.kernels.support.testing import make_case\n"
        "c = make_case([3], num_kv_heads=1, block_size=8, head_dim=64)\n"
        "paged_decode_attention(torch.randn(1, 1, 64), c.k_cache, c.v_cache, c.block_tables, c.seq_lens)\n"
        "bad = [m for m in sys.modules if m.startswith(('cupy', 'numba.cuda'))]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).resolve().parents[2])  # for tests.*
