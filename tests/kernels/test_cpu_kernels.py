"""CPU (Numba) kernels against the float64 reference.

Random shapes, lengths (0, 1, exact block multiples, ragged), GQA groups,
block tables that are random permutations of the pool, per-layer strided
views of the pool, outputs poisoned with NaN before every call. The kernel
walks keys in chunks of ``CHUNK`` and takes one of two paths by the rows of a
work item (tokens x GQA group): rows in vector lanes (16 or more) or dot
products (fewer); the later tests put lengths and causal limits on both sides
of chunk and block boundaries, on both paths.
"""

import os
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from kvpool.kernels import (
    cpu_attention, cpu_numerics, cpu_work, cpu_write_kv, paged_decode_attention, paged_prefill_attention, write_kv,
)
from tests.kernels.support import reference as ref
from tests.kernels.support.testing import assert_matches_reference, make_case, poisoned

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


@pytest.mark.parametrize("side", ["serial", "parallel"])
def test_write_kv_on_both_sides_of_the_parallel_threshold(side):
    """A decode step's few rows are copied serially, a prefill's many on all threads: the same bytes land."""
    hkv, d, bs = 2, 64, 16
    token_bytes = 2 * hkv * d * 4  # its key and value rows, float32
    first_parallel = -(-cpu_write_kv.PARALLEL_MIN_BYTES // token_bytes)
    t = first_parallel if side == "parallel" else first_parallel - 1
    case = make_case([t], num_kv_heads=hkv, block_size=bs, head_dim=d, spare_blocks=8, seed=5)
    g = torch.Generator().manual_seed(2)
    slots = torch.randperm(case.kv_cache.shape[0] * bs, generator=g)[:t].to(torch.int64)
    slots[::97] = -1  # padding
    key, value = torch.randn(t, hkv, d, generator=g), torch.randn(t, hkv, d, generator=g)
    assert (key.numel() * 4 + value.numel() * 4 >= cpu_write_kv.PARALLEL_MIN_BYTES) == (side == "parallel")
    want_k, want_v = ref.write_kv_reference(key, value, case.k_cache, case.v_cache, slots)
    write_kv(key, value, case.k_cache, case.v_cache, slots)
    assert torch.equal(case.k_cache.double(), torch.from_numpy(want_k))
    assert torch.equal(case.v_cache.double(), torch.from_numpy(want_v))


_THREADS_AT_ONCE = """
import threading, numba, torch
from kvpool.kernels import cpu_write_kv, paged_decode_attention, write_kv
from tests.kernels.support.testing import make_case

case = make_case([300] * 16, num_kv_heads=2, block_size=16, head_dim=64)
q = torch.randn(16, 8, 64)
want = paged_decode_attention(q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens)
rows = cpu_write_kv.PARALLEL_MIN_BYTES // (2 * 2 * 64 * 4)  # a parallel copy
errors = []

def worker(i):
    try:
        kv = torch.zeros(rows // 16 + 1, 2, 2, 16, 64)
        new = torch.full((rows, 2, 64), float(i))
        for _ in range(20):
            write_kv(new, new, kv[:, 0], kv[:, 1], torch.arange(rows))
            got = paged_decode_attention(q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens)
            assert torch.equal(got, want)
        for cache in (kv[:, 0], kv[:, 1]):  # [blocks, heads, block_size, D]: slot by slot, this thread's rows
            assert torch.all(cache.transpose(1, 2).reshape(-1, 2, 64)[:rows] == float(i))
    except BaseException as e:
        errors.append(e)

threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
for t in threads:
    t.start()
for t in threads:
    t.join()
assert not errors, errors
print(numba.threading_layer())
"""


def test_parallel_kernels_from_several_threads_at_once():
    """Engines in several threads of one process on Numba's workqueue layer: each launch waits for the
    others (that layer aborts the process on two launches at once)."""
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "NUMBA_THREADING_LAYER": "workqueue"}
    out = subprocess.run([sys.executable, "-c", _THREADS_AT_ONCE], capture_output=True, text=True, cwd=root,
                         env=env, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split()[-1] == "workqueue"


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


def _near_chunks(rng, n):
    """Lengths at and around chunk boundaries (the kernel's online-softmax steps)."""
    c = cpu_attention.CHUNK
    return [rng.choice([c - 1, c, c + 1, 2 * c + 3, 3 * c - 5, rng.randint(1, 4 * c)]) for _ in range(n)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("group", range(1, 9))
def test_prefill_chunk_and_causal_limits(dtype, group):
    """Full, chunked (first query mid-chunk) and short prefills; both kernel paths."""
    rng = random.Random(1000 + group)
    bs = rng.choice([8, 16, 32, 128])
    d = rng.choice([64, 66, 128])  # 66: the 4-wide passes over head_dim leave a remainder
    lens = _near_chunks(rng, 4)
    tile = cpu_work.q_tile(group)
    q_lens = [
        lens[0],  # full prefill: tiles of rows in lanes, the causal diagonal in every chunk
        min(lens[1], rng.choice([tile + 1, cpu_attention.CHUNK + 5])),  # chunked: first query mid-chunk
        min(lens[2], rng.choice([2, 3, 5])),  # a few tokens: dot-product path for small groups
        rng.randint(0, lens[3]),
    ]
    case = make_case(lens, num_kv_heads=2, block_size=bs, head_dim=d, dtype=dtype, seed=group)
    cu = torch.tensor([0] + q_lens, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    g = torch.Generator().manual_seed(group)
    q = (2 * torch.randn(int(cu[-1]), 2 * group, d, generator=g)).to(dtype)
    out = poisoned(q.shape, dtype)
    paged_prefill_attention(q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens, cu, out=out)
    want = ref.paged_prefill_reference(q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens, cu)
    assert_matches_reference(out, want, "cpu")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("group", [1, 3, 4, 5, 8, 16])  # 16: one token already fills the vector lanes
def test_decode_chunk_boundaries(dtype, group):
    rng = random.Random(2000 + group)
    bs = rng.choice([8, 16, 32, 128])
    d = rng.choice([64, 66, 128])
    lens = _near_chunks(rng, 5) + [0, 1]
    case = make_case(lens, num_kv_heads=2, block_size=bs, head_dim=d, dtype=dtype, seed=group)
    q = (2 * torch.randn(len(lens), 2 * group, d, generator=torch.Generator().manual_seed(group))).to(dtype)
    out = poisoned(q.shape, dtype)
    paged_decode_attention(q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens, out=out)
    want = ref.paged_decode_reference(q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens)
    assert_matches_reference(out, want, "cpu")


def test_prefill_with_strided_q():
    """q read in place as the cache's type: a view with a head stride, not a contiguous copy."""
    case = make_case([150, 70], num_kv_heads=2, block_size=16, head_dim=64, dtype=torch.bfloat16, seed=5)
    cu = torch.tensor([0, 150, 190], dtype=torch.int32)
    big = torch.randn(190, 16, 64, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    q = big[:, ::2]  # [190, 8, 64], heads 2 apart
    assert not q.is_contiguous()
    out = poisoned(q.shape, q.dtype)
    paged_prefill_attention(q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens, cu, out=out)
    want = ref.paged_prefill_reference(q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens, cu)
    assert_matches_reference(out, want, "cpu")


@pytest.mark.parametrize("seed", range(4))
def test_work_items_cover_every_query_once_heavy_and_light_alternating(seed):
    rng = random.Random(seed)
    q_lens = [rng.choice([0, 1, 17, rng.randint(0, 300)]) for _ in range(rng.randint(1, 6))]
    lens = np.array([n + rng.randint(0, 100) for n in q_lens], dtype=np.int32)
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    tile = rng.choice([1, 16, 32, 128])
    items = cpu_work.work_items(cu, 3, tile, lens)
    seen = np.zeros((int(cu[-1]), 3), dtype=np.int64)
    for b, h, t0, n in items.tolist():
        assert 1 <= n <= tile
        seen[cu[b] + t0 : cu[b] + t0 + n, h] += 1
    assert np.all(seen == 1)
    first = lens[items[::3, 0]] - (cu[1:] - cu[:-1])[items[::3, 0]]
    work = items[::3, 3] * (first + items[::3, 2] + items[::3, 3])  # tokens x keys seen, per tile
    assert np.all(work[0::2][:-1] >= work[2::2])  # heaviest first, then the next heaviest ...
    assert np.all(work[1::2][:-1] <= work[3::2])  # ... alternating with the lightest upward


def test_exp_polynomial():
    """The kernel's vectorizable exp: a few ulp where exp(x) is a normal float, 0 below."""
    x = np.concatenate([np.linspace(-87.2, 88.0, 200001, dtype=np.float32), np.float32([-87.4, -1e30, -np.inf])])
    y = np.empty_like(x)
    _exp_into(x, y)
    want = np.exp(x.astype(np.float64))
    normal = x > -87.2
    assert np.all(np.abs(y[normal] - want[normal]) <= 5e-7 * want[normal])
    assert np.all(y[-3:] == 0)


@cpu_numerics.numba.njit(fastmath=cpu_numerics.FASTMATH)
def _exp_into(x, y):
    for i in range(x.size):
        y[i] = cpu_numerics.fast_exp(x[i])


def test_f16_conversion_is_exact_for_every_bit_pattern():
    bits = np.arange(1 << 16, dtype=np.uint16)
    got = np.empty(bits.size, np.float32)
    _f16_into(bits, got)
    want = bits.view(np.float16).astype(np.float32)
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))  # NaN payloads and -0 included


@cpu_numerics.numba.njit(fastmath=cpu_numerics.FASTMATH)
def _f16_into(bits, y):
    for i in range(bits.size):
        y[i] = cpu_numerics.f16_to_f32(bits[i])
