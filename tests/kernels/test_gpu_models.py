"""GPU kernels on real batches and the models people run, against the float64 reference:
page-aware decode over skewed and spread mixes up to 128k tokens, page-aware prefill of a
chunk beside decodes, every head_dim, sliding windows, logit soft caps and float8 caches.
Run on the GPU machine:

    python3 -m pytest -q -m gpu tests/kernels/test_gpu_models.py
"""

import random

import pytest
import torch

from kvpool.kernels import paged_decode_attention, paged_prefill_attention, write_kv
from tests.kernels.support import reference as ref
from tests.kernels.support.testing import assert_matches_reference, make_case, poisoned

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
DEV = "cuda"
FP8 = torch.float8_e4m3fn


def _mix(kind: str, rng: random.Random, batch: int, longest: int) -> list[int]:
    if kind == "skewed":  # a few long among many short
        lens = [longest] * max(1, batch // 32) + [rng.randint(1, 300) for _ in range(batch - max(1, batch // 32))]
    else:  # spread over two orders of magnitude
        lens = [int(longest / 100 * (100 ** rng.random())) for _ in range(batch)]
    rng.shuffle(lens)
    return lens


def _decode(lens, *, d=128, dtype=torch.bfloat16, hkv=2, group=4, seed=0, **options):
    case = make_case(lens, num_kv_heads=hkv, block_size=16, head_dim=d, dtype=dtype, num_layers=1, device=DEV, seed=seed)
    qdtype = torch.bfloat16 if dtype == FP8 else dtype
    q = torch.randn(len(lens), hkv * group, d, device=DEV).to(qdtype)
    out = poisoned(q.shape, q.dtype, DEV)
    paged_decode_attention(q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens, out=out, **options)
    want = ref.paged_decode_reference(q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens, **options)
    assert_matches_reference(out, want, "cuda")


@pytest.mark.parametrize(
    "kind, batch, longest",
    [("skewed", 2, 131072), ("skewed", 64, 32768), ("skewed", 256, 8192), ("spread", 16, 65536), ("spread", 128, 8192)],
)
def test_gpu_page_aware_decode_on_mixed_batches(kind, batch, longest):
    _decode(_mix(kind, random.Random(batch), batch, longest), seed=batch)


@pytest.mark.parametrize(
    "d, dtype",
    [(64, torch.float16), (80, torch.bfloat16), (96, torch.bfloat16), (96, torch.float16), (96, torch.float32),
     (112, torch.float16), (192, torch.bfloat16), (256, torch.bfloat16)],
)  # fmt: skip
def test_gpu_head_dims_decode_and_prefill(d, dtype):
    lens = [0, 1, 17, 900, 3000]
    _decode(lens, d=d, dtype=dtype, seed=d)
    case = make_case(lens, num_kv_heads=2, block_size=16, head_dim=d, dtype=dtype, num_layers=1, device=DEV, seed=1)
    q_lens = [0, 1, 17, 200, 700]
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device=DEV)
    q = torch.randn(int(cu[-1]), 8, d, device=DEV).to(dtype)
    out = paged_prefill_attention(q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens, cu)
    want = ref.paged_prefill_reference(q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens, cu)
    assert_matches_reference(out, want, "cuda")


@pytest.mark.parametrize("window, cap", [(4096, None), (1, None), (512, 50.0), (None, 30.0)])
def test_gpu_window_and_soft_cap(window, cap):
    lens = _mix("skewed", random.Random(7), 40, 20000)
    _decode(lens, sliding_window=window, logits_soft_cap=cap, seed=3)
    case = make_case([300, 5000], num_kv_heads=2, block_size=16, head_dim=128, dtype=torch.bfloat16, num_layers=1, device=DEV)
    cu = torch.tensor([0, 300, 1324], dtype=torch.int32, device=DEV)
    q = (3 * torch.randn(1324, 8, 128, device=DEV)).to(torch.bfloat16)
    opts = dict(sliding_window=window, logits_soft_cap=cap)
    out = paged_prefill_attention(q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens, cu, **opts)
    want = ref.paged_prefill_reference(q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens, cu, **opts)
    assert_matches_reference(out, want, "cuda")


