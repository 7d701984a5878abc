"""A GPU probe for ``tests/kernels/test_gpu_holes.py``, run in a process of its own (a fault ends the process).

The attention kernels on a pool whose virtual range has unmapped chunks (what an elastic class's range looks like
after it gave chunks back), with every block-table column past a sequence's blocks naming a block there. A kernel
that forms an address from such a column faults, even if it would mask the data. Each call's result must equal
the float64 reference, computed on a CPU copy of the mapped chunks.

    python3 -m tests.kernels.support.holes_probe HEAD_DIM
"""

from __future__ import annotations

import random
import sys

import torch

from kvpool.ipc.cuda import DeviceBytes, torch_view
from kvpool.ipc.vmm import VirtualRange, allocation_prop, check, use_device
from kvpool.kernels import paged_decode_attention, paged_prefill_attention
from tests.kernels.support import reference as ref
from tests.kernels.support.testing import assert_matches_reference, mixed_batch, tables_with_stale_columns

CHUNK = 2 << 20
KV_HEADS, GROUP, BLOCK = 8, 4, 16  # Llama-3.2-1B's attention: 32 query heads over 8 KV heads


def blocks_per_chunk(head_dim: int) -> int:
    return CHUNK // (2 * KV_HEADS * BLOCK * head_dim * 2)  # K and V of one layer, bf16


def pool_with_holes(chunks: int, holes: set[int], head_dim: int):
    """A bf16 pool ``[blocks, 1, 2, KV_HEADS, BLOCK, head_dim]`` over a virtual range whose ``holes`` are unmapped;
    the range, which must live as long as the pool."""
    dev = torch.cuda.current_device()
    cu = use_device(dev)
    vrange = VirtualRange(dev, chunks * CHUNK, CHUNK)
    for i in range(chunks):
        if i not in holes:
            vrange.map(i, check(cu.cuMemCreate(CHUNK, allocation_prop(dev), 0), "cuMemCreate"))
    owner = DeviceBytes(vrange.base, vrange.nbytes, dev, lambda _ptr: None)
    shape = (chunks * blocks_per_chunk(head_dim), 1, 2, KV_HEADS, BLOCK, head_dim)
    return vrange, torch_view(owner, "bfloat16", shape, 0)


def cases(rng: random.Random) -> list[tuple[list[int], list[tuple[int, int]]]]:
    """(decode lengths, prefill chunks as (cached keys, new tokens)): the failing step's shape (13 decodes beside a
    chunk of a long prompt), a larger mix, decodes alone."""
    return [([rng.randint(100, 900) for _ in range(13)], [(0, 717)]),
            ([rng.randint(1, 600) for _ in range(20)], [(128, 300), (0, 500), (37, 90)]),
            ([rng.randint(1, 1000) for _ in range(48)], [])]


def main(head_dim: int) -> int:
    torch.zeros(1, device="cuda")  # torch's context first: the range is mapped in the same primary context
    rng = random.Random(head_dim)
    todo = cases(rng)
    most = max(sum(-(-n // BLOCK) for n in [*d, *(c + m for c, m in p)]) for d, p in todo)
    per_chunk = blocks_per_chunk(head_dim)
    chunks = 2 * (-(-most // per_chunk)) + 2
    holes = set(range(1, chunks, 2))  # every other chunk given back
    _vrange, pool = pool_with_holes(chunks, holes, head_dim)
    ids = torch.arange(chunks * per_chunk, dtype=torch.int32).view(chunks, per_chunk)
    is_hole = torch.tensor([c in holes for c in range(chunks)])
    mapped, given_back = ids[~is_hole].flatten(), ids[is_hole].flatten()
    g = torch.Generator().manual_seed(head_dim)
    host = torch.zeros(pool.shape, dtype=pool.dtype)
    for c in range(chunks):
        if c not in holes:
            rows = slice(c * per_chunk, (c + 1) * per_chunk)
            pool[rows].normal_()
            host[rows] = pool[rows].cpu()
    k, v, hk, hv = pool[:, 0, 0], pool[:, 0, 1], host[:, 0, 0], host[:, 0, 1]
    failures = 0
    for decodes, prefills in todo:
        q_lens, lens, cu = mixed_batch(decodes, prefills)
        tables = tables_with_stale_columns(lens, BLOCK, mapped[torch.randperm(len(mapped), generator=g)], given_back,
                                           4, g)
        q = torch.randn(sum(q_lens), KV_HEADS * GROUP, head_dim, generator=g).to(torch.bfloat16)
        if prefills:
            out = paged_prefill_attention(q.cuda(), k, v, tables.cuda(), lens.cuda(), cu.cuda())
        else:
            out = paged_decode_attention(q.cuda(), k, v, tables.cuda(), lens.cuda())
        torch.cuda.synchronize()  # a read of an unmapped place is reported here, and ends the process
        want = ref.paged_attention_reference(q, hk, hv, tables, lens, cu, None)
        what = f"{len(decodes)} decodes, prefill chunks {prefills}, head_dim {head_dim}"
        try:
            assert_matches_reference(out.cpu(), want, "cuda")
            print(f"ok: {what}", flush=True)
        except AssertionError as exc:
            failures += 1
            print(f"WRONG: {what}: {exc}", flush=True)
    return 1 if failures else 0  # the range goes with the process


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1])))
