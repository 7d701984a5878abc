"""Decode sequences that share their leading blocks (a common prompt prefix) on the CPU path.

The kernel computes the shared keys once for all such sequences (rows in vector
lanes) and then each sequence's own keys from that softmax state; these cases
put the shared length on and around block and chunk boundaries, sequences that
end inside the shared blocks, own suffixes of 0, 1 and more keys, sequences
that share fewer blocks or none, GQA groups up to tiles of several items, and
compare with the float64 reference.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvpool.kernels import cpu_attention, cpu_work, paged_decode_attention
from tests.kernels.support import reference as ref
from tests.kernels.support.testing import PAD_BLOCK, assert_matches_reference, poisoned, random_pool

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _shared_case(prefix_blocks, own_lens, block_size, *, cuts, seed, dtype, num_kv_heads=2, head_dim=64):
    """Sequence i reads the first ``prefix_blocks[i]`` blocks of one common run of blocks, then
    ``own_lens[i]`` keys in blocks of its own; a sequence with no own keys ends ``cuts[i]`` keys
    before the end of its shared blocks (inside the last one). Block ids are a random permutation."""
    g = torch.Generator().manual_seed(seed)
    common = max(prefix_blocks)
    own_blocks = [-(-n // block_size) for n in own_lens]
    num_blocks = common + sum(own_blocks) + 2
    perm = torch.randperm(num_blocks, generator=g).to(torch.int32)
    cols = max(p + o for p, o in zip(prefix_blocks, own_blocks)) + 1
    tables = torch.full((len(own_lens), cols), PAD_BLOCK, dtype=torch.int32)
    lens, nxt = [], common
    for i, (p, own, ob) in enumerate(zip(prefix_blocks, own_lens, own_blocks)):
        tables[i, :p] = perm[:p]
        tables[i, p : p + ob] = perm[nxt : nxt + ob]
        nxt += ob
        shared_keys = p * block_size - (cuts[i] % block_size if own == 0 else 0)
        lens.append(max(shared_keys, 0) + own)
    pool = random_pool(num_blocks, 1, num_kv_heads, block_size, head_dim, dtype, generator=g)
    return pool[:, 0, 0], pool[:, 0, 1], tables, torch.tensor(lens, dtype=torch.int32)


def _check(k, v, tables, lens, group, dtype, seed, **options):
    q = (2 * torch.randn(len(lens), k.shape[1] * group, k.shape[3], generator=torch.Generator().manual_seed(seed)))
    q = q.to(dtype)
    out = poisoned(q.shape, dtype)
    paged_decode_attention(q, k, v, tables, lens, out=out, **options)
    want = ref.paged_decode_reference(q, k, v, tables, lens, **options)
    assert_matches_reference(out, want, "cpu")


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    data=st.data(),
    n_seqs=st.integers(2, 40),
    block_size=st.sampled_from([8, 16, 32]),
    group=st.sampled_from([1, 3, 4, 8, 16]),
    dtype=st.sampled_from(DTYPES),
    cap=st.sampled_from([None, 5.0]),
)
def test_property_shared_prefixes_match_reference(data, n_seqs, block_size, group, dtype, cap):
    chunk = cpu_attention.CHUNK
    shared = data.draw(st.sampled_from([chunk - 1, chunk, chunk + 1, 2 * chunk, 3 * chunk + 5, 1, 200]), "shared")
    blocks = -(-shared // block_size)
    prefix_blocks = data.draw(
        st.lists(st.sampled_from([blocks, blocks, blocks, max(blocks - 1, 0), 0]), min_size=n_seqs, max_size=n_seqs),
        "prefix_blocks",
    )
    own_lens = data.draw(
        st.lists(st.sampled_from([0, 1, 2, block_size - 1, block_size, 70, 150]), min_size=n_seqs, max_size=n_seqs),
        "own_lens",
    )
    cuts = data.draw(st.lists(st.integers(0, block_size - 1), min_size=n_seqs, max_size=n_seqs), "cuts")
    k, v, tables, lens = _shared_case(prefix_blocks, own_lens, block_size, cuts=cuts, seed=n_seqs, dtype=dtype)
    _check(k, v, tables, lens, group, dtype, seed=shared, logits_soft_cap=cap)


def test_decode_shares_the_common_keys_of_a_group_and_matches_reference():
    """64 sequences behind one 512-key prefix (the shape the engine's shared-prefix batches have),
    plus two sequences of their own: the pass covers exactly the 64 over the 512 keys."""
    n, bs = 64, 16
    own = [100 + 3 * i for i in range(n)] + [600, 0]
    for dtype in (torch.float32, torch.bfloat16):
        k, v, tables, lens = _shared_case([32] * n + [0, 3], own, bs, cuts=[0] * (n + 1) + [5], seed=1, dtype=dtype)
        shared = cpu_work.shared_prefixes(tables.numpy(), lens.numpy(), bs, 4, 2, True)
        assert sorted(shared.members.tolist()) == list(range(n))
        assert set(shared.items[:, 3].tolist()) == {512}
        assert shared.prefix_keys.tolist() == [512] * n + [0, 0]
        assert sorted(map(tuple, shared.items[:, 1:3].tolist())) == [(32, 0), (32, 0), (32, 1), (32, 1)]
        _check(k, v, tables, lens, 4, dtype, seed=1)


def test_a_member_sharing_less_splits_off_rather_than_shortening_the_run():
    """5 sequences share 6 blocks (96 keys), a sixth only 4 of them: the run of 5 saves 4 x 96 keys,
    a run of all 6 would save 5 x 64. With 5 blocks in common (5 x 80) the sixth joins."""
    tables = np.array([[1, 2, 3, 4, 5, 6, 10 + i] for i in range(5)] + [[1, 2, 3, 4, 8, 9, 20]], dtype=np.int32)
    shared = cpu_work.shared_prefixes(tables, np.full(6, 110, np.int32), 16, 4, 1, True)
    assert shared.prefix_keys.tolist() == [96] * 5 + [0]
    assert shared.items.tolist() == [[0, 5, 0, 96]]
    tables[5, 4] = 5
    joined = cpu_work.shared_prefixes(tables, np.full(6, 110, np.int32), 16, 4, 1, True)
    assert joined.prefix_keys.tolist() == [80] * 6


def test_shared_keys_stop_at_the_shortest_member_and_the_first_differing_block():
    tables = np.array([[7, 8, 9, 1], [7, 8, 9, 2], [7, 8, 5, 3], [4, 8, 9, 1]], dtype=np.int32)
    shared = cpu_work.shared_prefixes(tables, np.array([100, 70, 100, 64], np.int32), 32, 2, 1, True)
    assert shared.prefix_keys.tolist() == [64, 64, 64, 0]  # blocks 7, 8; the last one starts with 4
    assert shared.items.tolist() == [[0, 3, 0, 64]]
    pair = cpu_work.shared_prefixes(tables, np.array([100, 70, 0, 64], np.int32), 32, 2, 1, True)
    assert pair.prefix_keys.tolist() == [70, 70, 0, 0]  # blocks 7, 8, 9, but the second sequence ends at 70
    short = cpu_work.shared_prefixes(tables, np.array([40, 40, 40, 40], np.int32), 32, 2, 1, True)
    assert short.items.size == 0 and short.prefix_keys.size == 0  # under SHARED_MIN_KEYS: not worth a pass
    assert cpu_work.shared_prefixes(tables, np.array([100, 70, 100, 64], np.int32), 32, 2, 1, False).items.size == 0


def test_sliding_window_with_shared_blocks_matches_reference():
    """A window turns the shared pass off (keys before a window are never read); still correct."""
    k, v, tables, lens = _shared_case([8] * 6, [0, 1, 40, 90, 0, 17], 16, cuts=[3] * 6, seed=3, dtype=torch.float16)
    _check(k, v, tables, lens, 4, torch.float16, seed=3, sliding_window=50)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("keys", [64, 65, 127, 128, 129, 3 * 64 + 5])
def test_shared_lengths_around_chunk_boundaries(dtype, keys):
    """The shortest member ends inside the shared blocks, so the pass covers exactly ``keys`` keys:
    its last chunk partial or full; the others go on with own suffixes of 1 to 100 keys."""
    bs = 8 if keys % 2 else 16
    blocks = -(-keys // bs)
    own = [0, 1, 2, 17, 100]
    k, v, tables, lens = _shared_case([blocks] * 5, own, bs, cuts=[blocks * bs - keys] * 5, seed=keys, dtype=dtype)
    assert int(lens[0]) == keys
    shared = cpu_work.shared_prefixes(tables.numpy(), lens.numpy(), bs, 3, 2, True)
    assert shared.prefix_keys.tolist() == [keys] * 5
    _check(k, v, tables, lens, 3, dtype, seed=keys)


def test_fp8_cache_with_scales_and_a_shared_prefix():
    """k_scale folds into the shared pass's query scale and v_scale into the end: both paths agree."""
    fp8 = torch.float8_e4m3fn
    k, v, tables, lens = _shared_case([12] * 7, [0, 1, 5, 16, 33, 64, 90], 16, cuts=[7] * 7, seed=8, dtype=fp8)
    assert cpu_work.shared_prefixes(tables.numpy(), lens.numpy(), 16, 4, 2, True).items.size
    for q_dtype in (torch.bfloat16, torch.float32):
        q = torch.randn(7, 8, 64, generator=torch.Generator().manual_seed(8)).to(q_dtype)
        out = paged_decode_attention(q, k, v, tables, lens, k_scale=0.5, v_scale=2.0, out=poisoned(q.shape, q_dtype))
        want = ref.paged_decode_reference(q, k, v, tables, lens, k_scale=0.5, v_scale=2.0)
        assert_matches_reference(out, want, "cpu")
