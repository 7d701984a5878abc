"""The GPU kernels on real batches and the models people run, emulated on the CPU
(``tests/kernels/support/cuda_emulator.py``): page-aware decode over skewed and spread
length mixes and page-aware prefill (a chunk beside decodes), the work division's rule
(``cuda_attention.work_items``), head_dim 80/96/112/192, sliding windows, logit soft caps and
float8 caches, each against the float64 reference."""

import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from benchmarks import kernel_variants
from kvpool.kernels import cuda_attention
from kvpool.kernels._validate import check_attention
from tests.kernels.support import cuda_emulator
from tests.kernels.support import reference as ref
from tests.kernels.support import variants
from tests.kernels.support.testing import assert_matches_reference, make_case, poisoned

pytestmark = pytest.mark.skipif(not cuda_emulator.available(), reason="needs g++ for the CUDA emulator")

FP8 = torch.float8_e4m3fn


@pytest.fixture(scope="module")
def launcher():
    # 32 SMs: room for more CTAs than a test batch has sequences, so the page-aware division
    # splits the long ones (with 2, every batch here would be a multi-wave grid).
    return cuda_emulator.EmulatorLauncher(num_sms=32, cp_async="late")


def _attend(launcher, case, q, cu=None, *, variant=None, num_splits=None, tuning=cuda_attention.DEFAULT_TUNING,
            **options):  # fmt: skip
    out = poisoned(q.shape, q.dtype)
    a = check_attention(q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens, cu, None, out, **options)
    cuda_attention.paged_attention(
        a, q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens, cu,
        num_splits=num_splits, variant=variants.pipelines(variant), tuning=tuning, launcher=launcher,
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
    c, per_item, items = cuda_attention.work_items(lens, target=target, capacity=1 << 17)
    assert items[0] > 8 and items[1:] == [1] * 7 and sum(items) <= target + len(lens)
    assert per_item[0] * (items[0] - 1) < 100_000 <= per_item[0] * items[0]


def test_page_aware_division_of_a_uniform_batch_is_even():
    # 16 sequences of 4096 keys, 33 CTAs per head: two items of 2048 each, none a sliver.
    c, per_item, items = cuda_attention.work_items([4096] * 16, target=33, capacity=4096)
    assert items == [2] * 16 and per_item == [2048] * 16


@settings(max_examples=60, deadline=None)
@given(
    lens=st.lists(st.integers(0, 200_000), min_size=1, max_size=300),
    target=st.integers(1, 300),
    window=st.sampled_from([0, 1, 7, 100, 4096]),
    overhead=st.sampled_from([0, 64, 256, 1024]),
)
def test_work_division_items_are_nonempty_bounded_and_fit_the_grid(lens, target, window, overhead):
    cap = 1 << 20
    c, per_item, items = cuda_attention.work_items(lens, target=target, capacity=cap, window=window,
                                                     overhead=overhead)  # fmt: skip
    assert sum(items) <= target + len(lens)  # always within the planner's grid
    assert c % 64 == 0 and c >= cuda_attention.DECODE_ITEM_KEYS
    units = []
    for n, k, keys in zip(lens, items, per_item):
        start = max(0, n - window) & ~7 if window else 0
        visible = n - start
        units.append((visible + 63) // 64)
        assert keys % 64 == 0 and keys <= c
        assert k == 1 or (k - 1) * keys < visible <= k * keys  # no empty item, none past the end
    # Uncapped (no max_chunk): with fewer sequences than the target (one wave) the long
    # sequences' items fit the wave and all the work fits its slots, and one unit less per item
    # would not; with more, c is all the keys over the target. The cap only lowers c where the
    # grid holds the items.
    c_free, _, free = cuda_attention.work_items(lens, target=target, capacity=cap, window=window,
                                                overhead=overhead, max_chunk=1 << 30)  # fmt: skip
    assert c == c_free or (len(lens) >= target and c == cuda_attention.DECODE_MAX_CTA_KEYS < c_free)
    u, a = c_free // 64, overhead // 64
    assert free == [max(1, -(-w // u)) for w in units]
    if len(lens) >= target:
        assert u == max(1, -(-sum(units) // target))
        return

    def fits(u):
        n = [max(1, -(-w // u)) for w in units]
        return sum(k for k, w in zip(n, units) if 2 * w > u) <= target and sum(units) + a * sum(n) <= target * (u + a)

    assert fits(u) and (u == 1 or not fits(u - 1))


def test_page_aware_items_run_long_sequences_first():
    lens = [300, 20_000, 5, 9_000, 0, 40]
    c, _, items = cuda_attention.work_items(lens, target=16, capacity=1 << 17)
    keys = cuda_attention.tile_keys(lens, capacity=1 << 17)
    order = cuda_attention.work_order(keys, c, items, target=16, classes=2)
    assert len(order) == sum(items) and sorted(set(order)) == sorted(order)
    long_ones = [j for j, _ in order[: items[1] + items[3]]]
    assert set(long_ones) == {1, 3} and items[1] > items[3] > 1
    assert order[items[1] + items[3] :] == [(0, 0), (2, 0), (4, 0), (5, 0)]
    # With more size classes, the 40-key sequence (one unit) runs after the 300-key one (five).
    lens[0], lens[5] = lens[5], lens[0]
    keys = cuda_attention.tile_keys(lens, capacity=1 << 17)
    assert cuda_attention.work_order(keys, c, items, target=16, classes=2)[-4:] == [(0, 0), (2, 0), (4, 0), (5, 0)]
    assert cuda_attention.work_order(keys, c, items, target=16, classes=8)[-4:] == [(5, 0), (0, 0), (2, 0), (4, 0)]


def test_a_multi_wave_batch_keeps_batch_order_or_runs_long_sequences_first_by_classes():
    # 40 sequences against a wave of 16: the two long ones sit at the end of the batch.
    lens = [700 + 13 * i for i in range(38)] + [30_000, 12_000]
    c, _, items = cuda_attention.work_items(lens, target=16, capacity=1 << 17)
    assert items[:38] == [1] * 38 and items[38] > items[39] > 1
    keys = cuda_attention.tile_keys(lens, capacity=1 << 17)
    assert cuda_attention.work_order(keys, c, items, target=16, classes=1) == [
        (j, s) for j, n in enumerate(items) for s in range(n)
    ]
    order = cuda_attention.work_order(keys, c, items, target=16, classes=2)
    n_long = items[38] + items[39]
    assert n_long <= 16 and {j for j, _ in order[:n_long]} == {38, 39}  # they start in the first wave
    assert order[n_long:] == [(j, 0) for j in range(38)]


@settings(max_examples=80, deadline=None)
@given(
    lens=st.lists(st.integers(0, 100_000), min_size=1, max_size=300),
    target=st.integers(1, 300),
    classes=st.integers(1, cuda_attention.ORDER_CLASSES),
)
def test_work_order_runs_every_item_once_largest_class_first(lens, target, classes):
    keys = cuda_attention.tile_keys(lens, capacity=1 << 17)
    c, per_item, items = cuda_attention.work_items(lens, target=target, capacity=1 << 17)
    order = cuda_attention.work_order(keys, c, items, target=target, classes=classes)
    assert sorted(order) == [(i, s) for i, n in enumerate(items) for s in range(n)]
    u = c // 64
    size = [-(-((k + 63) // 64) // n) for k, n in zip(keys, items)]  # units per item of each sequence
    last = max(classes, 2 if len(lens) < target else 1) - 1
    # Each item's class holds its size, (u / 2^(k+1), u / 2^k], the last class everything below;
    # an empty sequence's item goes with the smallest (no earlier than a one-unit item's).
    of = [0 if 2 * size[i] > u else min(last, max(1, (u // max(1, size[i])).bit_length() - 1)) for i, _ in order]
    one_unit = 0 if 2 > u else min(last, max(1, u.bit_length() - 1))
    for (i, _), k in zip(order, of):
        if size[i]:
            assert size[i] <= u >> k and (k == last or 2 * size[i] > u >> k)
        else:
            assert k >= one_unit
    assert of == sorted(of)  # largest first
    for k in set(of):  # each class in batch order, a sequence's items together
        seqs = [i for (i, _), kk in zip(order, of) if kk == k]
        assert seqs == sorted(seqs)


@pytest.mark.parametrize("classes", [1, 2, 4, 8])
def test_page_aware_decode_with_each_item_order_matches_the_reference(launcher, classes):
    # 40 sequences on the emulator's wave of 32 per head (several waves), lengths over
    # three size classes and the long one last: every order covers every item once.
    lens = [3, 70, 200, 130, 9, 0, 260] * 5 + [40, 33, 150, 64, 2500]
    case, q = _decode_case(lens, seed=classes)
    out, want = _attend(launcher, case, q, tuning=kernel_variants.tuning(classes=classes))
    assert_matches_reference(out, want, "cuda")


def test_an_item_overhead_gives_short_sequences_room_beside_the_long_ones():
    # One 32k sequence among 7 short ones, 33 CTAs per head: without an overhead the long one
    # takes as many items as the wave has slots left after the short ones' keys; weighing each
    # item's fixed cost gives it fewer, longer items.
    lens = [32768] + [500] * 7
    _, _, free = cuda_attention.work_items(lens, target=33, capacity=1 << 17, overhead=0)
    _, _, weighed = cuda_attention.work_items(lens, target=33, capacity=1 << 17, overhead=1024)
    assert free[1:] == weighed[1:] == [1] * 7
    assert 1 < weighed[0] < free[0] <= 33


def _decode_plan(lens, **bounds):
    case, q = _decode_case(lens)
    a = check_attention(q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens, None, None, q)
    return cuda_attention.plan_attention(a, prefill=False, max_blocks=case.block_tables.shape[1], num_sms=132,
                                         **bounds)  # fmt: skip


def test_a_batch_bounded_as_even_runs_the_fixed_grid_and_an_uneven_one_the_division():
    lens = [4000, 3600, 4096]
    assert _decode_plan(lens, max_seq_len=4096, min_seq_len=3600).work_target == 0  # within 1/8: fixed grid
    assert _decode_plan(lens, max_seq_len=4096, min_seq_len=3500).work_target > 0
    assert _decode_plan(lens, max_seq_len=4096).work_target > 0  # no lower bound: page-aware
    # A window of 512 keys makes both ends see 512: even whatever the lengths.
    case, q = _decode_case(lens)
    a = check_attention(q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens, None, None, q,
                        sliding_window=512)  # fmt: skip
    plan = cuda_attention.plan_attention(a, prefill=False, max_blocks=case.block_tables.shape[1], num_sms=132,
                                         max_seq_len=4096, min_seq_len=600)  # fmt: skip
    assert plan.work_target == 0
    assert cuda_attention.even_batch(600, 4096, 512) and not cuda_attention.even_batch(400, 4096, 512)


@pytest.mark.parametrize(
    "lens, bounds",
    [([700, 650, 640, 700], (700, 640)), ([700, 650, 3, 700], (700, 640)), ([700, 650, 640, 700], (300, 280))],
    ids=["even", "one-below-the-bounds", "all-above-the-bounds"],
)
def test_decode_with_even_bounds_matches_the_reference(launcher, lens, bounds):
    # The bounds pick the grid only: lengths outside them still attend correctly.
    case, q = _decode_case(lens, seed=9)
    out = poisoned(q.shape, q.dtype)
    a = check_attention(q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens, None, None, out)
    max_len, min_len = bounds
    plan = cuda_attention.plan_attention(a, prefill=False, max_blocks=case.block_tables.shape[1],
                                         max_seq_len=max_len, min_seq_len=min_len, num_sms=32)  # fmt: skip
    assert plan.work_target == 0 and plan.num_splits > 1  # the fixed grid, split
    cuda_attention.paged_attention(a, q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens, None,
                                   max_seq_len=max_len, min_seq_len=min_len, launcher=launcher)  # fmt: skip
    want = ref.paged_attention_reference(q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens,
                                         torch.arange(len(lens) + 1), None)  # fmt: skip
    assert_matches_reference(out, want, "cuda")


@settings(max_examples=5, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_page_aware_decode_on_random_mixes(launcher, data):
    long_len = data.draw(st.integers(1, 1500))
    short = data.draw(st.lists(st.integers(0, 40), min_size=0, max_size=12))
    lens = data.draw(st.permutations([long_len, *short]))
    window = data.draw(st.sampled_from([None, 1, 24, 300]))
    overhead = data.draw(st.sampled_from([0, 256, 4096]))
    case, q = _decode_case(lens, seed=long_len)
    out, want = _attend(launcher, case, q, sliding_window=window, tuning=kernel_variants.tuning(overhead=overhead))
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


def _chunk_beside_decodes(seed, window=None, cap=None, chunk=(150, 1300), decodes=(5, 40, 900, 0, 260, 17)):
    """One chunk of a long prompt (q_len, position) among decodes of one token each."""
    q_len, pos = chunk
    lens = [pos + q_len, *[n + 1 for n in decodes]]
    q_lens = [q_len, *[1] * len(decodes)]
    case = make_case(lens, num_kv_heads=2, block_size=16, head_dim=64, dtype=torch.bfloat16, seed=seed)
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    q = (2 * torch.randn(int(cu[-1]), 8, 64, generator=torch.Generator().manual_seed(seed))).to(torch.bfloat16)
    return case, q, cu, lens, q_lens


@pytest.mark.parametrize("window, cap", [(None, 30.0), (200, None)])  # neither is plain: the split-KV kernel
def test_page_aware_prefill_splits_the_chunks_tiles_by_their_keys(launcher, window, cap):
    case, q, cu, lens, q_lens = _chunk_beside_decodes(7, window, cap)
    # The emulator's 32 SMs, 2 KV heads: the planner's target, and what the kernel divides alike.
    target = 32 * cuda_attention.ctas_per_sm(cuda_attention.smem_bytes(2, 64, 1)) // 2
    tq = 64 // 4
    keys = cuda_attention.tile_keys(lens, q_lens, tokens_per_tile=tq, capacity=1 << 20, window=window or 0)
    c, per_item, items = cuda_attention.work_items(lens, q_lens, target=target, capacity=1 << 20,
                                                   tokens_per_tile=tq, window=window or 0)  # fmt: skip
    chunk_tiles = -(-q_lens[0] // tq)
    assert len(keys) < target and sum(items) <= 2 * target
    assert all(n == 1 for k, n in zip(keys, items) if 2 * -(-k // 64) <= c // 64)  # short tiles: one item
    if window is None:  # the chunk's tiles see 1300+ keys, most decodes few: the chunk's are split
        assert all(n > 1 for n in items[:chunk_tiles]) and items[chunk_tiles:].count(1) >= 4
    out, want = _attend(launcher, case, q, cu, sliding_window=window, logits_soft_cap=cap)
    assert_matches_reference(out, want, "cuda")


def test_page_aware_prefill_of_many_tiles_splits_none():
    lens, q_lens = [900, 700, 64], [900, 700, 64]
    keys = cuda_attention.tile_keys(lens, q_lens, tokens_per_tile=16, capacity=1 << 20)
    c, per_item, items = cuda_attention.work_items(lens, q_lens, target=48, capacity=1 << 20, tokens_per_tile=16)
    assert len(keys) == 57 + 44 + 4 and items == [1] * len(keys)
    assert keys[0] == 900 and keys[56] == 16 and keys[57] == 700  # each sequence's last tile first


def test_page_aware_prefill_of_many_tiles_matches_the_reference(launcher):
    # 105 tiles of 16 tokens against the emulator's target of 48: one item per tile.
    lens = q_lens = [900, 700, 64]
    case = make_case(lens, num_kv_heads=2, block_size=16, head_dim=64, dtype=torch.bfloat16, seed=9)
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    q = torch.randn(int(cu[-1]), 8, 64, generator=torch.Generator().manual_seed(9)).to(torch.bfloat16)
    out, want = _attend(launcher, case, q, cu, logits_soft_cap=50.0)
    assert_matches_reference(out, want, "cuda")


def test_page_aware_prefill_of_many_sequences_per_lane_matches_the_reference(launcher):
    # 70 sequences (a warp's lanes hold three each), chunks of 0 to 40 new tokens behind
    # prefixes: more tiles than the wave, one item per tile, found with no key counts. A soft
    # cap keeps the call on the split-KV kernel (plain 16-bit prefill has dedicated kernels).
    rng = random.Random(4)
    q_lens = [rng.choice([0, 1, 5, 17, 40]) for _ in range(70)]
    lens = [q + rng.randint(0, 90) for q in q_lens]
    case = make_case(lens, num_kv_heads=2, block_size=16, head_dim=64, dtype=torch.bfloat16, seed=4)
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    q = torch.randn(int(cu[-1]), 8, 64, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    a = check_attention(q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens, cu, None, q,
                        logits_soft_cap=30.0)  # fmt: skip
    plan = cuda_attention.plan_attention(a, prefill=True, max_blocks=case.block_tables.shape[1], max_seq_len=None,
                                         num_sms=launcher.num_sms(q.device))  # fmt: skip
    assert sum(-(-n // plan.tokens_per_cta) for n in q_lens) >= plan.work_target > 0
    out, want = _attend(launcher, case, q, cu, logits_soft_cap=30.0)
    assert_matches_reference(out, want, "cuda")


@settings(max_examples=5, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_page_aware_prefill_on_random_mixes(launcher, data):
    q_len = data.draw(st.integers(1, 120))
    pos = data.draw(st.integers(0, 1200))
    decodes = data.draw(st.lists(st.integers(0, 300), min_size=0, max_size=10))
    window = data.draw(st.sampled_from([None, 1, 40, 500]))
    case, q, cu, _, _ = _chunk_beside_decodes(q_len + pos, window, 20.0, (q_len, pos), decodes)
    out, want = _attend(launcher, case, q, cu, sliding_window=window, logits_soft_cap=20.0)
    assert_matches_reference(out, want, "cuda")


@settings(max_examples=60, deadline=None)
@given(
    tiles=st.lists(st.tuples(st.integers(1, 3000), st.integers(0, 40_000)), min_size=1, max_size=40),
    target=st.integers(1, 120),
    window=st.sampled_from([0, 1, 100, 4096]),
)
def test_prefill_work_division_is_nonempty_and_fits_the_grid(tiles, target, window):
    q_lens = [q for q, _ in tiles]
    lens = [q + c for q, c in tiles]
    keys = cuda_attention.tile_keys(lens, q_lens, tokens_per_tile=16, capacity=1 << 20, window=window)
    c, per_item, items = cuda_attention.work_items(lens, q_lens, target=target, capacity=1 << 20,
                                                   tokens_per_tile=16, window=window)  # fmt: skip
    assert len(keys) == sum(-(-q // 16) for q in q_lens) == len(items)
    grid = max(sum(q_lens) // 16 + len(lens), 2 * target)  # the planner's items per KV head
    assert sum(items) <= grid and (len(keys) >= target or sum(items) <= 2 * target)
    for k, n, per in zip(keys, items, per_item):
        assert n == 1 or ((n - 1) * per < k <= n * per and per % 64 == 0)
