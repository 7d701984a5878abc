"""LayoutClass and ChunkBudget: exact behaviour of ids, holders, eviction and slabs."""

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvpoold.core import ChunkBudget, LayoutClass, Geometry, LayoutDoesNotFit, OutOfBlocks
from kvpoold.core.block_pool import choose_slab_chunks

from oracle import prefix_state, refcount

# 2 layers * 2 (k|v) * 1 head * 8 dim * 4 tokens * 2 bytes = 256-byte blocks
G = Geometry(num_layers=2, num_kv_heads=1, head_dim=8, dtype="float16", block_size=4)


def make(chunks=4, chunk_bytes=1024):
    budget = ChunkBudget(chunks, chunk_bytes)
    evicted = []
    pool = LayoutClass(0, G, budget, on_evict=lambda c, bs, hs: evicted.extend(zip(bs, hs)))
    return budget, pool, evicted


def test_geometry_sizes():
    assert G.block_bytes == 256
    assert G.block_shape == (2, 2, 1, 4, 8)
    assert Geometry(32, 8, 128, "bfloat16", 16).block_bytes == 2 << 20  # Llama-3-8B-like


def test_allocate_takes_lowest_ids_and_slabs_on_demand():
    budget, pool, _ = make()
    assert pool.blocks_per_slab == 4 and pool.slab_chunks == 1 and pool.num_block_ids == 16
    assert pool.total_blocks == 0
    assert pool.allocate(3) == [0, 1, 2]
    # slabs are taken a few at a time (SLABS_AHEAD), lowest slots first
    assert budget.free == 0 and pool.total_blocks == 16
    assert pool.allocate(3) == [3, 4, 5]  # crosses into the second slab
    pool.check()


def test_slabs_ahead_are_bounded_and_given_back_to_other_classes():
    budget = ChunkBudget(32, 1024)
    a = LayoutClass(0, G, budget)
    a.allocate(1)
    assert len(a.slots) == LayoutClass.SLABS_AHEAD and budget.free == 32 - LayoutClass.SLABS_AHEAD
    b = LayoutClass(1, G, budget)
    b.allocate(4 * 32 - 4)  # everything but one slab: a gives back its empty ones
    assert len(a.slots) == 1 and budget.free == 0
    a.check(), b.check()


def test_release_pushes_back_and_reuses_lifo():
    _, pool, _ = make()
    ids = pool.allocate(4)
    pool.release(ids[::-1])
    assert pool.held_blocks == 0 and len(pool.free) == pool.total_blocks
    assert pool.allocate(1) == [0]  # released tail first, so the head comes back first
    pool.check()


def test_shared_blocks_need_every_holder_released():
    _, pool, _ = make()
    ids = pool.allocate(2)
    pool.share(ids)
    assert refcount(pool, ids[0]) == 2 and pool.is_shared(ids[0])
    pool.release(ids)
    assert refcount(pool, ids[0]) == 1 and not pool.is_shared(ids[0])
    pool.release(ids)
    assert refcount(pool, ids[0]) == 0
    assert pool.check() == {}


def test_cached_blocks_evicted_in_release_order():
    _, pool, evicted = make(chunks=1)
    ids = pool.allocate(4)
    for i, b in enumerate(ids):
        assert pool.prefix.register(b, bytes([i]) * 16)
    pool.release([ids[3], ids[2]])  # a tail, freed tail first
    pool.release([ids[0]])
    assert list(pool.cached) == [ids[3], ids[2], ids[0]]
    assert pool.allocate(2) == [ids[3], ids[2]]  # evicted oldest first, handed out in that order
    assert evicted == [(ids[3], bytes([3]) * 16), (ids[2], bytes([2]) * 16)]
    assert pool.prefix.lookup(bytes([0]) * 16) == ids[0]
    assert pool.prefix.lookup(bytes([3]) * 16) is None
    pool.check()


def test_prefix_hit_revives_cached_and_shares_held():
    _, pool, _ = make()
    a, b = pool.allocate(2)
    pool.prefix.register(a, b"a" * 16)
    pool.release([a])
    pool.acquire_cached(a)  # cached -> held once
    assert refcount(pool, a) == 1 and a not in pool.cached
    pool.acquire_cached(a)  # held -> held twice
    assert refcount(pool, a) == 2
    pool.check()


def test_register_keeps_first_block_for_a_hash():
    _, pool, _ = make()
    a, b = pool.allocate(2)
    assert pool.prefix.register(a, b"h" * 16)
    assert not pool.prefix.register(b, b"h" * 16)
    assert pool.prefix.lookup(b"h" * 16) == a and not pool.prefix.is_hashed(b)


