"""The float64 reference itself, against an independent formulation (torch SDPA in float64)."""

import numpy as np
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


def test_reference_window_soft_cap_and_scales_match_torch():
    """Window as transformers' sliding-window mask (kv_idx > q_idx - window, kv_idx <= q_idx),
    soft cap and scales on the dequantized fp8 cache, written out in torch float64."""
    lens, q_lens, window, cap, k_scale, v_scale = [40, 9], [13, 9], 6, 3.0, 0.3, 1.9
    case = make_case(lens, num_kv_heads=2, block_size=8, head_dim=64, dtype=torch.float8_e4m3fn, seed=7)
    cu = torch.tensor([0, 13, 22], dtype=torch.int32)
    q = torch.randn(22, 4, 64, dtype=torch.float64)
    got = ref.paged_prefill_reference(q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens, cu, 0.2,
                                      sliding_window=window, logits_soft_cap=cap, k_scale=k_scale, v_scale=v_scale)  # fmt: skip
    for b, (n, q_len) in enumerate(zip(lens, q_lens)):
        blocks = case.block_tables[b].long()[torch.arange(n) // 8]
        k = case.k_cache[blocks, :, torch.arange(n) % 8].double() * k_scale  # torch's own fp8 -> float64
        v = case.v_cache[blocks, :, torch.arange(n) % 8].double() * v_scale
        k, v = k.repeat_interleave(2, dim=1).transpose(0, 1), v.repeat_interleave(2, dim=1).transpose(0, 1)
        s = q[cu[b] : cu[b + 1]].transpose(0, 1) @ k.transpose(1, 2) * 0.2
        s = cap * torch.tanh(s / cap)
        q_idx, kv_idx = torch.arange(n - q_len, n)[:, None], torch.arange(n)[None, :]
        s = s.masked_fill(~((kv_idx > q_idx - window) & (kv_idx <= q_idx)), float("-inf"))
        want = (torch.softmax(s, dim=-1) @ v).transpose(0, 1)
        assert torch.allclose(torch.from_numpy(got[cu[b] : cu[b + 1]]), want, atol=1e-12)


def test_fp8_decode_is_exact_for_every_code():
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    got = ref.fp8_e4m3_decode(codes.numpy())
    want = codes.view(torch.float8_e4m3fn).double().numpy()
    assert ((got == want) | (np.isnan(got) & np.isnan(want))).all()
    assert np.isnan(got[[0x7F, 0xFF]]).all() and got[0x7E] == 448 and got[1] == 2.0**-9
