"""The batch builder (kvpool.batch) that Client.slot_mapping, PagedModel and the engine's StepRunner share."""

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from kvpool.batch import host_arrays, pack, slot_mapping


@st.composite
def batches(draw):
    """Sequences with distinct random blocks, each computing a run of tokens that ends it."""
    block_size = draw(st.sampled_from([1, 4, 16]))
    free = np.random.default_rng(draw(st.integers(0, 2**32 - 1))).permutation(1000).tolist()
    seqs = []
    for _ in range(draw(st.integers(1, 6))):
        length = draw(st.integers(1, 70))
        start = draw(st.integers(0, length - 1))
        write_from = draw(st.integers(start, length))
        blocks = [free.pop() for _ in range(-(-length // block_size))]
        tokens = draw(st.lists(st.integers(0, 2**31), min_size=length - start, max_size=length - start))
        seqs.append((blocks, start, tokens, write_from))
    return block_size, seqs


def pack_into(out, block_size, seqs):
    def fill_table(row, num_blocks):
        out["block_tables"][row, :num_blocks] = seqs[row][0][:num_blocks]

    return pack(out, [t for _, _, t, _ in seqs], [s for _, s, _, _ in seqs], [w for *_, w in seqs],
                block_size=block_size, fill_table=fill_table)


@settings(max_examples=60, deadline=None)
@given(earlier=batches(), batch=batches())
def test_pack_places_every_token_where_its_own_sequence_says(earlier, batch):
    """Checked token by token against positions and slots computed from each sequence alone, in arrays that
    held an earlier batch (the engine packs every step into the same buffers)."""
    block_size, seqs = batch
    total_tokens = sum(len(t) for _, _, t, _ in seqs)
    both = seqs + earlier[1]
    out = host_arrays(sum(len(t) for _, _, t, _ in both), len(both), max(len(b) for b, *_ in both))
    pack_into(out, earlier[0], earlier[1])

    total, lens = pack_into(out, block_size, seqs)
    assert total == total_tokens
    lo = 0
    for row, (blocks, start, toks, write_from) in enumerate(seqs):
        hi = lo + len(toks)
        positions = list(range(start, start + len(toks)))
        want = [blocks[p // block_size] * block_size + p % block_size if p >= write_from else -1 for p in positions]
        assert lens[row] == out["seq_lens"][row] == start + len(toks)
        assert (out["cu_seqlens_q"][row], out["cu_seqlens_q"][row + 1]) == (lo, hi)
        assert out["logits_index"][row] == hi - 1
        assert out["input_ids"][lo:hi].tolist() == toks
        assert out["positions"][lo:hi].tolist() == positions
        assert out["slot_mapping"][lo:hi].tolist() == want
        assert out["block_tables"][row, :len(blocks)].tolist() == blocks
        lo = hi


def test_the_arrays_have_the_dtypes_the_kernels_read():
    out = host_arrays(8, 3, 5)
    assert {name: str(a.dtype) for name, a in out.items()} == {
        "input_ids": "int64", "positions": "int64", "slot_mapping": "int64", "logits_index": "int64",
        "seq_lens": "int32", "cu_seqlens_q": "int32", "block_tables": "int32"}
    assert out["block_tables"].shape == (3, 5) and len(out["cu_seqlens_q"]) == 4


def test_a_single_sequence_slot_is_block_times_size_plus_offset():
    assert slot_mapping(np.array([5, 7, 9]), np.arange(3, 12), 4).tolist() == [23, 28, 29, 30, 31, 36, 37, 38, 39]


def test_a_batch_larger_than_the_arrays_is_refused():
    out = host_arrays(4, 2, 2)
    with pytest.raises(ValueError, match="5 tokens / 2 sequences exceeds the buffers"):
        pack(out, [[1, 2, 3], [4, 5]], [0, 0], [0, 0], block_size=4, fill_table=lambda row, n: None)
