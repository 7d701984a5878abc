"""GPU (CUDA via CuPy) kernels against the float64 reference. Run on the GPU machine:

    python3 -m pytest -q -m gpu tests/kernels

Skipped cleanly where torch sees no CUDA device.
"""

import random

import pytest
import torch

from kvpool.kernels import cuda_attention, paged_decode_attention, paged_prefill_attention, write_kv
from kvpool.kernels._validate import check_attention
from tests.kernels.support import reference as ref
from tests.kernels.support import variants
from tests.kernels.support.testing import assert_matches_reference, make_case, poisoned

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
DEV = "cuda"
DTYPES = [torch.bfloat16, torch.float16, torch.float32]
DECODE_VARIANTS, PREFILL_VARIANTS = variants.DECODE, variants.PREFILL  # shipped and benchmark-only


def _attend(variant, q, case, cu=None, scale=None, out=None):
    """One call of a given kernel variant through the same host code as the public wrappers."""
    a = check_attention(q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens, cu, scale, out)
    return cuda_attention.paged_attention(
        a, q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens, cu, variant=variants.pipelines(variant)
    )


def _lengths(rng, bs, n, longest):
    special = [0, 1, bs, 2 * bs, 16, 17, 31, 33]
    return [rng.choice(special) if rng.random() < 0.4 else rng.randint(1, longest) for _ in range(n)]


