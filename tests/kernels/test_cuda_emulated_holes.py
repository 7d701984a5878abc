"""The GPU attention kernels read only the blocks of the keys they attend, emulated on the CPU.

On an elastic pool a layout class gives chunks back while its process runs: their places in
the class's virtual range are unmapped, and a GPU read there is an illegal-address fault that
kills the process. The block ids in those places can still sit in a block-table row past a
sequence's length (a row keeps the blocks of its last owner there). Here such stale columns
hold valid ids of "given-back" blocks, whose bytes the emulator forbids
(``EmulatorLauncher.forbidden``): any read that forms an address from a stale column, or from any
id a sequence does not attend, fails the test even when its data would be masked out. The
kernels' results must also equal the float64 reference.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvpool.kernels import cuda_attention
from kvpool.kernels._validate import check_attention
from tests.kernels.support import cuda_emulator
from tests.kernels.support import reference as ref
from tests.kernels.support.testing import (assert_matches_reference, mixed_batch, poisoned, random_pool,
                                           tables_with_stale_columns)

pytestmark = pytest.mark.skipif(not cuda_emulator.available(), reason="needs g++ for the CUDA emulator")

BLOCK = 16


@st.composite
def batches(draw):
    """Decode rows (one query) and prefill chunks (several queries after cached keys) in one call, or decode
    rows alone; a pool with given-back blocks, whose ids fill each table row past the sequence's blocks."""
    decode_only = draw(st.booleans())
    decodes = draw(st.lists(st.integers(1, 300), min_size=1 if decode_only else 0, max_size=6))
    chunks = [] if decode_only else draw(st.lists(st.tuples(st.integers(0, 200), st.integers(2, 120)),
                                                  min_size=1, max_size=3))
    head_dim = draw(st.sampled_from([64, 128]))
    group = draw(st.sampled_from([1, 4, 8]))
    dtype = draw(st.sampled_from([torch.bfloat16, torch.float16, torch.float32]))
    holes = draw(st.integers(4, 24))
    sms = draw(st.sampled_from([4, 32]))
    seed = draw(st.integers(0, 2**16))
    return decodes, chunks, head_dim, group, dtype, holes, sms, seed


def _case(decodes, chunks, head_dim, group, dtype, holes, seed):
    g = torch.Generator().manual_seed(seed)
    q_lens, seq_lens, cu = mixed_batch(decodes, chunks)
    num_blocks = sum(-(-int(n) // BLOCK) for n in seq_lens) + holes
    pool = random_pool(num_blocks, 2, 2, BLOCK, head_dim, dtype, generator=g)
    perm = torch.randperm(num_blocks, generator=g).to(torch.int32)
    given_back, usable = perm[:holes], perm[holes:]
    tables = tables_with_stale_columns(seq_lens, BLOCK, usable, given_back, 3, g)
    q = torch.randn(sum(q_lens), 2 * group, head_dim, generator=g).to(dtype)
    return pool, given_back, tables, seq_lens, q, cu


def _forbidden(pool: torch.Tensor, blocks: torch.Tensor) -> list[tuple[int, int]]:
    """The byte ranges of ``blocks`` (every layer, K and V: a block is contiguous in the kvpool layout)."""
    step = pool.stride(0) * pool.element_size()
    return [(pool.data_ptr() + b * step, pool.data_ptr() + (b + 1) * step) for b in blocks.tolist()]


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(batches())
def test_kernels_never_read_a_block_past_a_sequences_own(batch):
    decodes, chunks, head_dim, group, dtype, holes, sms, seed = batch
    pool, given_back, tables, seq_lens, q, cu = _case(decodes, chunks, head_dim, group, dtype, holes, seed)
    layer = seed % 2
    k_cache, v_cache = pool[:, layer, 0], pool[:, layer, 1]
    cu_arg = None if not chunks else cu
    launcher = cuda_emulator.EmulatorLauncher(num_sms=sms, cp_async="late")
    launcher.forbidden = _forbidden(pool, given_back)
    out = poisoned(q.shape, q.dtype)
    a = check_attention(q, k_cache, v_cache, tables, seq_lens, cu_arg, None, out)
    cuda_attention.paged_attention(a, q, k_cache, v_cache, tables, seq_lens, cu_arg, launcher=launcher)
    want = ref.paged_attention_reference(q, k_cache, v_cache, tables, seq_lens, cu, None)
    assert_matches_reference(out, want, "cuda")


def test_the_emulator_fails_a_read_of_a_forbidden_block():
    """The check itself: a table that names a given-back block inside a sequence's length is caught."""
    pool, given_back, tables, seq_lens, q, cu = _case([40, 7], [], 64, 4, torch.bfloat16, 4, seed=3)
    tables[0, 1] = given_back[0]  # keys 16..31 of sequence 0 in a given-back block
    k_cache, v_cache = pool[:, 0, 0], pool[:, 0, 1]
    launcher = cuda_emulator.EmulatorLauncher(num_sms=4, cp_async="late")
    launcher.forbidden = _forbidden(pool, given_back[:1])
    out = poisoned(q.shape, q.dtype)
    a = check_attention(q, k_cache, v_cache, tables, seq_lens, None, None, out)
    with pytest.raises(cuda_emulator.ForbiddenRead):
        cuda_attention.paged_attention(a, q, k_cache, v_cache, tables, seq_lens, None, launcher=launcher)
