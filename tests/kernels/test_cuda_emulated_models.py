"""The GPU kernels on real batches and the models people run, emulated on the CPU
(``tests/kernels/support/cuda_emulator.py``): page-aware decode over skewed and spread
length mixes, head_dim 80/96/112/192, sliding windows, logit soft caps and float8 caches,
each against the float64 reference."""

import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvpool.kernels import cuda_attention
from kvpool.kernels._validate import check_attention
from tests.kernels.support import cuda_emulator
from tests.kernels.support import reference as ref
from tests.kernels.support import variants  # noqa: F401 - registers v7, the fixed-grid decode
from tests.kernels.support.testing import assert_matches_reference, make_case, poisoned

pytestmark = pytest.mark.skipif(not cuda_emulator.available(), reason="needs g++ for the CUDA emulator")

FP8 = torch.float8_e4m3fn


@pytest.fixture(scope="module")
def launcher():
    # 32 SMs: room for more CTAs than a test batch has sequences, so the page-aware division
    # splits the long ones (with 2, every batch here would be a multi-wave grid).
    return cuda_emulator.EmulatorLauncher(num_sms=32, cp_async="late")


def _attend(launcher, case, q, cu=None, *, variant=None, num_splits=None, **options):
    out = poisoned(q.shape, q.dtype)
    a = check_attention(q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens, cu, None, out, **options)
    cuda_attention.paged_attention(
        a, q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens, cu,
        num_splits=num_splits, variant=variant, launcher=launcher,
    )  # fmt: skip
    b = case.seq_lens.shape[0]
    cu_ref = torch.arange(b + 1) if cu is None else cu
    want = ref.paged_attention_reference(
        q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens, cu_ref, None, **options
    )
    return out, want


def _decode_case(lens, *, d=64, dtype=torch.bfloat16, group=4, bs=16, seed=0):
    case = make_case(lens, num_kv_heads=2, block_size=bs, head_dim=d, dtype=dtype, seed=seed)
    qdtype = torch.bfloat16 if dtype == FP8 else dtype
    q = torch.randn(len(lens), 2 * group, d, generator=torch.Generator().manual_seed(seed)).to(qdtype)
    return case, q


@pytest.mark.parametrize(
    "lens",
    [
        [900, 1, 2, 5, 17, 3, 0, 8],  # one long among many short (and an empty one)
        [3, 9, 40, 130, 260, 520, 1040],  # spread over two orders of magnitude
        [1200],  # one long sequence alone
        [600] + [1 + (37 * i) % 90 for i in range(70)],  # more sequences than a warp has lanes
    ],
    ids=["skewed", "spread", "single", "many"],
)
def test_page_aware_decode_matches_the_reference_on_mixed_lengths(launcher, lens):
    case, q = _decode_case(lens)
    out, want = _attend(launcher, case, q)
    assert_matches_reference(out, want, "cuda")


