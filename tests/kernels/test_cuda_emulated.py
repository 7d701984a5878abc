"""The CUDA kernels' source, run lane by lane on the CPU (``tests/kernels/support/cuda_emulator.py``).

This checks the GPU kernels' logic in CI, where there is no GPU: MMA
fragment layouts, the V operand's dim permutation, causal masks, split-KV
and its merge, the prefill tile mapping, through the same host launch code
as on the GPU. Small shapes: every lane is a fiber.
"""

import random
from dataclasses import replace

import pytest
import torch

from kvpool.kernels import cuda_attention, cuda_write_kv
from kvpool.kernels._validate import check_attention, check_write_kv
from tests.kernels.support import reference as ref
from tests.kernels.support import cuda_emulator, variants
from tests.kernels.support.testing import assert_matches_reference, make_case, poisoned

pytestmark = pytest.mark.skipif(not cuda_emulator.available(), reason="needs g++ for the CUDA emulator")


@pytest.fixture(scope="module", params=["late", "early"])
def launcher(request):
    """cp.async copies landing as late as allowed (at the wait) or as early (at issue):
    the first catches a read before its wait/barrier, the second an overwrite of a
    stage that another warp may still be reading."""
    return cuda_emulator.EmulatorLauncher(num_sms=2, cp_async=request.param)


CONFIGS = [
    # dtype, head_dim, block_size, group, num_splits (None: the planner's choice)
    (torch.bfloat16, 64, 16, 4, None),
    (torch.bfloat16, 64, 8, 8, 3),
    (torch.float16, 64, 32, 1, 1),
    (torch.float16, 64, 16, 3, None),
    (torch.float32, 64, 8, 2, 2),
    (torch.bfloat16, 128, 16, 8, None),
    (torch.float16, 256, 32, 2, 2),
]


DECODE_VARIANTS, PREFILL_VARIANTS = variants.EMULATED_DECODE, variants.EMULATED_PREFILL


def _early_only_for_shipped(launcher, variant, shipped):
    """The benchmark-only variants share the shipped kernels' ring code, which the late order
    checks for each of them; the early order (a stage overwritten too soon) runs on the
    pipelines the defaults run."""
    if launcher.cp_async == "early" and variant not in shipped:
        pytest.skip(f"{variant} is benchmark-only: checked with cp.async landing late")


def _run(launcher, case, q, cu, num_splits, max_seq_len=None, variant=None):
    out = poisoned(q.shape, q.dtype)
    a = check_attention(q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens, cu, None, out)
    cuda_attention.paged_attention(
        a, q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens, cu,
        max_seq_len=max_seq_len, num_splits=num_splits, variant=variants.pipelines(variant), launcher=launcher,
    )  # fmt: skip
    return out


@pytest.mark.parametrize("variant", DECODE_VARIANTS)
@pytest.mark.parametrize("dtype, d, bs, group, splits", CONFIGS)
def test_emulated_decode(launcher, dtype, d, bs, group, splits, variant):
    _early_only_for_shipped(launcher, variant, variants.SHIPPED_DECODE)
    rng = random.Random(d + bs + group)
    lens = [0, 1, bs, 2 * bs + 1, rng.randint(1, 70), 300]  # 300: many pipelined tiles per warp
    case = make_case(lens, num_kv_heads=2, block_size=bs, head_dim=d, dtype=dtype, seed=group)
    q = (2 * torch.randn(len(lens), 2 * group, d)).to(dtype)
    out = _run(launcher, case, q, None, splits, variant=variant)
    want = ref.paged_decode_reference(q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens)
    assert_matches_reference(out, want, "cuda")


