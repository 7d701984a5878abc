"""Random paged-KV cases for the kernel tests and benchmarks.

Block tables are slices of a random permutation of the whole pool (never
``arange``), so a kernel that ignores the table, or mixes up block and
token indices, reads the wrong blocks and fails. Table padding is filled
with an invalid block id so that a kernel reading past a sequence's blocks
is caught too.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

PAD_BLOCK = 2**30  # never a valid block id


@dataclass
class PagedCase:
    kv_cache: torch.Tensor  # [num_blocks, num_layers, 2, Hkv, bs, D]
    layer: int
    block_tables: torch.Tensor  # int32 [B, max_blocks]
    seq_lens: torch.Tensor  # int32 [B]

    @property
    def k_cache(self) -> torch.Tensor:
        return self.kv_cache[:, self.layer, 0]

    @property
    def v_cache(self) -> torch.Tensor:
        return self.kv_cache[:, self.layer, 1]


def random_pool(num_blocks, num_layers, num_kv_heads, block_size, head_dim, dtype, device="cpu", generator=None):
    """A pool of standard-normal K/V in the kvpool layout."""
    shape = (num_blocks, num_layers, 2, num_kv_heads, block_size, head_dim)
    x = torch.randn(shape, generator=generator, dtype=torch.float32)
    return x.to(dtype=dtype, device=device)


def random_block_tables(seq_lens, block_size, num_blocks, *, extra_cols=0, generator=None, device="cpu"):
    """Disjoint random blocks for each sequence; padding = ``PAD_BLOCK``."""
    need = [-(-int(n) // block_size) for n in seq_lens]
    if sum(need) > num_blocks:
        raise ValueError(f"{sum(need)} blocks needed, pool has {num_blocks}")
    perm = torch.randperm(num_blocks, generator=generator)
    cols = max(max(need, default=0), 1) + extra_cols
    table = torch.full((len(need), cols), PAD_BLOCK, dtype=torch.int32)
    start = 0
    for b, n in enumerate(need):
        table[b, :n] = perm[start : start + n].to(torch.int32)
        start += n
    return table.to(device)


def make_case(
    seq_lens,
    *,
    num_kv_heads=2,
    block_size=16,
    head_dim=64,
    dtype=torch.float32,
    num_layers=2,
    spare_blocks=3,
    extra_cols=1,
    device="cpu",
    seed=0,
) -> PagedCase:
    """A pool just big enough for ``seq_lens`` (plus spares) and its block tables."""
    g = torch.Generator().manual_seed(seed)
    need = sum(-(-int(n) // block_size) for n in seq_lens)
    num_blocks = need + spare_blocks
    pool = random_pool(num_blocks, num_layers, num_kv_heads, block_size, head_dim, dtype, device, g)
    tables = random_block_tables(seq_lens, block_size, num_blocks, extra_cols=extra_cols, generator=g, device=device)
    lens = torch.tensor([int(n) for n in seq_lens], dtype=torch.int32, device=device)
    layer = int(torch.randint(num_layers, (1,), generator=g))
    return PagedCase(pool, layer, tables, lens)


def mixed_batch(decodes, chunks) -> tuple[list[int], torch.Tensor, torch.Tensor]:
    """Decode rows (one query each, ``decodes`` their lengths) then prefill chunks ``(cached keys, new tokens)``:
    the query lengths, ``seq_lens`` and ``cu_seqlens_q`` of one call."""
    q_lens = [1] * len(decodes) + [n for _, n in chunks]
    seq_lens = torch.tensor([*decodes, *(c + n for c, n in chunks)], dtype=torch.int32)
    return q_lens, seq_lens, torch.tensor([0, *itertools.accumulate(q_lens)], dtype=torch.int32)


def tables_with_stale_columns(seq_lens, block_size: int, blocks: torch.Tensor, stale: torch.Tensor, extra_cols: int,
                              generator: torch.Generator) -> torch.Tensor:
    """Block tables whose rows take their blocks in order from ``blocks``, every column past a row's blocks naming a
    random one of ``stale``: what a reused row holds there (its last owner's blocks)."""
    need = [-(-int(n) // block_size) for n in seq_lens]
    tables = stale[torch.randint(len(stale), (len(need), max(need) + extra_cols), generator=generator)]
    tables = tables.to(torch.int32)
    start = 0
    for b, n in enumerate(need):
        tables[b, :n] = blocks[start:start + n]
        start += n
    return tables


def poisoned(shape, dtype, device="cpu") -> torch.Tensor:
    """An output buffer full of NaN: any element a kernel forgets to write shows up."""
    return torch.full(shape, float("nan"), dtype=dtype, device=device)


# |out - ref| <= tol * (1 + |ref|), per output dtype and backend. The CPU kernels
# compute in float32 from exactly converted inputs, so the output rounding
# dominates; the GPU kernel also rounds the probabilities to the 16-bit MMA type
# (float32 caches: a bfloat16 hi/lo split, about 16 mantissa bits).
TOLERANCE = {
    ("cpu", torch.float32): 2e-5,
    ("cpu", torch.float16): 2e-3,
    ("cpu", torch.bfloat16): 1.6e-2,
    ("cuda", torch.float32): 2e-4,
    ("cuda", torch.float16): 4e-3,
    ("cuda", torch.bfloat16): 2.5e-2,
}


def assert_matches_reference(out: torch.Tensor, ref, backend: str) -> None:
    """Fail with the worst element's position when ``out`` is off the float64 reference."""
    tol = TOLERANCE[(backend, out.dtype)]
    got = out.detach().cpu().double()
    want = torch.as_tensor(ref, dtype=torch.float64)
    if got.shape != want.shape:
        raise AssertionError(f"shape {tuple(got.shape)} != reference {tuple(want.shape)}")
    bad = ~((got - want).abs() <= tol * (1 + want.abs()))  # NaN counts as bad
    if bad.any():
        idx = tuple(int(i) for i in bad.nonzero()[0])
        err = (got - want).abs().nan_to_num(float("inf")).max().item()
        raise AssertionError(
            f"{int(bad.sum())} of {bad.numel()} elements off (tol {tol}, max err {err:.3g}); "
            f"first at {idx}: got {got[idx].item()!r}, want {want[idx].item()!r}"
        )
