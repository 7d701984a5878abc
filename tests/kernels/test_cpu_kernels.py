"""CPU (Numba) kernels against the float64 reference.

Random shapes, lengths (0, 1, exact block multiples, ragged), GQA groups,
block tables that are random permutations of the pool, per-layer strided
views of the pool, outputs poisoned with NaN before every call.
"""

import random

import pytest
import torch

from kvpool.kernels import paged_decode_attention, paged_prefill_attention, write_kv
from kvpool.kernels import reference as ref
from kvpool.kernels.testing import assert_matches_reference, make_case, poisoned

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _lengths(rng, bs, n):
    special = [0, 1, bs, 2 * bs, bs - 1, bs + 1, 3 * bs]
    return [rng.choice(special) if rng.random() < 0.5 else rng.randint(0, 12 * bs) for _ in range(n)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("seed", range(6))
def test_decode_matches_reference(dtype, seed):
    rng = random.Random(seed)
    bs = rng.choice([8, 16, 32])
    d = rng.choice([64, 128, 80])  # 80: the CPU path takes any head_dim
    hkv, group = rng.choice([1, 2, 4]), rng.choice([1, 2, 3, 4, 8])
    lens = _lengths(rng, bs, rng.randint(1, 6))
    case = make_case(lens, num_kv_heads=hkv, block_size=bs, head_dim=d, dtype=dtype, seed=seed)
    g = torch.Generator().manual_seed(seed)
    q = (2 * torch.randn(len(lens), hkv * group, d, generator=g)).to(dtype)
    out = poisoned(q.shape, dtype)
    scale = rng.choice([None, 0.3])
    res = paged_decode_attention(q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens, scale=scale, out=out)
    assert res is out
    want = ref.paged_decode_reference(q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens, scale)
    assert_matches_reference(out, want, "cpu")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("seed", range(5))
def test_prefill_matches_reference(dtype, seed):
    rng = random.Random(100 + seed)
    bs = rng.choice([8, 16, 32])
    d = rng.choice([64, 128])
    hkv, group = rng.choice([1, 2]), rng.choice([1, 2, 4, 5, 8])
    b = rng.randint(1, 5)
    lens, q_lens = [], []
    for _ in range(b):
        n = rng.choice([0, 1, bs, 2 * bs + 3, rng.randint(0, 6 * bs)])
        q_lens.append(rng.choice([0, min(n, 1), n, rng.randint(0, n)]))  # empty, decode-like, full, chunked
        lens.append(n)
    case = make_case(lens, num_kv_heads=hkv, block_size=bs, head_dim=d, dtype=dtype, seed=seed)
    cu = torch.tensor([0] + q_lens, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    t = int(cu[-1])
    q = torch.randn(t, hkv * group, d, generator=torch.Generator().manual_seed(seed)).to(dtype)
    out = poisoned(q.shape, dtype)
    paged_prefill_attention(q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens, cu, out=out)
    want = ref.paged_prefill_reference(q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens, cu)
    assert_matches_reference(out, want, "cpu")


def test_decode_on_contiguous_caches_and_default_out():
    case = make_case([5, 40, 0], num_kv_heads=2, block_size=16, head_dim=64)
    k, v = case.k_cache.contiguous(), case.v_cache.contiguous()
    q = torch.randn(3, 8, 64)
    out = paged_decode_attention(q, k, v, case.block_tables, case.seq_lens)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert_matches_reference(out, ref.paged_decode_reference(q, k, v, case.block_tables, case.seq_lens), "cpu")
    assert torch.all(out[2] == 0)  # seq_len 0 → zeros


def test_prefill_with_fewer_keys_than_queries_gives_zero_rows():
    case = make_case([3], num_kv_heads=1, block_size=8, head_dim=64)
    q = torch.randn(5, 2, 64)
    cu = torch.tensor([0, 5], dtype=torch.int32)
    out = paged_prefill_attention(q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens, cu)
    want = ref.paged_prefill_reference(q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens, cu)
    assert_matches_reference(out, want, "cpu")
    assert torch.all(out[:2] == 0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_write_kv_into_strided_layer_view(dtype):
    case = make_case([40, 17], num_kv_heads=2, block_size=16, head_dim=64, dtype=dtype, spare_blocks=4, seed=3)
    before = case.kv_cache.clone()
    n_slots = case.kv_cache.shape[0] * 16
    g = torch.Generator().manual_seed(1)
    slots = torch.randperm(n_slots, generator=g)[:9].to(torch.int64)
    slots[[2, 5]] = -1  # padding
    key = torch.randn(9, 2, 64, generator=g).to(dtype)
    value = torch.randn(9, 2, 64, generator=g).to(dtype)
    want_k, want_v = ref.write_kv_reference(key, value, case.k_cache, case.v_cache, slots)
    write_kv(key, value, case.k_cache, case.v_cache, slots)
    assert torch.equal(case.k_cache.double(), torch.from_numpy(want_k))
    assert torch.equal(case.v_cache.double(), torch.from_numpy(want_v))
    other = 1 - case.layer
    assert torch.equal(case.kv_cache[:, other], before[:, other])  # other layer untouched


def test_write_then_prefill_round_trip():
    """Chunked prefill as a model would run it: write the chunk's K/V, then attend."""
    bs, hkv, d, group = 16, 2, 64, 4
    case = make_case([37], num_kv_heads=hkv, block_size=bs, head_dim=d, extra_cols=0)
    k_new = torch.randn(12, hkv, d)
    v_new = torch.randn(12, hkv, d)
    pos = torch.arange(25, 37)
    slots = case.block_tables[0].long()[pos // bs] * bs + pos % bs
    write_kv(k_new, v_new, case.k_cache, case.v_cache, slots)
    q = torch.randn(12, hkv * group, d)
    cu = torch.tensor([0, 12], dtype=torch.int32)
    out = paged_prefill_attention(q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens, cu)
    # independent check: contiguous K/V, the last 12 rows being the new ones
    k_all = torch.from_numpy(ref.gather_sequence(case.k_cache, case.block_tables[0], 37))
    assert torch.allclose(k_all[25:], k_new.double())
    want = ref.paged_prefill_reference(q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens, cu)
    assert_matches_reference(out, want, "cpu")