@pytest.mark.parametrize("variant", DECODE_VARIANTS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("seed", range(8))
def test_gpu_decode_matches_reference(dtype, seed, variant):
    rng = random.Random(seed)
    bs, d = rng.choice([8, 16, 32]), rng.choice([64, 128, 256])
    hkv, group = rng.choice([1, 2, 4]), rng.choice([1, 2, 3, 4, 8])
    lens = _lengths(rng, bs, rng.choice([1, 3, 9, 40]), rng.choice([100, 700, 3000]))
    case = make_case(lens, num_kv_heads=hkv, block_size=bs, head_dim=d, dtype=dtype, device=DEV, seed=seed)
    q = (2 * torch.randn(len(lens), hkv * group, d, device=DEV)).to(dtype)
    out = poisoned(q.shape, dtype, DEV)
    scale = rng.choice([None, 0.05])
    _attend(variant, q, case, scale=scale, out=out)
    want = ref.paged_decode_reference(q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens, scale)
    assert_matches_reference(out, want, "cuda")


@pytest.mark.parametrize("variant", PREFILL_VARIANTS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("seed", range(6))
def test_gpu_prefill_matches_reference(dtype, seed, variant):
    rng = random.Random(50 + seed)
    bs, d = rng.choice([8, 16, 32]), rng.choice([64, 128, 256])
    hkv, group = rng.choice([1, 2]), rng.choice([1, 2, 4, 5, 8])
    lens, q_lens = [], []
    for _ in range(rng.randint(1, 6)):
        n = rng.choice([0, 1, bs, 77, rng.randint(1, 600)])
        lens.append(n)
        q_lens.append(rng.choice([0, min(n, 1), n, rng.randint(0, n)]))
    case = make_case(lens, num_kv_heads=hkv, block_size=bs, head_dim=d, dtype=dtype, device=DEV, seed=seed)
    cu = torch.tensor([0] + q_lens, dtype=torch.int32).cumsum(0, dtype=torch.int32).to(DEV)
    q = torch.randn(int(cu[-1]), hkv * group, d, device=DEV).to(dtype)
    out = poisoned(q.shape, dtype, DEV)
    _attend(variant, q, case, cu=cu, out=out)
    want = ref.paged_prefill_reference(q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens, cu)
    assert_matches_reference(out, want, "cuda")


def _serving_case(seed=0, num_layers=2):
    """A long prompt plus a chunk that extends a cached prefix (neither length a multiple of
    the block size), 8 KV heads, GQA group 4, head_dim 128, bf16."""
    lens, q_lens = [700, 650], [560, 90]
    case = make_case(lens, num_kv_heads=8, block_size=16, head_dim=128, dtype=torch.bfloat16, num_layers=num_layers,
                     device=DEV, seed=seed)  # fmt: skip
    cu = torch.tensor([0] + q_lens, dtype=torch.int32).cumsum(0, dtype=torch.int32).to(DEV)
    q = torch.randn(int(cu[-1]), 32, 128, device=DEV).to(torch.bfloat16)
    return case, cu, q


@pytest.mark.parametrize("variant", ["v7m1", "v7m2", "v7w8", "v8", "v8f", "v10", "v10f", None])
def test_gpu_prefill_at_serving_size(variant):
    """Prefill the size the planner sends to the dedicated kernel (None: its own pick),
    a long prompt plus a chunk that extends a cached prefix, GQA group 4."""
    case, cu, q = _serving_case(num_layers=1)
    out = poisoned(q.shape, q.dtype, DEV)
    a = check_attention(q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens, cu, None, out)
    plan = cuda_attention.plan_attention(
        a, prefill=True, max_blocks=case.block_tables.shape[1], max_seq_len=None,
        num_sms=torch.cuda.get_device_properties(0).multi_processor_count, variant=variants.pipelines(variant),
    )  # fmt: skip
    assert plan.pipe.dedicated
    if variant is None:
        paged_prefill_attention(q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens, cu, out=out)
    else:
        _attend(variant, q, case, cu=cu, out=out)
    want = ref.paged_prefill_reference(q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens, cu)
    assert_matches_reference(out, want, "cuda")


@pytest.mark.parametrize("variant", ["v8", "v8f", "v10f", "v7"])
def test_gpu_prefill_ignores_stale_pool_rows(variant):
    """Rows of a sequence's last block past its length, and every block it does not own,
    hold NaN (stale memory): the output must not see them (TMA loads whole blocks)."""
    case, cu, q = _serving_case()
    owned = torch.zeros(case.kv_cache.shape[0], dtype=torch.bool)
    for b, n in enumerate(case.seq_lens.tolist()):
        nb = -(-n // 16)
        ids = case.block_tables[b, :nb].long().cpu()
        owned[ids] = True
        case.kv_cache[int(ids[-1]), case.layer, :, :, n - 16 * (nb - 1) :] = float("nan")
    case.kv_cache[~owned.to(DEV)] = float("nan")
    out = poisoned(q.shape, q.dtype, DEV)
    _attend(variant, q, case, cu=cu, out=out)
    want = ref.paged_prefill_reference(q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens, cu)
    assert_matches_reference(out, want, "cuda")


@pytest.mark.parametrize("warm", [True, False])
def test_gpu_prefill_in_cuda_graph(warm):
    """The planner's prefill captured in a CUDA graph: with the pool's TMA maps made by a
    warm-up call (TMA in the graph), or first seen during capture (the mma.sync kernel)."""
    case, cu, q = _serving_case(seed=1)
    want = ref.paged_prefill_reference(q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens, cu)
    out = poisoned(q.shape, q.dtype, DEV)
    run = lambda: paged_prefill_attention(  # noqa: E731
        q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens, cu, out=out
    )
    if warm:
        run()
    else:  # compile both kernels outside capture, on another pool view, so only the maps are new
        other, _, _ = _serving_case(seed=2)
        paged_prefill_attention(q, other.k_cache, other.v_cache, other.block_tables, other.seq_lens, cu, out=out)
        _attend("v7", q, other, cu=cu, out=out)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    for _ in range(2):
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert_matches_reference(out, want, "cuda")


@pytest.mark.parametrize("dtype,head_dim,block_size", [(torch.bfloat16, 128, 16), (torch.float16, 64, 32)])
def test_gpu_persistent_prefill_runs_many_items_per_cta(dtype, head_dim, block_size):
    """The persistent warpgroup-MMA prefill (v10f) with far more query tiles than SMs, so that
    each CTA runs many items of mixed lengths (fresh prompts and chunks behind a cached
    prefix): right on every call, eager and replayed in a CUDA graph, with its item counter
    back at zero after each (the next launch starts from item 0)."""
    rng = random.Random(7)
    lens, q_lens = [], []
    for _ in range(12):
        q_len = rng.choice([1, 31, 33, 200, rng.randint(1, 1500)])
        lens.append(q_len + rng.choice([0, 0, 17, rng.randint(0, 3000)]))
        q_lens.append(q_len)
    case = make_case(lens, num_kv_heads=8, block_size=block_size, head_dim=head_dim, dtype=dtype, num_layers=1,
                     device=DEV)  # fmt: skip
    cu = torch.tensor([0] + q_lens, dtype=torch.int32).cumsum(0, dtype=torch.int32).to(DEV)
    q = torch.randn(int(cu[-1]), 32, head_dim, device=DEV).to(dtype)
    want = ref.paged_prefill_reference(q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens, cu)
    out = poisoned(q.shape, dtype, DEV)
    a = check_attention(q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens, cu, None, out)
    plan = cuda_attention.plan_attention(
        a, prefill=True, max_blocks=case.block_tables.shape[1], max_seq_len=None,
        num_sms=torch.cuda.get_device_properties(0).multi_processor_count, variant=variants.pipelines("v10f"),
        wgmma=True,
    )  # fmt: skip
    assert plan.pipe.persistent and plan.num_splits * 8 > 4 * plan.grid[0]  # several items per CTA
    _check_repeats_leave_counters_at_zero(lambda: _attend("v10f", q, case, cu=cu, out=out), out, want)


@pytest.mark.parametrize("seq_len", [32768, 131072])
def test_gpu_long_context_split_kv(seq_len):
    """One long sequence (128k tokens) next to short ones: many splits, one merge."""
    lens = [seq_len, 5, 1000]
    case = make_case(lens, num_kv_heads=1, block_size=16, head_dim=128, dtype=torch.bfloat16, num_layers=1, device=DEV)
    q = torch.randn(3, 4, 128, device=DEV).to(torch.bfloat16)
    out = poisoned(q.shape, q.dtype, DEV)
    paged_decode_attention(q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens, out=out)
    want = ref.paged_decode_reference(q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens)
    assert_matches_reference(out, want, "cuda")


@pytest.mark.parametrize("variant", [v for v in DECODE_VARIANTS if variants.pipelines(v).decode.fused])
def test_gpu_fused_merge_leaves_counters_at_zero(variant):
    """Split-KV with the merge fused: repeated calls (eager, then in a CUDA graph) stay
    right, which needs every arrival counter back at zero after each call."""
    lens = [9000, 1, 0, 4000]
    case = make_case(lens, num_kv_heads=2, block_size=16, head_dim=128, dtype=torch.bfloat16, device=DEV)
    q = torch.randn(4, 8, 128, device=DEV).to(torch.bfloat16)
    want = ref.paged_decode_reference(q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens)
    out = poisoned(q.shape, q.dtype, DEV)
    _check_repeats_leave_counters_at_zero(lambda: _attend(variant, q, case, out=out), out, want)


def _check_repeats_leave_counters_at_zero(call, out, want):
    """``call`` (which writes ``out``) three times eagerly, then captured in a CUDA graph and
    replayed three times: right every time, and every kept counter buffer at zero after."""
    for _ in range(3):
        out.fill_(float("nan"))
        call()
        assert_matches_reference(out, want, "cuda")
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    for _ in range(3):
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert_matches_reference(out, want, "cuda")
    assert all(int(c.abs().sum()) == 0 for c in cuda_attention._COUNTERS.values())


def test_gpu_decode_on_contiguous_caches_with_hint():
    case = make_case([300, 2, 0, 64], num_kv_heads=8, block_size=16, head_dim=128, dtype=torch.float16, device=DEV)
    k, v = case.k_cache.contiguous(), case.v_cache.contiguous()
    q = torch.randn(4, 32, 128, device=DEV).to(torch.float16)
    out = paged_decode_attention(q, k, v, case.block_tables, case.seq_lens, max_seq_len=300)
    want = ref.paged_decode_reference(q, k, v, case.block_tables, case.seq_lens)
    assert_matches_reference(out, want, "cuda")


def test_gpu_decode_cuda_graph_replay():
    """The decode step is capturable: no host sync, no allocation outside the graph pool."""
    lens = [700, 33, 1]
    case = make_case(lens, num_kv_heads=2, block_size=16, head_dim=128, dtype=torch.bfloat16, device=DEV, extra_cols=8)
    q = torch.randn(3, 8, 128, device=DEV).to(torch.bfloat16)
    out = torch.empty_like(q)
    args = (q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens)
    paged_decode_attention(*args, out=out)  # warm-up: compile and load outside capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        paged_decode_attention(*args, out=out)
    for step in range(3):
        q.copy_(torch.randn_like(q, dtype=torch.float32).to(q.dtype))
        case.seq_lens.copy_(torch.tensor([700 + step, 33, 1 + step], dtype=torch.int32))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        want = ref.paged_decode_reference(q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens)
        assert_matches_reference(out, want, "cuda")


@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_write_kv_then_prefill(dtype):
    bs, hkv, d = 16, 2, 128
    case = make_case([80, 40], num_kv_heads=hkv, block_size=bs, head_dim=d, dtype=dtype, device=DEV, spare_blocks=2)
    before = case.kv_cache.clone()
    pos = torch.arange(60, 80, device=DEV)
    slots = case.block_tables[0].long()[pos // bs] * bs + pos % bs
    slots = torch.cat([slots, torch.tensor([-1, -7], device=DEV)])  # padding
    key = torch.randn(22, hkv, d, device=DEV).to(dtype)
    value = torch.randn(22, hkv, d, device=DEV).to(dtype)
    want_k, want_v = ref.write_kv_reference(key, value, case.k_cache, case.v_cache, slots)
    write_kv(key, value, case.k_cache, case.v_cache, slots)
    assert torch.equal(case.k_cache.double().cpu(), torch.from_numpy(want_k))
    assert torch.equal(case.v_cache.double().cpu(), torch.from_numpy(want_v))
    assert torch.equal(case.kv_cache[:, 1 - case.layer], before[:, 1 - case.layer])
    q = torch.randn(20, hkv * 4, d, device=DEV).to(dtype)
    cu = torch.tensor([0, 20, 20], dtype=torch.int32, device=DEV)
    out = paged_prefill_attention(q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens, cu)
    want = ref.paged_prefill_reference(q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens, cu)
    assert_matches_reference(out, want, "cuda")
