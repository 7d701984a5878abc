"""The float64 reference itself, against an independent formulation (torch SDPA in float64)."""

import torch

from tests.kernels.support import reference as ref
from tests.kernels.support.testing import make_case


def _sdpa_one(q, k, v, scale, pos):
    """Plain causal attention for one sequence: q [n_q, Hq, D], k/v [n, Hkv, D]."""
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1).transpose(0, 1)  # [Hq, n, D]
    v = v.repeat_interleave(group, dim=1).transpose(0, 1)
    mask = torch.arange(k.shape[1])[None, :] <= pos[:, None]
    o = torch.nn.functional.scaled_dot_product_attention(q.transpose(0, 1), k, v, attn_mask=mask, scale=scale)
    return o.transpose(0, 1)


def test_prefill_reference_matches_sdpa():
    case = make_case([20, 33, 7], num_kv_heads=2, block_size=8, head_dim=64, seed=5)
    q_lens = [20, 4, 1]
    cu = torch.tensor([0, 20, 24, 25], dtype=torch.int32)
    q = torch.randn(25, 6, 64, dtype=torch.float64)
    got = torch.from_numpy(ref.paged_prefill_reference(q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens, cu, 0.2))
    for b, (n, q_len) in enumerate(zip([20, 33, 7], q_lens)):
        k = torch.from_numpy(ref.gather_sequence(case.k_cache, case.block_tables[b], n))
        v = torch.from_numpy(ref.gather_sequence(case.v_cache, case.block_tables[b], n))
        pos = torch.arange(n - q_len, n)
        want = _sdpa_one(q[cu[b] : cu[b + 1]], k, v, 0.2, pos)
        assert torch.allclose(got[cu[b] : cu[b + 1]], want, atol=1e-12)


def test_gather_follows_the_block_table():
    case = make_case([21], num_kv_heads=1, block_size=8, head_dim=64, seed=2)
    seq = ref.gather_sequence(case.k_cache, case.block_tables[0], 21)
    blk = int(case.block_tables[0, 2])
    assert torch.equal(torch.from_numpy(seq[16:21, 0]), case.k_cache[blk, 0, :5].double())


def test_decode_reference_empty_sequence_is_zero():
    case = make_case([0, 3], num_kv_heads=1, block_size=8, head_dim=64)
    q = torch.randn(2, 1, 64)
    out = ref.paged_decode_reference(q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens)
    assert (out[0] == 0).all() and (out[1] != 0).any()
