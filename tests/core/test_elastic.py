"""The elastic pool: slab byte ranges, exact slabs, the limit, resize, release_idle and their figures."""

import mmap
import os

import pytest

from kvpoold.core import (
    ChunkBudget, Geometry, InvalidArgument, KVCacheManager, LayoutDoesNotFit, OutOfBlocks, ResizeResult, Tier,
)
from kvpoold.core.block_pool import choose_slab_chunks

from helpers import snapshot

PAGE = mmap.PAGESIZE
# 10752-byte blocks on page-sized chunks: 8-chunk slabs of 3 blocks, 512 bytes of each slab unused
# (the shape of 5.25 MiB blocks on 2 MiB chunks)
ODD = Geometry(num_layers=21, num_kv_heads=1, head_dim=128, dtype="float16", block_size=1)
G = Geometry(num_layers=1, num_kv_heads=1, head_dim=8, dtype="float16", block_size=4)  # 128 B, 4 per 512 B chunk


def odd_pool(**kw):
    m = KVCacheManager(16 * PAGE, chunk_bytes=PAGE, **kw)
    return m, m.register_class(ODD)


def apply_slab_changes(m, arenas):
    """What ``DevicePool.sync_memory`` does with the slab changes."""
    for kind, cls, offset, nbytes in m.drain_slab_changes():
        if kind == "take":
            arenas[cls].commit(offset, nbytes)
        else:
            arenas[cls].release(offset, nbytes)


# -- a slab's memory range -------------------------------------------------------------
def test_slab_ranges_are_the_blocks_bytes_inside_the_id_space():
    m, c = odd_pool()
    pool = m.classes[c]
    assert (pool.slab_chunks, pool.blocks_per_slab) == (8, 3) and pool.slab_bytes > pool.span == 3 * 10752
    a = m.create(1, c, "m", range(6))  # both slabs
    taken = m.drain_slab_changes()
    m.free(1, [a.seq_id], written=False)
    m.release_idle(0.0, 0)
    released = m.drain_slab_changes()
    for changes in (taken, released):
        ranges = sorted((off, off + n) for _, _, off, n in changes)
        assert len(ranges) == 2
        assert all(end <= start for (_, end), (start, _) in zip(ranges, ranges[1:])), "slabs overlap"
        assert ranges[-1][1] <= pool.num_block_ids * pool.block_bytes, "a slab runs past the id space"
        assert ranges == [(s * pool.span, (s + 1) * pool.span) for s in range(2)]


needs_shm = pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="needs /dev/shm (Linux)")


def shm_arena(pool):
    from kvpoold.memory.cpu_shm import CpuShmArena

    return CpuShmArena("slabs", pool.num_block_ids * pool.block_bytes)