@pytest.mark.parametrize("d", [64, 128, 192])
def test_gpu_float8_cache_write_then_attend(d):
    """write_kv quantizes into a float8 pool; decode and prefill read it back dequantized."""
    lens = [1, 40, 3000]
    case = make_case(lens, num_kv_heads=2, block_size=16, head_dim=d, dtype=FP8, num_layers=1, device=DEV, seed=d)
    scales = dict(k_scale=0.25, v_scale=2.0)
    # overwrite the last 40 tokens of the long sequence through write_kv
    pos = torch.arange(2960, 3000, device=DEV)
    slots = (case.block_tables[2, pos // 16].long() * 16 + pos % 16).contiguous()
    key = torch.randn(40, 2, d, device=DEV, dtype=torch.bfloat16)
    value = torch.randn(40, 2, d, device=DEV, dtype=torch.bfloat16)
    write_kv(key, value, case.k_cache, case.v_cache, slots, **scales)
    got_k = ref.gather_sequence(case.k_cache, case.block_tables[2], 3000)[2960:]
    assert (abs(got_k * 0.25 - key.double().cpu().numpy()) <= 0.07 * abs(key.double().cpu().numpy()) + 1e-3).all()
    q = torch.randn(3, 8, d, device=DEV).to(torch.bfloat16)
    out = paged_decode_attention(q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens, **scales)
    want = ref.paged_decode_reference(q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens, **scales)
    assert_matches_reference(out, want, "cuda")


def test_gpu_page_aware_decode_replays_in_a_graph_with_new_lengths():
    """The work division is made on the device: a captured step replayed with a different mix
    (the long sequence moves) stays right."""
    lens = [8000, 5, 5, 300]
    case = make_case(lens, num_kv_heads=2, block_size=16, head_dim=128, dtype=torch.bfloat16, device=DEV, extra_cols=800)
    q = torch.randn(4, 8, 128, device=DEV).to(torch.bfloat16)
    out = torch.empty_like(q)
    args = (q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens)
    paged_decode_attention(*args, out=out)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        paged_decode_attention(*args, out=out)
    for new in ([8000, 5, 5, 300], [1, 8000, 2, 5], [16, 16, 16, 16], [0, 0, 0, 8000]):
        case.seq_lens.copy_(torch.tensor(new, dtype=torch.int32))
        # the tables' blocks past the first sequence's end are real blocks of the pool
        for b, n in enumerate(new):
            case.block_tables[b, : -(-n // 16)] = torch.randperm(case.kv_cache.shape[0], device=DEV)[: -(-n // 16)].int()
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        want = ref.paged_decode_reference(q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens)
        assert_matches_reference(out, want, "cuda")


def _prefill(lens, q_lens, *, dtype=torch.bfloat16, seed=0, **options):
    case = make_case(lens, num_kv_heads=2, block_size=16, head_dim=128, dtype=dtype, num_layers=1, device=DEV, seed=seed)
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device=DEV)
    q = (2 * torch.randn(int(cu[-1]), 8, 128, device=DEV)).to(torch.bfloat16)
    out = poisoned(q.shape, q.dtype, DEV)
    paged_prefill_attention(q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens, cu, out=out, **options)
    want = ref.paged_prefill_reference(q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens, cu, **options)
    assert_matches_reference(out, want, "cuda")


@pytest.mark.parametrize(
    "dtype, opts",
    [(torch.bfloat16, dict(logits_soft_cap=30.0)), (torch.bfloat16, dict(sliding_window=700)),
     (FP8, dict(k_scale=0.5, v_scale=2.0))],
)  # fmt: skip
def test_gpu_page_aware_prefill_of_a_chunk_beside_decodes(dtype, opts):
    """Chunked prefill on the split-KV kernel: a chunk of a long prompt among one-token decodes,
    few tiles (split by their keys) and many (one item each)."""
    rng = random.Random(11)
    for chunk, decodes in ((96, 12), (500, 60)):
        lens = [20000, *[rng.randint(1, 9000) for _ in range(decodes)]]
        _prefill(lens, [chunk, *[1] * decodes], dtype=dtype, seed=chunk, **opts)


def test_gpu_page_aware_prefill_replays_in_a_graph_with_new_lengths():
    """A captured chunked-prefill step replayed with other query and key lengths (the same token
    count) stays right: the division is made on the device."""
    lens, q_lens = [9000, 40, 300, 7], [64, 1, 1, 1]
    case = make_case(lens, num_kv_heads=2, block_size=16, head_dim=128, dtype=torch.bfloat16, device=DEV, extra_cols=600)
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device=DEV)
    q = torch.randn(int(cu[-1]), 8, 128, device=DEV).to(torch.bfloat16)
    out = torch.empty_like(q)
    opts = dict(logits_soft_cap=40.0)
    args = (q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens, cu)
    paged_prefill_attention(*args, out=out, **opts)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        paged_prefill_attention(*args, out=out, **opts)
    for new_lens, new_q in (([9000, 40, 300, 7], [64, 1, 1, 1]), ([30, 9000, 2, 64], [1, 1, 2, 63]),
                            ([67, 67, 67, 67], [64, 1, 1, 1]), ([1, 1, 1, 9000], [1, 1, 1, 64])):  # fmt: skip
        case.seq_lens.copy_(torch.tensor(new_lens, dtype=torch.int32))
        cu.copy_(torch.tensor([0, *torch.tensor(new_q).cumsum(0).tolist()], dtype=torch.int32))
        for b, n in enumerate(new_lens):
            case.block_tables[b, : -(-n // 16)] = torch.randperm(case.kv_cache.shape[0], device=DEV)[: -(-n // 16)].int()
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        want = ref.paged_prefill_reference(q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens, cu, **opts)
        assert_matches_reference(out, want, "cuda")
