"""Sliding windows, logits soft caps and fp8 caches with scales on the CPU path.

Every case is compared with the float64 reference, which decodes fp8 from its
bits and applies window, cap and scales by their definition. Length mixes are
the ones real batches have: skewed (one long sequence among many short ones)
and spread (lengths over two orders of magnitude), seq_len 1 and chunked
prefill (q_len > 1 and < seq_len) included. Tolerances are the per-output-dtype
ones of ``assert_matches_reference``: the kernel computes in float32 from
exactly converted inputs (fp8 decodes exactly), so the output rounding
dominates as without these options.
"""

from __future__ import annotations

import math
import os
import random
import uuid

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvpool.kernels import (
    cpu_attention, cpu_numerics, cpu_work, paged_decode_attention, paged_prefill_attention, write_kv,
)
from tests.kernels.support import reference as ref
from tests.kernels.support.testing import assert_matches_reference, make_case, poisoned

FP8 = torch.float8_e4m3fn
HEAD_DIMS = [64, 80, 96, 112, 128, 192, 256]
CACHE_DTYPES = [torch.float32, torch.float16, torch.bfloat16, FP8]


def _skewed(rng: random.Random) -> list[int]:
    return [rng.randint(1000, 2500)] + [rng.choice([1, rng.randint(2, 40)]) for _ in range(rng.randint(4, 9))]


def _spread(rng: random.Random) -> list[int]:
    return [1] + [int(math.exp(rng.uniform(0, math.log(2000)))) for _ in range(rng.randint(3, 6))]


def _q_lens(rng: random.Random, lens: list[int]) -> list[int]:
    """Per sequence: decode-like (1), chunked (1 < q_len < seq_len) or full prefill, capped for time."""
    return [rng.choice([1, min(n, rng.randint(2, 48)), min(n, 96)]) for n in lens]


def _q_dtype(cache_dtype: torch.dtype, rng: random.Random) -> torch.dtype:
    return rng.choice([torch.float16, torch.bfloat16, torch.float32]) if cache_dtype == FP8 else cache_dtype


def _run(case, q, cu, **options) -> None:
    """The kernel (decode when ``cu`` is None) against the reference, output poisoned first."""
    out = poisoned(q.shape, q.dtype)
    tables, lens = case.block_tables, case.seq_lens
    if cu is None:
        paged_decode_attention(q, case.k_cache, case.v_cache, tables, lens, out=out, **options)
        want = ref.paged_decode_reference(q, case.k_cache, case.v_cache, tables, lens, **options)
    else:
        paged_prefill_attention(q, case.k_cache, case.v_cache, tables, lens, cu, out=out, **options)
        want = ref.paged_prefill_reference(q, case.k_cache, case.v_cache, tables, lens, cu, **options)
    assert_matches_reference(out, want, "cpu")


def _options(rng: random.Random, lens: list[int], cache_dtype: torch.dtype) -> dict:
    window = rng.choice([None, 1, rng.randint(2, 100), rng.choice(lens), max(lens) + rng.randint(1, 50)])
    options = dict(sliding_window=window, logits_soft_cap=rng.choice([None, 5.0, 30.0]))
    if cache_dtype == FP8:
        options.update(k_scale=rng.choice([1.0, 0.25, 1.7]), v_scale=rng.choice([1.0, 0.5, 3.1]))
    return options