@needs_shm
def test_releasing_a_slab_keeps_the_next_slabs_bytes():
    m, c = odd_pool(max_pool_bytes=24 * PAGE)  # room for a third slab: the second is not the arena's last
    pool = m.classes[c]
    arena = shm_arena(pool)
    try:
        data = arena.as_tensor("uint8", (pool.num_block_ids, pool.block_bytes)).numpy()
        first = m.create(1, c, "m", range(3))  # slab 0
        second = m.create(1, c, "m", range(100, 103))  # slab 1
        apply_slab_changes(m, {c: arena})
        assert {b // 3 for b in first.block_table} == {0} and {b // 3 for b in second.block_table} == {1}
        for i, b in enumerate(first.block_table + second.block_table):
            data[b] = i + 1
        m.free(1, [first.seq_id], written=False)
        assert m.release_idle(0.0, 0) == 8
        apply_slab_changes(m, {c: arena})
        for i, b in enumerate(second.block_table, start=4):
            assert (data[b] == i).all(), f"block {b} of the next slab lost its bytes"
    finally:
        del data
        arena.close()


@needs_shm
def test_the_last_slab_fits_its_arena():
    m, c = odd_pool()
    arena = shm_arena(m.classes[c])
    try:
        a = m.create(1, c, "m", range(6))  # both slabs
        apply_slab_changes(m, {c: arena})
        m.free(1, [a.seq_id], written=False)
        assert m.release_idle(0.0, 0) == 16
        apply_slab_changes(m, {c: arena})
    finally:
        arena.close()


def test_a_slab_taken_and_given_back_between_drains_is_not_reported():
    m = KVCacheManager(8 * 512, chunk_bytes=512)
    c = m.register_class(G)
    a = m.create(1, c, "a", range(4))  # takes SLABS_AHEAD slabs ...
    m.free(1, [a.seq_id], written=False)
    assert m.release_idle(0.0, 0) == 8  # ... and gives them back: nothing to map
    assert m.drain_slab_changes() == []
    b = m.create(1, c, "b", range(4))
    assert [k for k, *_ in m.drain_slab_changes()] == ["take"] * 8
    m.free(1, [b.seq_id], written=False)
    m.release_idle(0.0, 0)  # given back ...
    m.create(1, c, "c", range(4))  # ... and taken again: still mapped, nothing to do
    assert m.drain_slab_changes() == []


# -- exact slabs -----------------------------------------------------------------------
def test_exact_slabs_hold_whole_blocks_at_chunk_boundaries():
    m, c = odd_pool(max_pool_bytes=128 * PAGE, exact_slabs=True)
    pool = m.classes[c]
    # 10752 = 2^9 * 21: 21 pages hold 8 blocks exactly
    assert pool.slab_chunks == 21 and pool.slab_bytes == pool.span == 8 * pool.block_bytes
    m.resize(64 * PAGE)
    m.create(1, c, "m", range(20))
    for _, _, off, n in m.drain_slab_changes():
        assert off % PAGE == 0 and n == 21 * PAGE
    m.check_invariants()


def test_exact_slabs_change_nothing_when_blocks_divide_chunks():
    plain = KVCacheManager(8 * 512, chunk_bytes=512)
    exact = KVCacheManager(8 * 512, chunk_bytes=512, exact_slabs=True)
    a, b = plain.classes[plain.register_class(G)], exact.classes[exact.register_class(G)]
    assert (a.slab_chunks, a.blocks_per_slab) == (b.slab_chunks, b.blocks_per_slab) == (1, 4)


def test_exact_slab_larger_than_the_limit_does_not_fit():
    m = KVCacheManager(16 * PAGE, chunk_bytes=PAGE, exact_slabs=True)
    with pytest.raises(LayoutDoesNotFit, match=r"block of 10752 bytes needs slabs of 21 chunks \(86016 bytes\)"):
        m.register_class(ODD)
    assert choose_slab_chunks(3 << 20, 2 << 20, 100, exact=True) == 3
    assert choose_slab_chunks(5 << 20, 2 << 20, 100, exact=True) == 5


def test_default_slab_choice_is_unchanged():
    m, c = odd_pool()
    assert m.classes[c].slab_chunks == choose_slab_chunks(10752, PAGE, 16) == 8


# -- the limit ---------------------------------------------------------------------------
def test_id_space_is_sized_for_the_limit():
    m = KVCacheManager(4 * 512, chunk_bytes=512, max_pool_bytes=16 * 512)
    pool = m.classes[m.register_class(G)]
    assert pool.max_slabs == 16 and pool.num_block_ids == 64 and m.budget.total == 4
    st = m.stats()
    assert st.pool_bytes == 4 * 512 and st.max_pool_bytes == 16 * 512
    with pytest.raises(InvalidArgument, match="max_pool_bytes"):
        KVCacheManager(4 * 512, chunk_bytes=512, max_pool_bytes=2 * 512)
    assert KVCacheManager(4 * 512, chunk_bytes=512).stats().max_pool_bytes == 4 * 512


def test_a_class_whose_slab_needs_growth_registers_but_owns_nothing():
    m = KVCacheManager(4 * 512, chunk_bytes=512, max_pool_bytes=16 * 512)
    big = m.register_class(Geometry(8, 1, 8, "float16", 4))  # 1 KiB blocks
    m.resize(512)
    assert m.register_class(Geometry(4, 1, 8, "float16", 4)) == big + 1  # one 512 B block a slab fits the limit
    with pytest.raises(LayoutDoesNotFit):
        m.register_class(Geometry(128, 1, 8, "float16", 4))  # 32 KiB: past the limit
    m.check_invariants()


# -- resize --------------------------------------------------------------------------------
def elastic(chunks=8, limit=16, **kw):
    m = KVCacheManager(chunks * 512, chunk_bytes=512, max_pool_bytes=limit * 512, **kw)
    return m, m.register_class(G)


def test_grow_up_to_the_limit_keeps_block_ids():
    m, c = elastic()
    a = m.create(1, c, "m", range(4 * 4 * 8))  # the whole pool
    r = m.resize(16 * 512)
    assert r == ResizeResult(16 * 512, 16 * 512, 0, 0, True)
    b = m.create(1, c, "m", range(100, 100 + 4 * 4 * 8))
    assert set(b.block_table).isdisjoint(a.block_table) and max(b.block_table) < m.classes[c].num_block_ids
    assert m.sequence(1, a.seq_id).block_table == a.block_table
    m.check_invariants()


def test_grow_past_the_limit_or_bad_sizes_change_nothing():
    m, c = elastic()
    m.create(1, c, "m", range(10))
    before = snapshot(m), m.budget.total
    for bad in (17 * 512, -1, 3.0, True, None):
        with pytest.raises(InvalidArgument, match="limit of 8192 bytes" if bad == 17 * 512 else "pool_bytes"):
            m.resize(bad)
        assert (snapshot(m), m.budget.total) == before


def test_shrink_takes_unassigned_chunks_then_empty_slabs_then_cached_ones():
    m, c = elastic(host_bytes=8 * 128)
    pool = m.classes[c]
    held = m.create(1, c, "m", range(16))  # slab 0 held; 7 more slabs taken ahead
    cached = m.create(1, c, "m", range(100, 116))  # slab 1: its blocks cached once freed
    m.free(1, [cached.seq_id])
    m.drain_slab_changes()
    assert m.budget.free == 0 and len(pool.slots) == 8
    r = m.resize(4 * 512)  # four of the six empty slabs
    assert r == ResizeResult(4 * 512, 4 * 512, 4, 0, True)
    assert [k for k, *_ in m.drain_slab_changes()] == ["release"] * 4
    r = m.resize(1 * 512)  # two empty slabs, then the cached one
    assert r == ResizeResult(512, 512, 3, 4, True)
    moves = m.drain_moves()  # the evicted blocks are demoted, as evictions always are
    assert {(mv.src, mv.dst, mv.block) for mv in moves} == {(Tier.DEVICE, Tier.HOST, b) for b in cached.block_table}
    assert pool.slots == {0} and m.budget.total == 1 and m.budget.free == 0
    assert m.sequence(1, held.seq_id) == held
    m.check_invariants()


def test_shrink_never_takes_held_blocks_and_says_so():
    m, c = elastic(chunks=4)
    a = m.create(1, c, "m", range(4 * 4 * 3))  # three slabs held
    m.grant_reserve(1, c, 4)  # the fourth, reserved
    before = m.sequence(1, a.seq_id)
    r = m.resize(0)
    assert r == ResizeResult(0, 4 * 512, 0, 0, False)
    assert m.budget.total == 4 and m.sequence(1, a.seq_id) == before
    m.return_reserve(1, c)
    r = m.resize(512)
    assert r == ResizeResult(512, 3 * 512, 1, 0, False)
    assert m.stats().pool_bytes == 3 * 512
    m.check_invariants()


def test_shrink_to_zero_and_grow_back():
    m, c = elastic()
    a = m.create(1, c, "m", range(8))
    m.free(1, [a.seq_id], written=False)
    r = m.resize(0)
    assert r.met and r.pool_bytes == 0 and m.budget.free == 0
    with pytest.raises(OutOfBlocks):
        m.create(1, c, "m", range(4))
    m.resize(2 * 512)
    assert m.create(1, c, "m", range(8)).block_table == (0, 1)
    m.check_invariants()


# -- release_idle --------------------------------------------------------------------------
def test_release_idle_waits_for_slabs_to_stay_empty():
    m, c = elastic()
    pool = m.classes[c]
    a = m.create(1, c, "m", range(4))  # slab 0 held, 7 empty slabs taken ahead
    assert m.release_idle(100.0, 10) == 0  # first seen empty now
    assert m.release_idle(105.0, 10) == 0
    assert m.release_idle(110.0, 10) == 7
    assert pool.slots == {0} and m.budget.free == 7
    m.free(1, [a.seq_id], written=False)
    assert m.release_idle(111.0, 10) == 0
    b = m.create(1, c, "m", range(4))  # slab 0 in use at the next call: its clock starts over
    assert m.release_idle(118.0, 10) == 0
    m.free(1, [b.seq_id], written=False)
    assert m.release_idle(125.0, 10) == 0
    assert m.release_idle(135.0, 10) == 1
    assert m.budget.free == 8 and not pool.slots
    m.check_invariants()


def test_release_idle_keeps_cached_and_held_slabs_and_feeds_other_classes():
    m = KVCacheManager(4 * 512, chunk_bytes=512)
    a, b = m.register_class(G), m.register_class(Geometry(2, 1, 8, "float16", 4))
    s = m.create(1, a, "m", range(4 * 16))  # the whole pool, four slabs held
    m.free(1, [s.seq_id])  # all cached now
    assert m.release_idle(0.0, 0) == 0
    m.evict_cached(a, 4)  # slab 3 (freed tail first, so evicted first) is empty
    assert m.release_idle(1.0, 0) == 1
    assert m.classes[b].obtainable() >= 2
    m.create(2, b, "m", range(8))
    released = m.stats().classes[0]
    assert released.released_bytes == 512 and released.mapped_bytes == 3 * 512
    m.check_invariants()


def test_a_class_short_of_memory_takes_the_oldest_cached_slabs_whatever_their_class():
    """Not class order: a model that stopped for a while keeps what it cached last, others' older blocks go."""
    m = KVCacheManager(6 * 512, chunk_bytes=512)
    newer, older, taker = (m.register_class(Geometry(1, 1, 8, "float16", 4, model)) for model in ("n", "o", "t"))
    for cls in (older, newer):  # the older class caches first: two slabs of four 4-token blocks each
        s = m.create(1, cls, "m", range(cls * 1000, cls * 1000 + 32))
        m.free(1, [s.seq_id])
    assert [len(m.classes[c].cached) for c in (newer, older)] == [8, 8]
    m.create(2, taker, "m", range(5000, 5000 + 4 * 4 * 3))  # three slabs: two unassigned or empty, one cached
    assert len(m.classes[newer].cached) == 8 and len(m.classes[older].cached) == 4
    assert m.lookup(newer, "m", range(1000 * newer, 1000 * newer + 32)).device_tokens == 32
    m.check_invariants()


def test_release_idle_validates_its_clock():
    m, c = elastic()
    m.create(1, c, "m", range(4))
    before = snapshot(m), dict(m._elastic.empty_since)
    for now, after in ((float("nan"), 1), (1.0, -1), ("1", 0), (1.0, None), (True, 0)):
        with pytest.raises(InvalidArgument):
            m.release_idle(now, after)
        assert (snapshot(m), dict(m._elastic.empty_since)) == before


# -- figures --------------------------------------------------------------------------------
def test_mapped_released_and_taken_bytes():
    m, c = elastic()
    a = m.create(1, c, "m", range(4))
    st = m.stats().classes[0]
    assert st.mapped_bytes == 8 * 512 and st.released_bytes == 0 and st.taken_bytes == 8 * 512
    m.release_idle(0.0, 0)
    st = m.stats().classes[0]
    assert st.mapped_bytes == 512 and st.released_bytes == 7 * 512 and st.taken_bytes == 8 * 512
    m.free(1, [a.seq_id], written=False)
    m.resize(0)
    st = m.stats()
    assert st.classes[0].mapped_bytes == 0 and st.classes[0].released_bytes == 8 * 512
    assert st.pool_bytes == 0 and st.max_pool_bytes == 16 * 512
    m.resize(16 * 512)
    m.create(1, c, "m", range(4))  # given-back slots are taken again: counted again
    st = m.stats().classes[0]
    assert st.taken_bytes - st.released_bytes == st.mapped_bytes == 8 * 512


def test_a_slab_may_need_the_limit_but_never_more():
    assert choose_slab_chunks(5 << 20, 2 << 20, 2, limit_chunks=3) == 3
    with pytest.raises(LayoutDoesNotFit, match="only 6291456"):
        choose_slab_chunks(7 << 20, 2 << 20, 2, limit_chunks=3)
    with pytest.raises(ValueError, match="below the pool's size"):
        ChunkBudget(4, 512, limit=2)