@pytest.mark.parametrize("variant", PREFILL_VARIANTS)
@pytest.mark.parametrize("dtype, d, bs, group, splits", CONFIGS)
def test_emulated_prefill(launcher, dtype, d, bs, group, splits, variant):
    _early_only_for_shipped(launcher, variant, variants.SHIPPED_PREFILL)
    # full (150: several 64-key stages, the causal diagonal inside one), empty, chunked, decode-like
    lens, q_lens = [150, 0, 2 * bs, 5], [150, 0, 3, 1]
    case = make_case(lens, num_kv_heads=2, block_size=bs, head_dim=d, dtype=dtype, seed=7)
    cu = torch.tensor([0] + q_lens, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    q = torch.randn(int(cu[-1]), 2 * group, d).to(dtype)
    out = _run(launcher, case, q, cu, splits, variant=variant)
    want = ref.paged_prefill_reference(q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens, cu)
    assert_matches_reference(out, want, "cuda")


@pytest.mark.parametrize("variant", ["v7m1", "v7m2", "v7w8"])
def test_emulated_prefill_many_sequences(launcher, variant):
    """More sequences than a warp has lanes: the dedicated kernel's in-kernel scan of
    cu_seqlens walks them 32 at a time (empty ones, chunks and full prompts mixed)."""
    rng = random.Random(3)
    lens = [rng.choice([0, 1, 9, 40, 70]) for _ in range(70)]
    q_lens = [rng.choice([0, n, min(n, 3)]) for n in lens]
    case = make_case(lens, num_kv_heads=1, block_size=8, head_dim=64, dtype=torch.bfloat16, seed=5)
    cu = torch.tensor([0] + q_lens, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    q = torch.randn(int(cu[-1]), 2, 64).to(torch.bfloat16)
    out = _run(launcher, case, q, cu, None, variant=variant)
    want = ref.paged_prefill_reference(q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens, cu)
    assert_matches_reference(out, want, "cuda")


def test_emulated_merge_of_many_splits(launcher):
    """63 splits of one row (of 64): the merge's first 16 partials (loaded before the max is known),
    then a batch of 32 and a partial batch; rows with fewer splits and an empty row beside it."""
    case = make_case([1000, 3, 0, 200], num_kv_heads=2, block_size=16, head_dim=64, dtype=torch.bfloat16, seed=11)
    q = (2 * torch.randn(4, 4, 64)).to(torch.bfloat16)
    plan = cuda_attention.plan_attention(
        check_attention(q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens, None, None, q),
        prefill=False, max_blocks=case.block_tables.shape[1], max_seq_len=None, num_sms=2, num_splits=64,
    )  # fmt: skip
    assert plan.num_splits == 64
    out = _run(launcher, case, q, None, 64)
    want = ref.paged_decode_reference(q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens)
    assert_matches_reference(out, want, "cuda")


def test_emulated_split_plan_with_small_max_seq_len_hint(launcher):
    """A too-small ``max_seq_len`` hint costs speed, never correctness: the last split takes the rest."""
    case = make_case([90, 3], num_kv_heads=1, block_size=16, head_dim=64, dtype=torch.bfloat16)
    q = torch.randn(2, 4, 64).to(torch.bfloat16)
    out = _run(launcher, case, q, None, None, max_seq_len=32)
    want = ref.paged_decode_reference(q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens)
    assert_matches_reference(out, want, "cuda")


def test_emulated_write_kv(launcher):
    case = make_case([30], num_kv_heads=2, block_size=8, head_dim=64, dtype=torch.bfloat16, spare_blocks=2)
    key = torch.randn(5, 2, 64).to(torch.bfloat16)
    value = torch.randn(5, 2, 64).to(torch.bfloat16)
    n_slots = case.kv_cache.shape[0] * 8
    slots = torch.tensor([3, -1, n_slots - 1, n_slots + 5, 17])  # padding and out-of-range skipped
    want_k, want_v = ref.write_kv_reference(key[[0, 2, 4]], value[[0, 2, 4]], case.k_cache, case.v_cache, slots[[0, 2, 4]])
    geo = check_write_kv(key, value, case.k_cache, case.v_cache, slots)
    cuda_write_kv.write_kv(geo, key, value, case.k_cache, case.v_cache, slots, launcher=launcher)
    assert torch.equal(case.k_cache.double(), torch.from_numpy(want_k))
    assert torch.equal(case.v_cache.double(), torch.from_numpy(want_v))


def _plan(num_tokens, num_seqs, *, dtype=torch.bfloat16, d=128, prefill=True, ctx=4096, splits=None, variant="v7",
          wgmma=False, scale=1.0, clusters=False, tuning=cuda_attention.DEFAULT_TUNING):  # fmt: skip
    from kvpool.kernels._validate import AttentionArgs, CacheGeometry

    geo = CacheGeometry(1, 8, 16, d, 0, 0, dtype, torch.device("cpu"))
    a = AttentionArgs(geo, num_seqs, num_tokens, 32, 4, scale, None)
    return cuda_attention.plan_attention(
        a, prefill=prefill, max_blocks=ctx // 16, max_seq_len=ctx, num_sms=132, num_splits=splits,
        variant=variants.pipelines(variant), wgmma=wgmma, clusters=clusters, tuning=tuning,
    )  # fmt: skip


def test_warpgroup_prefill_launch_matches_its_launch_bounds():
    """The host launches the warpgroup-MMA prefill with the threads its source was compiled
    for: the consumer warpgroups plus the producer warpgroup (setmaxnreg needs whole
    warpgroups). Fewer threads would leave a consumer warpgroup or the producer out."""
    from kvpool.kernels import cuda_runtime, cuda_source

    assert "__launch_bounds__(128 * (WG_GROUPS + 1), 1) prefill_wg_kernel" in cuda_runtime.SOURCE_SM90
    for persistent in (False, True):
        key = ("prefill_wg", 2, 128, persistent)
        assert cuda_runtime.block_threads(key) == 128 * (cuda_source.WG_GROUPS + 1)
        expr = f"prefill_wg_kernel<2,128,{str(persistent).lower()}>"
        assert cuda_runtime.module_kernels(key) == {"attention": expr}
    assert cuda_attention.WGMMA.warps * 32 == 128 * cuda_source.WG_GROUPS  # rows = consumer warps x 16


def test_planner_takes_warpgroup_mma_on_hopper_only():
    """v8 (the default prefill, v10, without persistence) runs the warpgroup-MMA kernel where
    the device has it and the query tiles fill the GPU: two warpgroups of 64 rows, 128-key
    tiles, 3 stages in 225 KiB of shared memory. Without wgmma it is v7; a short chunk after a
    long prefix, float32, head_dim 256 and a non-positive scale keep their old paths; v8f
    forces the kernel."""
    assert cuda_attention.DEFAULT_PREFILL_VARIANT == "v10"
    big = _plan(4096, 1, variant="v8", wgmma=True)
    assert big.pipe.wgmma and big.pipe.warps == 8 and big.pipe.keys == 128 and big.pipe.stages == 3
    assert big.grid == (129 * 8, 1, 1) and big.tokens_per_cta == 32 and big.num_splits == 1
    assert big.smem_bytes == (128 + 2 * 3 * 128) * 256 + 1024 + 16 * 3 <= cuda_attention.SMEM_LIMIT
    assert _plan(4096, 1, variant="v8", wgmma=False) == _plan(4096, 1, variant="v7")
    assert not _plan(64, 1, ctx=32768, variant="v8", wgmma=True).pipe.dedicated  # split-KV
    for other in (
        _plan(4096, 1, variant="v8", wgmma=True, dtype=torch.float32),
        _plan(4096, 1, variant="v8", wgmma=True, d=256),
        _plan(4096, 1, variant="v8", wgmma=True, scale=-0.5),
    ):
        assert not other.pipe.wgmma
    forced = _plan(64, 1, ctx=32768, variant="v8f", wgmma=True)
    assert forced.pipe.wgmma and forced.grid == (3 * 8, 1, 1)


def test_persistent_warpgroup_prefill_plans_one_cta_per_sm():
    """The persistent warpgroup-MMA prefill (v10) keeps v8's choice of kernel and rows per
    CTA, but launches one CTA per SM (fewer where there are fewer items) and tells the kernel
    the items per KV head in num_splits; its shared memory adds the item queue and still
    fits one CTA per SM."""
    for tokens, ctx in ((4096, None), (512, None), (64, 32768)):
        v8, v10 = _plan(tokens, 1, ctx=ctx or tokens, variant="v8", wgmma=True), _plan(
            tokens, 1, ctx=ctx or tokens, variant="v10", wgmma=True)
        assert v10.pipe.dedicated == v8.pipe.dedicated and v10.pipe.wgmma == v8.pipe.wgmma
        if not v8.pipe.wgmma:  # too few tiles to fill the GPU: both split the keys alike
            assert replace(v10, pipe=replace(v10.pipe, persistent=False)) == v8
            continue
        items = v8.grid[0]
        assert v10.pipe.persistent and v10.grid == (min(items, 132), 1, 1) and v10.num_splits * 8 == items
        assert v10.smem_bytes == v8.smem_bytes + cuda_attention.PERSISTENT_QUEUE_BYTES <= cuda_attention.SMEM_LIMIT
    assert not _plan(4096, 1, variant="v10", wgmma=False).pipe.persistent  # no wgmma: v7's kernels


def test_planner_keeps_persistent_prefill_for_tiles_with_few_keys():
    """v10's planner runs the persistent kernel for fresh prompts (the longest sequence within
    4x the mean new tokens) and one CTA per tile behind a long cached prefix; v10f forces it."""
    fresh = _plan(2048, 1, ctx=2048, variant="v10", wgmma=True)
    behind = _plan(2048, 1, ctx=16384, variant="v10", wgmma=True)
    assert fresh.pipe.persistent and behind.pipe.wgmma and not behind.pipe.persistent
    assert behind.grid == _plan(2048, 1, ctx=16384, variant="v8", wgmma=True).grid
    assert _plan(2048, 1, ctx=16384, variant="v10f", wgmma=True).pipe.persistent


def test_tma_maps_refuse_layouts_the_copy_engine_cannot_take():
    """The warpgroup kernel needs a TMA map of the pool; layouts TMA cannot describe (float32,
    a misaligned base) get None from ``usable``, so the planner keeps the mma.sync kernel."""
    from kvpool.kernels import cuda_tma

    geo, case = _tma_case()
    assert cuda_tma.usable(geo, case.k_cache, case.v_cache)
    g32, f32 = _tma_case(dtype=torch.float32)
    assert not cuda_tma.usable(g32, f32.k_cache, f32.v_cache)
    misaligned = torch.empty(case.k_cache.numel() + 1, dtype=torch.bfloat16)[1:].view(case.k_cache.shape)  # 2 bytes off
    assert not cuda_tma.usable(geo, misaligned, case.v_cache)


def _tma_case(seed=0, dtype=torch.bfloat16):
    """A small pool (one 40-token sequence, 2 KV heads, head_dim 64) and its checked geometry."""
    case = make_case([40], num_kv_heads=2, block_size=16, head_dim=64, dtype=dtype, seed=seed)
    q = torch.randn(40, 4, 64).to(dtype)
    cu = torch.tensor([0, 40], dtype=torch.int32)
    a = check_attention(q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens, cu, None, None)
    return a.geo, case


def test_tma_maps_are_made_once_per_view(monkeypatch):
    """A view's map is encoded once (the driver's bytes, copied to the view's device) and
    then served from the cache; a refused view gives None, remembered, and other views
    still get maps."""
    from kvpool.kernels import cuda_tma

    monkeypatch.setattr(cuda_tma, "_MAPS", {})
    monkeypatch.setattr(cuda_tma, "_UNAVAILABLE", [])
    calls = []

    def fake_encode(address, geo, stride):
        calls.append(address)
        return bytes(range(128))

    monkeypatch.setattr(cuda_tma, "encode", fake_encode)
    geo, case = _tma_case()
    k_map, v_map = cuda_tma.maps_for(geo, case.k_cache, case.v_cache)
    assert k_map.dtype == torch.uint8 and k_map.tolist() == list(range(128)) and v_map.numel() == 128
    assert calls == [case.k_cache.data_ptr(), case.v_cache.data_ptr()]
    again = cuda_tma.maps_for(geo, case.k_cache, case.v_cache)
    assert again[0] is k_map and again[1] is v_map and len(calls) == 2

    def refuse(address, geo, stride):
        calls.append(address)
        raise RuntimeError("cuTensorMapEncodeTiled failed with CUresult 1")

    monkeypatch.setattr(cuda_tma, "encode", refuse)
    geo2, other = _tma_case(seed=1)
    assert cuda_tma.maps_for(geo2, other.k_cache, other.v_cache) is None
    assert cuda_tma.maps_for(geo2, other.k_cache, other.v_cache) is None
    assert len(calls) == 3  # the refusal is remembered; the first view's maps are untouched
    assert cuda_tma.maps_for(geo, case.k_cache, case.v_cache)[0] is k_map


def test_tma_maps_fall_back_once_where_the_driver_cannot_make_them(monkeypatch):
    """No cuTensorMapEncodeTiled in the driver (older than CUDA 12): one warning, then None
    for every view without asking the driver again, so prefill keeps the mma.sync kernel."""
    from kvpool.kernels import cuda_tma

    monkeypatch.setattr(cuda_tma, "_MAPS", {})
    monkeypatch.setattr(cuda_tma, "_UNAVAILABLE", [])
    calls = []

    def no_symbol():
        calls.append(1)
        raise AttributeError("/usr/lib/libcuda.so.1: undefined symbol: cuTensorMapEncodeTiled")

    monkeypatch.setattr(cuda_tma, "_encode_fn", no_symbol)
    geo, case = _tma_case()
    with pytest.warns(RuntimeWarning, match="cannot make TMA tensor maps"):
        assert cuda_tma.maps_for(geo, case.k_cache, case.v_cache) is None
    assert cuda_tma.maps_for(geo, case.k_cache, case.v_cache) is None
    assert calls == [1] and cuda_tma._MAPS == {}


def test_planner_picks_the_prefill_kernel_per_shape():
    """Dedicated kernel, 8 warps x 16 rows per CTA, where that grid is two to four waves of
    one CTA per SM (1k tokens x 8 KV heads on 132 SMs); else 4 warps x 32 rows where that
    leaves four CTAs per SM (4k), else 4 x 16 rows; the split-KV kernel where the query tiles
    cannot fill the GPU (a short chunk after a long prefix), for float32 / head_dim 256,
    and for forced splits."""
    long = _plan(4096, 1)  # 7.8 waves: 128 rows on 4 warps, two CTAs per SM
    assert long.pipe.dedicated and long.pipe.warps == 4 and long.pipe.mtiles == 2 and long.grid == (129 * 8, 1, 1)
    mid = _plan(1024, 1, ctx=1024)  # 2 waves
    assert mid.pipe == cuda_attention.W8 and mid.grid == (33 * 8, 1, 1) and mid.tokens_per_cta == 32
    assert mid.smem_bytes == 128 * 256 + 3 * 2 * 64 * 256
    small = _plan(768, 1, ctx=768)  # 25 x 8 = 200 CTAs of 128 rows: under two waves
    assert small.pipe.dedicated and small.pipe.warps == 4 and small.pipe.mtiles == 1 and small.grid == (49 * 8, 1, 1)
    off = _plan(1024, 1, ctx=1024, tuning=replace(cuda_attention.DEFAULT_TUNING, w8_waves=None))  # W8 never
    assert off.pipe.mtiles == 1 and off.pipe.warps == 4 and off.grid == (65 * 8, 1, 1)
    chunk = _plan(64, 1, ctx=32768)
    assert not chunk.pipe.dedicated and chunk.num_splits > 1
    for other in (_plan(4096, 1, dtype=torch.float32), _plan(4096, 1, d=256), _plan(4096, 1, splits=2)):
        assert not other.pipe.dedicated
    assert _plan(4096, 1, variant="v7m1").pipe.mtiles == 1  # a forced row count is kept


def test_planner_picks_decode_stages_per_shape():
    """Two stages (three CTAs per SM) where sequences x KV heads is about one CTA per SM and
    contexts are long; between one wave of two per SM and three waves of three, the stage
    count whose last wave is fuller (132 SMs, 8 KV heads: B48 is one wave of three per SM,
    B64 1.94 waves of two); three elsewhere, and two for a float8 cache outside that band."""
    stages = {(b, ctx): _plan(b, b, prefill=False, ctx=ctx).pipe.stages for b in (1, 16, 64) for ctx in (1024, 4096)}
    assert stages == {(1, 1024): 3, (1, 4096): 3, (16, 1024): 3, (16, 4096): 2, (64, 1024): 3, (64, 4096): 3}
    fp8 = torch.float8_e4m3fn
    batches = (16, 48, 64, 128, 256)
    waves = {(b, dt): _plan(b, b, prefill=False, dtype=dt).pipe.stages for b in batches for dt in (torch.bfloat16, fp8)}
    assert waves == {
        (16, torch.bfloat16): 2, (16, fp8): 2, (48, torch.bfloat16): 2, (48, fp8): 2, (64, torch.bfloat16): 3,
        (64, fp8): 3, (128, torch.bfloat16): 3, (128, fp8): 3, (256, torch.bfloat16): 3, (256, fp8): 2,
    }  # fmt: skip
    assert cuda_attention.wave_idle(0.97) == 0.0 and cuda_attention.wave_idle(1.25) == 0.75


def test_planner_picks_decode_splits_per_shape():
    """Batch 1: one CTA per SM (8 KV heads x 16 splits); batch 16: two CTAs per SM (2
    splits), even where shared memory would seat three; batch 64 fills the GPU unsplit up
    to 8k keys per CTA, and a grid of several waves splits longer contexts into CTAs of
    at most 8k keys."""
    splits = {(b, ctx): _plan(b, b, prefill=False, ctx=ctx).num_splits for b in (1, 16, 64) for ctx in (1024, 4096, 16384)}
    assert splits == {
        (1, 1024): 16, (1, 4096): 16, (1, 16384): 16,
        (16, 1024): 2, (16, 4096): 2, (16, 16384): 2,
        (64, 1024): 1, (64, 4096): 1, (64, 16384): 2,
    }  # fmt: skip
    long = {(b, ctx): _plan(b, b, prefill=False, ctx=ctx).num_splits for b in (16, 256) for ctx in (8192, 131072)}
    assert long == {(16, 8192): 2, (16, 131072): 2, (256, 8192): 1, (256, 131072): 16}


def test_planner_pairs_two_splits_where_the_device_has_clusters():
    """Decode with exactly two splits runs as cluster pairs (with room past the rings for
    split 1's 16 rows of 128 floats and their log-sum-exps), on devices with clusters and
    in the default variant only; other split counts, prefill and ``v7a`` keep the merge by
    arrival counter."""
    pair = _plan(16, 16, prefill=False, ctx=4096, clusters=True)
    plain = _plan(16, 16, prefill=False, ctx=4096)
    assert pair.num_splits == 2 and pair.pair and not plain.pair
    assert pair.smem_bytes == plain.smem_bytes + 16 * 129 * 4
    assert pair.grid == plain.grid and pair.chunk == plain.chunk and pair.pipe == plain.pipe
    assert not _plan(16, 16, prefill=False, ctx=4096, clusters=True, variant="v7a").pair
    assert not _plan(1, 1, prefill=False, ctx=4096, clusters=True).pair  # 16 splits
    assert not _plan(64, 64, prefill=False, ctx=4096, clusters=True).pair  # 1 split
    assert _plan(64, 64, prefill=False, ctx=16384, clusters=True).pair  # 2 splits of 8k keys
    assert not _plan(64, 1, ctx=32768, splits=2, clusters=True).pair  # prefill


def test_emulated_pair_without_split_1_arriving_is_caught(monkeypatch):
    """The emulator's cluster barrier is a real check: with split 1's arrival taken out of the
    source, split 0's wait finds it missing and the launch fails (instead of merging the
    poisoned rows split 1 would have sent)."""
    sent = "            cluster_arrive();                                // release: the rows above are visible\n"
    assert cuda_emulator.SOURCE.count(sent) == 1
    monkeypatch.setattr(cuda_emulator, "SOURCE", cuda_emulator.SOURCE.replace(sent, ""))
    case = make_case([300, 40], num_kv_heads=2, block_size=16, head_dim=64, dtype=torch.bfloat16, seed=3)
    q = torch.randn(2, 8, 64).to(torch.bfloat16)
    launcher = cuda_emulator.EmulatorLauncher(num_sms=2)
    with pytest.raises(RuntimeError, match="cluster barrier"):
        _run(launcher, case, q, None, 2, variant="v7")  # v7: two splits as a cluster pair
