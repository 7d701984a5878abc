"""The CUDA kernels' source, run lane by lane on the CPU (``kvpool.kernels.cuda_emulator``).

This checks the GPU kernels' logic in CI, where there is no GPU: MMA
fragment layouts, the V operand's dim permutation, causal masks, split-KV
and its merge, the prefill tile mapping, through the same host launch code
as on the GPU. Small shapes: every lane is a fiber.
"""

import random

import pytest
import torch

from kvpool.kernels import cuda_attention, cuda_emulator, cuda_write_kv
from kvpool.kernels import reference as ref
from kvpool.kernels._validate import check_attention, check_write_kv
from kvpool.kernels.testing import assert_matches_reference, make_case, poisoned

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


def _run(launcher, case, q, cu, num_splits, max_seq_len=None):
    out = poisoned(q.shape, q.dtype)
    a = check_attention(q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens, cu, None, out)
    cuda_attention.paged_attention(
        a, q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens, cu,
        max_seq_len=max_seq_len, num_splits=num_splits, launcher=launcher,
    )  # fmt: skip
    return out


@pytest.mark.parametrize("dtype, d, bs, group, splits", CONFIGS)
def test_emulated_decode(launcher, dtype, d, bs, group, splits):
    rng = random.Random(d + bs + group)
    lens = [0, 1, bs, 2 * bs + 1, rng.randint(1, 70), 300]  # 300: many pipelined tiles per warp
    case = make_case(lens, num_kv_heads=2, block_size=bs, head_dim=d, dtype=dtype, seed=group)
    q = (2 * torch.randn(len(lens), 2 * group, d)).to(dtype)
    out = _run(launcher, case, q, None, splits)
    want = ref.paged_decode_reference(q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens)
    assert_matches_reference(out, want, "cuda")


@pytest.mark.parametrize("dtype, d, bs, group, splits", CONFIGS)
def test_emulated_prefill(launcher, dtype, d, bs, group, splits):
    lens, q_lens = [19, 0, 2 * bs, 5], [19, 0, 3, 1]  # full, empty, chunked, decode-like
    case = make_case(lens, num_kv_heads=2, block_size=bs, head_dim=d, dtype=dtype, seed=7)
    cu = torch.tensor([0] + q_lens, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    q = torch.randn(int(cu[-1]), 2 * group, d).to(dtype)
    out = _run(launcher, case, q, cu, splits)
    want = ref.paged_prefill_reference(q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens, cu)
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