def test_page_aware_division_gives_the_long_sequence_many_items_and_short_ones_one():
    # An H200 (132 SMs), 8 KV heads: the planner's target items per head; the kernel divides alike.
    lens = [100_000, 1, 2, 5, 17, 3, 0, 8]
    target = cuda_attention.decode_work(len(lens), 8, 100_000 // 16 + 1, 132)
    c, per_item, items = cuda_attention.decode_items(lens, target=target, capacity=1 << 17)
    assert items[0] > 8 and items[1:] == [1] * 7 and sum(items) <= target + len(lens)
    assert per_item[0] * (items[0] - 1) < 100_000 <= per_item[0] * items[0]


def test_page_aware_division_of_a_uniform_batch_is_even():
    # 16 sequences of 4096 keys, 33 CTAs per head: two items of 2048 each, none a sliver.
    c, per_item, items = cuda_attention.decode_items([4096] * 16, target=33, capacity=4096)
    assert items == [2] * 16 and per_item == [2048] * 16


@settings(max_examples=60, deadline=None)
@given(
    lens=st.lists(st.integers(0, 200_000), min_size=1, max_size=300),
    target=st.integers(1, 300),
    window=st.sampled_from([0, 1, 7, 100, 4096]),
)
def test_work_division_items_are_nonempty_bounded_and_fit_the_grid(lens, target, window):
    c, per_item, items = cuda_attention.decode_items(lens, target=target, capacity=1 << 20, window=window)
    assert sum(items) <= target + len(lens)  # always within the planner's grid
    assert c % 64 == 0 and c >= cuda_attention.DECODE_ITEM_KEYS
    for n, k, keys in zip(lens, items, per_item):
        start = max(0, n - window) & ~7 if window else 0
        visible = n - start
        assert keys % 64 == 0 and keys <= c
        assert k == 1 or (k - 1) * keys < visible <= k * keys  # no empty item, none past the end


@settings(max_examples=5, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_page_aware_decode_on_random_mixes(launcher, data):
    long_len = data.draw(st.integers(1, 1500))
    short = data.draw(st.lists(st.integers(0, 40), min_size=0, max_size=12))
    lens = data.draw(st.permutations([long_len, *short]))
    window = data.draw(st.sampled_from([None, 1, 24, 300]))
    case, q = _decode_case(lens, seed=long_len)
    out, want = _attend(launcher, case, q, sliding_window=window)
    assert_matches_reference(out, want, "cuda")


# Each (head_dim, dtype) compiles kernels of its own: every new head_dim once, each dtype once.
@pytest.mark.parametrize(
    "d, dtype", [(80, torch.bfloat16), (96, torch.float16), (112, torch.float32), (192, torch.bfloat16)]
)
def test_head_dims_decode_and_prefill(launcher, d, dtype):
    lens = [0, 1, 33, 150]
    case, q = _decode_case(lens, d=d, dtype=dtype, group=2, seed=d)
    out, want = _attend(launcher, case, q)
    assert_matches_reference(out, want, "cuda")
    q_lens = [0, 1, 20, 40]  # chunked prefill: the last q_len positions of each sequence
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    qp = torch.randn(int(cu[-1]), 4, d, generator=torch.Generator().manual_seed(1)).to(dtype)
    out, want = _attend(launcher, case, qp, cu)
    assert_matches_reference(out, want, "cuda")


@pytest.mark.parametrize(
    "variant, window, cap",
    [("v9", 1, None), ("v9", 20, None), ("v9", 64, 30.0), ("v9", None, 5.0), ("v9", 10_000, 50.0),
     ("v7", 20, None), ("v7", 64, 30.0)],  # v7: the fixed grid, which batches of one sequence run
)  # fmt: skip
def test_window_and_soft_cap_decode(launcher, variant, window, cap):
    case, q = _decode_case([0, 1, 7, 19, 64, 250, 700], seed=3)
    q = q * 4  # large scores: the soft cap bites
    out, want = _attend(launcher, case, q, variant=variant, sliding_window=window, logits_soft_cap=cap)
    assert_matches_reference(out, want, "cuda")


@pytest.mark.parametrize("splits", [None, 3])
@pytest.mark.parametrize("window, cap", [(1, None), (24, 20.0), (100, None)])
def test_window_and_soft_cap_prefill(launcher, splits, window, cap):
    lens, q_lens = [5, 60, 300], [5, 33, 70]
    case = make_case(lens, num_kv_heads=2, block_size=16, head_dim=64, dtype=torch.bfloat16, seed=5)
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    q = (3 * torch.randn(int(cu[-1]), 8, 64, generator=torch.Generator().manual_seed(2))).to(torch.bfloat16)
    out, want = _attend(launcher, case, q, cu, num_splits=splits, sliding_window=window, logits_soft_cap=cap)
    assert_matches_reference(out, want, "cuda")


@pytest.mark.parametrize("d, qdtype", [(64, torch.bfloat16), (128, torch.float16), (192, torch.bfloat16)])
def test_float8_cache_decode_and_prefill(launcher, d, qdtype):
    lens = [1, 17, 200, 9]
    case = make_case(lens, num_kv_heads=2, block_size=16, head_dim=d, dtype=FP8, seed=d)
    q = torch.randn(len(lens), 4, d, generator=torch.Generator().manual_seed(4)).to(qdtype)
    scales = {"k_scale": 0.5, "v_scale": 3.0}
    out, want = _attend(launcher, case, q, **scales)
    assert_matches_reference(out, want, "cuda")
    cu = torch.tensor([0, 1, 9, 30, 39], dtype=torch.int32)
    qp = torch.randn(39, 4, d, generator=torch.Generator().manual_seed(5)).to(qdtype)
    out, want = _attend(launcher, case, qp, cu, sliding_window=50, **scales)
    assert_matches_reference(out, want, "cuda")


def test_float8_conversion_is_exact_for_every_code(launcher):
    # Every finite e4m3 code once as a value dim: a sequence of one key gives its value row
    # back exactly (the key's softmax weight is 1, and every e4m3 value is a float16).
    codes = torch.arange(256, dtype=torch.uint8)
    codes = codes[(codes & 0x7F) != 0x7F]  # NaN codes: never written by write_kv
    d = 128
    case = make_case([1], num_kv_heads=1, block_size=16, head_dim=d, dtype=FP8, seed=0)
    for half in (codes[: len(codes) // 2], codes[len(codes) // 2 :]):
        v = torch.zeros(d, dtype=torch.uint8)
        v[: len(half)] = half
        block = int(case.block_tables[0, 0])
        case.v_cache.view(torch.uint8)[block, 0, 0] = v
        q = torch.ones(1, 1, d, dtype=torch.float16)
        out, want = _attend(launcher, case, q)
        assert torch.equal(out[0, 0, : len(half)].double(), torch.as_tensor(want[0, 0, : len(half)]))


@pytest.mark.parametrize("splits", [None, 2])  # 2 with v7: a cluster pair on 32-key float8 stages
def test_float8_single_sequence_runs_the_fixed_grid(launcher, splits):
    case = make_case([700], num_kv_heads=2, block_size=16, head_dim=128, dtype=FP8, seed=11)
    q = torch.randn(1, 8, 128, generator=torch.Generator().manual_seed(6)).to(torch.bfloat16)
    variant = None if splits is None else "v7"
    out, want = _attend(launcher, case, q, variant=variant, num_splits=splits, k_scale=2.0, v_scale=0.5)
    assert_matches_reference(out, want, "cuda")
