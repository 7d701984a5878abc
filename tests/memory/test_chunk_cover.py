"""The client's test of whether a block's memory is mapped (``kvpool.ipc.vmm.chunks_cover``): no GPU needed."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings, strategies as st

from kvpool.ipc.vmm import chunks_cover


@settings(max_examples=300, deadline=None)
@given(chunk_bytes=st.sampled_from([64, 256]), block_bytes=st.integers(16, 700),
       mapped=st.lists(st.booleans(), min_size=1, max_size=40), data=st.data())
def test_a_block_is_covered_when_every_byte_of_it_is_mapped(chunk_bytes, block_bytes, mapped, data):
    """Against byte by byte: blocks smaller than a chunk, straddling two, and spanning several."""
    chunk_of = np.array([i + 1 if m else 0 for i, m in enumerate(mapped)], np.int64)
    limit = len(mapped) * chunk_bytes // block_bytes + 1
    blocks = data.draw(st.lists(st.integers(0, limit), max_size=6))
    byte_mapped = lambda byte: byte // chunk_bytes < len(mapped) and mapped[byte // chunk_bytes]  # noqa: E731
    expected = all(byte_mapped(x) for b in blocks for x in range(b * block_bytes, (b + 1) * block_bytes))
    assert chunks_cover(chunk_of, blocks, block_bytes, chunk_bytes) == expected


def test_a_hole_in_the_middle_of_a_large_block_is_seen():
    chunk_of = np.array([5, 0, 7, 9], np.int64)  # one block of three chunks: places 0..2
    assert not chunks_cover(chunk_of, [0], 3 * 64, 64)
    chunk_of[1] = 6
    assert chunks_cover(chunk_of, [0], 3 * 64, 64)