def test_memory_flows_between_classes_by_slab():
    budget = ChunkBudget(2, 1024)
    a = LayoutClass(0, G, budget)
    b = LayoutClass(1, Geometry(1, 1, 8, "float16", 4), budget)  # 128-byte blocks, 8 per slab
    ids = a.allocate(8)  # both chunks go to class a
    assert budget.free == 0 and b.obtainable() == 0
    a.release(ids[:4][::-1])  # slab 0 of class a becomes empty
    assert b.obtainable() == 8
    got = b.allocate(8)
    assert got == list(range(8)) and a.total_blocks == 4 and b.total_blocks == 8
    assert a.drain_slab_changes() == ([0, 1], [0]) and a.drain_slab_changes() == ([], [])
    a.check(), b.check()


def test_reclaim_evicts_other_class_cached_slab_last():
    budget = ChunkBudget(2, 1024)
    evicted = []
    a = LayoutClass(0, G, budget, on_evict=lambda c, bs, hs: evicted.extend((c, b) for b in bs))
    b = LayoutClass(1, G, budget)
    ids = a.allocate(8)
    for i, blk in enumerate(ids):
        a.prefix.register(blk, bytes([i]) * 16)
    a.release(ids[4:][::-1])  # slab 1 holds only cached blocks now
    assert b.obtainable() == 4
    assert b.allocate(4) == [0, 1, 2, 3]
    assert sorted(evicted) == [(0, 4), (0, 5), (0, 6), (0, 7)]
    assert a.total_blocks == 4 and len(a.cached) == 0
    a.check(), b.check()


@given(st.data())
def test_reclaim_takes_the_slabs_cached_longest_ago_whatever_their_class(data):
    budget = ChunkBudget(12, 1024)  # 4 blocks of 256 bytes per slab
    givers = [LayoutClass(i, G, budget) for i in range(2)]
    taker = LayoutClass(2, G, budget)
    names = itertools.count()
    for _ in range(data.draw(st.integers(1, 10))):  # the givers hold and cache blocks, in turns
        c = givers[data.draw(st.integers(0, 1))]
        n = data.draw(st.integers(1, 8))
        if c.obtainable(n) < n:
            continue
        ids = c.allocate(n)
        for b in ids:
            c.prefix.register(b, next(names).to_bytes(16, "little"))
        c.release(ids[data.draw(st.integers(0, n)):])  # the others stay held
    before = [dict(zip(*(a.tolist() for a in c.cached_only_slots()))) for c in givers]
    want = data.draw(st.integers(0, taker.obtainable()))
    taker.allocate(want)
    taken = [age for c, ages in zip(givers, before) for slot, age in ages.items() if slot not in c.slots]
    kept = [age for c, ages in zip(givers, before) for slot, age in ages.items() if slot in c.slots]
    if taken and kept:
        assert max(taken) <= min(kept)
    for c in (*givers, taker):
        c.check()


def test_out_of_blocks_when_nothing_can_be_obtained():
    _, pool, _ = make(chunks=1)
    pool.allocate(4)
    assert pool.obtainable() == 0
    with pytest.raises(OutOfBlocks) as err:
        pool.allocate(1)
    assert "needed 1" in str(err.value)


def test_slab_chunks_choice_and_too_large_layout():
    assert choose_slab_chunks(2 << 20, 2 << 20, 100) == 1
    assert choose_slab_chunks(3 << 20, 2 << 20, 100) == 3  # 6 MiB holds two 3 MiB blocks exactly
    assert choose_slab_chunks(100, 4096, 10) == 1  # 40 blocks, 96 bytes of 4096 wasted (2.3%)
    with pytest.raises(LayoutDoesNotFit):
        choose_slab_chunks(5 << 20, 2 << 20, 2)


def test_register_many_with_a_hash_twice_matches_register_one_by_one():
    _, one, _ = make()
    _, many, _ = make()
    blocks = one.allocate(4)
    assert many.allocate(4) == blocks
    digests = [b"a" * 16, b"b" * 16, b"a" * 16, b"c" * 16]
    expect = [b for b, h in zip(blocks, digests) if one.prefix.register(b, h, writer=5)]
    assert many.prefix.register_many(blocks, digests, writer=5) == expect == [blocks[0], blocks[1], blocks[3]]
    assert prefix_state(many) == prefix_state(one)
    many.check()