@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES, ids=str)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_length_mixes_match_reference(head_dim, cache_dtype):
    """Every head_dim x cache dtype: a skewed decode batch and a spread chunked-prefill batch."""
    rng = random.Random(head_dim * 7 + CACHE_DTYPES.index(cache_dtype))
    hkv, group = rng.choice([(1, 1), (2, 4), (1, 8), (2, 3)])
    q_dtype = _q_dtype(cache_dtype, rng)
    for mode, lens in (("decode", _skewed(rng)), ("prefill", _spread(rng))):
        seed = rng.randint(0, 10**6)
        case = make_case(lens, num_kv_heads=hkv, block_size=rng.choice([16, 32]), head_dim=head_dim,
                         dtype=cache_dtype, seed=seed)  # fmt: skip
        g = torch.Generator().manual_seed(seed)
        if mode == "decode":
            cu, t = None, len(lens)
        else:
            cu = torch.tensor([0] + _q_lens(rng, lens), dtype=torch.int32).cumsum(0, dtype=torch.int32)
            t = int(cu[-1])
        q = (2 * torch.randn(t, hkv * group, head_dim, generator=g)).to(q_dtype)
        _run(case, q, cu, **_options(rng, lens, cache_dtype))


def _windows_around(n: int) -> list[int]:
    c = cpu_attention.CHUNK
    return sorted({1, 2, 5, max(n - 1, 1), n, n + 1, 10 * n, c - 1, c, c + 1})


@pytest.mark.parametrize("path", ["decode", "prefill rows in lanes", "prefill dot products"])
@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, FP8], ids=str)
def test_windows_smaller_equal_larger(path, cache_dtype):
    """Windows of 1, a few keys, about a chunk, the length -1/0/+1 and far beyond it, on each kernel path."""
    lens = [1, 7, 64, 65, 150, 300]
    group = {"decode": 4, "prefill rows in lanes": 8, "prefill dot products": 1}[path]
    case = make_case(lens, num_kv_heads=2, block_size=16, head_dim=64, dtype=cache_dtype, seed=len(path))
    g = torch.Generator().manual_seed(3)
    if path == "decode":
        cu, t = None, len(lens)
    else:
        q_lens = [1, 7, 40, 65, 3, 150] if path == "prefill rows in lanes" else [1, 3, 2, 5, 3, 2]
        cu = torch.tensor([0] + q_lens, dtype=torch.int32).cumsum(0, dtype=torch.int32)
        t = int(cu[-1])
    q = (2 * torch.randn(t, 2 * group, 64, generator=g)).to(_q_dtype(cache_dtype, random.Random(1)))
    for window in sorted({w for n in (7, 150) for w in _windows_around(n)}):
        _run(case, q, cu, sliding_window=window)


@pytest.mark.parametrize("cap", [0.5, 5.0, 50.0])
@pytest.mark.parametrize("q_len", [1, 40])
def test_soft_cap_with_large_scores(cap, q_len):
    """Scores far beyond the cap (tanh saturates) and within it (tanh about linear)."""
    case = make_case([200], num_kv_heads=1, block_size=16, head_dim=128, seed=9)
    g = torch.Generator().manual_seed(9)
    q = 8 * torch.randn(q_len, 4, 128, generator=g)  # scores of |s| up to ~30
    cu = torch.tensor([0, q_len], dtype=torch.int32)
    _run(case, q, cu, logits_soft_cap=cap)
    _run(case, q, cu, logits_soft_cap=cap, sliding_window=33)


@pytest.mark.parametrize("window, cap", [(2**31 - 1, None), (2**70, None), (None, 1e300), (None, 1e-300), (3, 4e38)])
def test_extreme_windows_and_caps(window, cap):
    """A window past any int32 length is no window; caps beyond float32's range in either direction."""
    case = make_case([300, 5], num_kv_heads=1, block_size=16, head_dim=64, seed=11)
    q = 3 * torch.randn(2, 2, 64, generator=torch.Generator().manual_seed(11))
    _run(case, q, None, sliding_window=window, logits_soft_cap=cap)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    lens=st.lists(st.integers(0, 400), min_size=1, max_size=6),
    q_frac=st.lists(st.floats(0, 1), min_size=6, max_size=6),
    window=st.one_of(st.none(), st.integers(1, 500)),
    group=st.sampled_from([1, 2, 5, 8]),
    cap=st.sampled_from([None, 10.0]),
)
def test_property_lengths_and_windows(lens, q_frac, window, group, cap):
    """Any mix of lengths, query counts (0 to seq_len) and windows matches the reference (float32)."""
    q_lens = [round(n * f) for n, f in zip(lens, q_frac)]
    case = make_case(lens, num_kv_heads=2, block_size=16, head_dim=64, seed=sum(lens))
    cu = torch.tensor([0] + q_lens, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    q = torch.randn(int(cu[-1]), 2 * group, 64, generator=torch.Generator().manual_seed(len(lens)))
    _run(case, q, cu, sliding_window=window, logits_soft_cap=cap)
    q1 = torch.randn(len(lens), 2 * group, 64, generator=torch.Generator().manual_seed(1))
    _run(case, q1, None, sliding_window=window, logits_soft_cap=cap)


def test_window_skips_invisible_keys():
    """Keys before every query's window are never read: NaN there changes nothing."""
    case = make_case([500], num_kv_heads=1, block_size=16, head_dim=64, seed=4)
    q = torch.randn(20, 2, 64)
    cu = torch.tensor([0, 20], dtype=torch.int32)
    want = ref.paged_prefill_reference(q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens, cu,
                                       sliding_window=100)  # fmt: skip
    first_visible = 500 - 20 - 100 + 1
    table = case.block_tables[0].long()
    pos = torch.arange(first_visible)
    case.k_cache[table[pos // 16], :, pos % 16] = float("nan")
    case.v_cache[table[pos // 16], :, pos % 16] = float("nan")
    out = paged_prefill_attention(q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens, cu,
                                  sliding_window=100)  # fmt: skip
    assert_matches_reference(out, want, "cpu")
    d = paged_decode_attention(q[-1:], case.k_cache, case.v_cache, case.block_tables, case.seq_lens,
                               sliding_window=100)  # fmt: skip
    assert_matches_reference(d, want[-1:], "cpu")


def test_work_items_weigh_windowed_tiles_by_visible_keys():
    """A decode row at position 2999 sees 3000 keys, or 64 with the window: then it is the
    lightest item (second in the heavy/light order), lighter than any 16-token prefill tile."""
    cu = np.array([0, 1000, 1001], dtype=np.int32)
    lens = np.array([1000, 3000], dtype=np.int32)
    windowed = cpu_work.work_items(cu, 1, 16, lens, window=64)
    plain = cpu_work.work_items(cu, 1, 16, lens)
    assert windowed[1, 0] == 1 and plain[1, 0] == 0
    assert sorted(map(tuple, windowed.tolist())) == sorted(map(tuple, plain.tolist()))


# ----------------------------------------------------------------------------- write_kv into fp8


def _fp8_case(lens, head_dim=64, seed=0):
    return make_case(lens, num_kv_heads=2, block_size=16, head_dim=head_dim, dtype=FP8, seed=seed)


def _slots(case, b: int, positions: torch.Tensor) -> torch.Tensor:
    return case.block_tables[b].long()[positions // 16] * 16 + positions % 16


@pytest.mark.parametrize("src_dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
def test_write_kv_fp8_quantizes_and_clamps(src_dtype):
    case = _fp8_case([40, 17], seed=1)
    before = case.kv_cache.clone()
    g = torch.Generator().manual_seed(2)
    k_scale, v_scale = 0.37, 2.5
    key = (40 * torch.randn(10, 2, 64, generator=g)).to(src_dtype)
    value = (400 * torch.randn(10, 2, 64, generator=g)).to(src_dtype)
    key[0, 0, :4] = torch.tensor([1e4, -1e4, 448 * k_scale, 0.0])  # clamped, clamped, the largest code, zero
    slots = _slots(case, 0, torch.arange(25, 35))
    slots[3] = -1  # padding
    want_k, want_v = ref.write_kv_reference(key, value, case.k_cache, case.v_cache, slots, k_scale=k_scale, v_scale=v_scale)
    write_kv(key, value, case.k_cache, case.v_cache, slots, k_scale=k_scale, v_scale=v_scale)
    got_k = ref.fp8_e4m3_decode(case.k_cache.view(torch.uint8).numpy())
    got_v = ref.fp8_e4m3_decode(case.v_cache.view(torch.uint8).numpy())
    assert np.array_equal(got_k, want_k) and np.array_equal(got_v, want_v)
    blk, off = int(slots[0]) // 16, int(slots[0]) % 16
    assert case.k_cache[blk, 0, off, :4].float().tolist() == [448.0, -448.0, 448.0, 0.0]
    assert not torch.isnan(case.v_cache.float()).any()  # clamped, never the NaN code
    other = 1 - case.layer
    assert torch.equal(case.kv_cache[:, other].view(torch.uint8), before[:, other].view(torch.uint8))


def test_write_kv_fp8_then_attention_reads_the_dequantized_values():
    """Window 1: each query sees only its own key, so out = stored V * v_scale, exactly."""
    case = _fp8_case([37], seed=3)
    k_scale, v_scale = 0.75, 0.5  # v_scale a power of 2: the product is exact in float32
    g = torch.Generator().manual_seed(4)
    key, value = torch.randn(37, 2, 64, generator=g), 3 * torch.randn(37, 2, 64, generator=g)
    write_kv(key, value, case.k_cache, case.v_cache, _slots(case, 0, torch.arange(37)), k_scale=k_scale, v_scale=v_scale)
    q = torch.randn(37, 4, 64, generator=g)
    cu = torch.tensor([0, 37], dtype=torch.int32)
    out = paged_prefill_attention(q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens, cu,
                                  sliding_window=1, k_scale=k_scale, v_scale=v_scale)  # fmt: skip
    stored_v = torch.from_numpy(ref.fp8_e4m3_encode(value, v_scale)).float()
    assert torch.equal(out, (stored_v * v_scale).repeat_interleave(2, dim=1))
    # and the full causal attention over the same cache against the reference
    _run(case, q.half(), cu, k_scale=k_scale, v_scale=v_scale)


@pytest.mark.parametrize("out_dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
def test_fp8_cache_output_has_q_dtype(out_dtype):
    case = _fp8_case([30, 1], seed=5)
    q = torch.randn(2, 4, 64).to(out_dtype)
    out = paged_decode_attention(q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens, k_scale=2.0)
    assert out.dtype == out_dtype
    want = ref.paged_decode_reference(q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens, k_scale=2.0)
    assert_matches_reference(out, want, "cpu")


# ----------------------------------------------------------------------------- bad arguments


def _call_all(case, dtype_q=None, **bad):
    """Decode and prefill with the same arguments (q in the cache's dtype, float32 for fp8)."""
    if dtype_q is None:
        dtype_q = torch.float32 if case.kv_cache.dtype == FP8 else case.kv_cache.dtype
    q = torch.randn(2, 4, 64).to(dtype_q)
    args = (q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens)
    yield lambda: paged_decode_attention(*args, **bad)
    yield lambda: paged_prefill_attention(*args, torch.tensor([0, 1, 2], dtype=torch.int32), **bad)


ATTENTION_ERRORS = [
    (dict(sliding_window=0), ValueError, "sliding_window must be >= 1"),
    (dict(sliding_window=-3), ValueError, "sliding_window must be >= 1"),
    (dict(sliding_window=2.0), TypeError, "sliding_window must be an int"),
    (dict(sliding_window=True), TypeError, "sliding_window must be an int"),
    (dict(sliding_window="8"), TypeError, "sliding_window must be an int"),
    (dict(logits_soft_cap=0.0), ValueError, "logits_soft_cap must be finite and > 0"),
    (dict(logits_soft_cap=-1.0), ValueError, "logits_soft_cap must be finite and > 0"),
    (dict(logits_soft_cap=float("inf")), ValueError, "logits_soft_cap must be finite"),
    (dict(logits_soft_cap=float("nan")), ValueError, "logits_soft_cap must be finite"),
    (dict(logits_soft_cap=True), TypeError, "logits_soft_cap must be a float"),
    (dict(logits_soft_cap="30"), TypeError, "logits_soft_cap must be a float"),
    (dict(k_scale=0.0), ValueError, "k_scale must be finite and > 0"),
    (dict(v_scale=-2.0), ValueError, "v_scale must be finite and > 0"),
    (dict(k_scale=float("nan")), ValueError, "k_scale must be finite"),
    (dict(v_scale=float("inf")), ValueError, "v_scale must be finite"),
    (dict(k_scale=None), TypeError, "k_scale must be a float"),
    (dict(v_scale=True), TypeError, "v_scale must be a float"),
]


@pytest.mark.parametrize("cache_dtype", [torch.float32, FP8], ids=str)
@pytest.mark.parametrize("bad, exc, words", ATTENTION_ERRORS)
def test_attention_argument_errors_leave_everything_untouched(cache_dtype, bad, exc, words):
    case = make_case([5, 20], num_kv_heads=2, block_size=8, head_dim=64, dtype=cache_dtype)
    before = case.kv_cache.view(torch.uint8).clone()
    for call in _call_all(case, **bad):
        with pytest.raises(exc, match=words):
            call()
    assert torch.equal(case.kv_cache.view(torch.uint8), before)


def test_scales_need_an_fp8_cache_and_q_dtypes():
    case = make_case([5, 20], num_kv_heads=2, block_size=8, head_dim=64, dtype=torch.bfloat16)
    for call in _call_all(case, k_scale=0.5):
        with pytest.raises(ValueError, match="k_scale = 0.5 needs a float8_e4m3fn cache"):
            call()
    for call in _call_all(case, v_scale=2.0):
        with pytest.raises(ValueError, match="v_scale = 2.0 needs a float8_e4m3fn cache"):
            call()
    for call in _call_all(case, dtype_q=torch.float32):
        with pytest.raises(TypeError, match="q dtype torch.float32 must match the KV cache dtype torch.bfloat16"):
            call()
    fp8 = _fp8_case([5, 20])
    for call in _call_all(fp8, dtype_q=torch.float64):
        with pytest.raises(TypeError, match="q must have dtype torch.float16, torch.bfloat16, torch.float32"):
            call()


WRITE_ERRORS = [
    (dict(k_scale=0.0), ValueError, "k_scale must be finite and > 0"),
    (dict(v_scale=float("nan")), ValueError, "v_scale must be finite and > 0"),
    (dict(k_scale="1"), TypeError, "k_scale must be a float"),
    (dict(key_dtype=torch.float64), TypeError, "key must have dtype torch.float16, torch.bfloat16, torch.float32"),
    (dict(slots=[0, 1, 10**6]), ValueError, "past the pool's last slot"),
]


@pytest.mark.parametrize("bad, exc, words", WRITE_ERRORS)
def test_write_kv_fp8_errors_leave_the_cache_untouched(bad, exc, words):
    case = _fp8_case([20, 9])
    before = case.kv_cache.view(torch.uint8).clone()
    key = torch.randn(3, 2, 64, dtype=bad.pop("key_dtype", torch.float32))
    slots = torch.tensor(bad.pop("slots", [0, 1, 2]))
    with pytest.raises(exc, match=words):
        write_kv(key, torch.randn(3, 2, 64), case.k_cache, case.v_cache, slots, **bad)
    assert torch.equal(case.kv_cache.view(torch.uint8), before)


def test_write_kv_scales_need_an_fp8_cache():
    case = make_case([20], num_kv_heads=2, block_size=8, head_dim=64, dtype=torch.float16)
    before = case.kv_cache.clone()
    key = torch.randn(3, 2, 64).half()
    with pytest.raises(ValueError, match="v_scale = 0.5 needs a float8_e4m3fn cache"):
        write_kv(key, key, case.k_cache, case.v_cache, torch.tensor([0, 1, 2]), v_scale=0.5)
    with pytest.raises(TypeError, match="key dtype torch.float32 must match the KV cache dtype torch.float16"):
        write_kv(key.float(), key, case.k_cache, case.v_cache, torch.tensor([0, 1, 2]))
    assert torch.equal(case.kv_cache, before)


# ----------------------------------------------------------------------------- the client's pool views


def test_fp8_layout_block_size_and_shared_memory_view():
    """A float8_e4m3fn Layout: 1 byte per element, and the client's CPU view of the pool is
    an fp8 tensor that write_kv and attention take as it is (per-layer strided views)."""
    from kvpool.ipc import open_arena
    from kvpool.layout import Layout

    layout = Layout("m", num_layers=3, num_kv_heads=2, head_dim=64, dtype="float8_e4m3fn", block_size=16)
    assert layout.itemsize == 1 and layout.block_bytes == 3 * 2 * 2 * 16 * 64
    if not os.path.isdir("/dev/shm"):
        pytest.skip("needs /dev/shm (Linux)")
    from kvpoold.memory.cpu_shm import CpuShmBackend

    backend = CpuShmBackend(f"t{uuid.uuid4().hex[:10]}")
    try:
        num_blocks = 8
        arena = backend.create_arena("cls0", num_blocks * layout.block_bytes)
        client = open_arena(arena.descriptor, fd=os.dup(arena.fileno()))
        kv = client.as_tensor(layout.dtype, (num_blocks, *layout.block_shape))
        assert kv.dtype == FP8 and kv.shape == (num_blocks, *layout.block_shape)
        k_cache, v_cache = kv[:, 1, 0], kv[:, 1, 1]
        table = torch.tensor([[5, 2]], dtype=torch.int32)
        lens = torch.tensor([20], dtype=torch.int32)
        key, value = torch.randn(20, 2, 64), torch.randn(20, 2, 64)
        pos = torch.arange(20)
        write_kv(key, value, k_cache, v_cache, table[0].long()[pos // 16] * 16 + pos % 16, k_scale=0.5, v_scale=0.25)
        daemon_view = arena.as_tensor(layout.dtype, (num_blocks, *layout.block_shape))
        assert torch.equal(daemon_view.view(torch.uint8), kv.view(torch.uint8))  # one memory
        q = torch.randn(1, 4, 64).to(torch.bfloat16)
        out = paged_decode_attention(q, k_cache, v_cache, table, lens, k_scale=0.5, v_scale=0.25)
        want = ref.paged_decode_reference(q, k_cache, v_cache, table, lens, k_scale=0.5, v_scale=0.25)
        assert_matches_reference(out, want, "cpu")
        del kv, k_cache, v_cache, daemon_view
        client.close()
    finally:
        backend.close()


def test_tanh_polynomial():
    """The kernel's vectorizable tanh: a few ulp over the whole range, odd, saturating to +-1."""
    x = np.concatenate([np.linspace(-12, 12, 200001, dtype=np.float32), np.float32([1e-30, -1e-30, 0, 50, -50])])
    y = np.empty_like(x)
    _tanh_into(x, y)
    want = np.tanh(x.astype(np.float64))
    assert np.all(np.abs(y - want) <= 4 * np.spacing(np.abs(want).astype(np.float32)) + 1e-45)
    assert np.array_equal(y, -_negated(x))


def _negated(x):
    y = np.empty_like(x)
    _tanh_into(-x, y)
    return y


@cpu_numerics.numba.njit(fastmath=cpu_numerics.FASTMATH)
def _tanh_into(x, y):
    for i in range(x.size):
        y[i] = cpu_numerics.fast_tanh(x[i])
