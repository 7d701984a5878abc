"""The core's side of the tiers: placement, promotion, swapping, transfer holds (pure)."""

from __future__ import annotations

import pytest

from kvpoold.core import Geometry, InvalidArgument, KVCacheManager, OutOfBlocks, Tier, WrongState
from kvpoold.core.hashing import chain_hashes, pack_tokens, root_hash
from kvpoold.core.tiers import DROP, MovePlan, TierPlacement

from helpers import snapshot
from oracle import OraclePlacement, tier_keys

G = Geometry(1, 1, 4, "float16", 4)  # 64 bytes per block


def make(blocks=8, host_blocks=0, disk_blocks=0, align=1):
    bb = G.block_bytes
    m = KVCacheManager(blocks * bb, chunk_bytes=bb, host_bytes=host_blocks * bb, disk_bytes=disk_blocks * bb,
                       tier_align=align)
    return m, m.register_class(G)


def unchanged(m, fn, exc):
    before = snapshot(m)
    with pytest.raises(exc):
        fn()
    assert snapshot(m) == before


def test_prefix_hit_on_lower_tiers_promotes_in_chain_order():
    m, c = make(blocks=4, host_blocks=2, disk_blocks=4)
    a = m.create(1, c, "m", range(16))  # 4 blocks fill the device
    m.free(1, [a.seq_id])
    b = m.create(1, c, "m", range(100, 116))  # evicts all of a's blocks: tail first
    m.drain_moves()
    assert m.lookup(c, "m", range(16)).num_cached_tokens == 16
    m.free(1, [b.seq_id])
    hit = m.create(2, c, "m", range(16))
    assert hit.num_cached_tokens == 16
    moves = m.drain_moves()
    ins = [mv for mv in moves if mv.dst == Tier.DEVICE]
    assert [mv.block for mv in ins] == list(hit.block_table)  # each promoted hash lands in its own block
    hashes = chain_hashes(root_hash("m"), pack_tokens(range(16)), 4)
    assert [mv.key for mv in ins] == [(c, h) for h in hashes]
    # every device read of the call comes before the writes into the same blocks
    for i, mv in enumerate(moves):
        if mv.src == Tier.DEVICE:
            assert all(w.block != mv.block for w in moves[:i] if w.dst == Tier.DEVICE)
    pool = m.classes[c]
    assert all(pool.prefix.digest_of(b) == h for b, h in zip(hit.block_table, hashes))
    st = m.stats()
    assert st.classes[0].promoted_blocks == 4 and st.classes[0].demoted_blocks >= 4
    m.check_invariants()


def test_promoted_keys_are_not_victims_of_the_same_call():
    # the host holds exactly the prompt's blocks; making room for the promotion demotes other blocks
    m, c = make(blocks=4, host_blocks=4)
    a = m.create(1, c, "m", range(16))
    m.free(1, [a.seq_id])
    b = m.create(1, c, "m", range(200, 216))  # a's 4 blocks -> host
    m.free(1, [b.seq_id])
    m.drain_moves()
    hit = m.create(1, c, "m", range(16))  # promotes 4 from host, evicts b's 4 to the host
    assert hit.num_cached_tokens == 16
    moves = m.drain_moves()
    taken = {mv.key for mv in moves if mv.dst == Tier.DEVICE}
    dropped = {mv.key for mv in moves if mv.dst is None}
    assert not taken & dropped and len(taken) == 4
    m.check_invariants()


def test_swap_out_in_round_trip_and_refusals():
    m, c = make(blocks=8, host_blocks=3, disk_blocks=3)
    s = m.create(1, c, "m", range(18))  # 5 blocks, the last one partial
    out = m.swap_out(1, [s.seq_id])
    assert out == (3, 2)  # the host takes 3, the disk the rest
    moves = m.drain_moves()
    assert [mv.block for mv in moves if mv.src == Tier.DEVICE] == list(s.block_table)
    info = m.sequence(1, s.seq_id)
    assert info.swapped and info.block_table == () and info.num_tokens == 18
    unchanged(m, lambda: m.extend(1, {s.seq_id: [1]}), WrongState)
    unchanged(m, lambda: m.fork(1, s.seq_id), WrongState)
    unchanged(m, lambda: m.swap_out(1, [s.seq_id]), WrongState)
    other = m.create(1, c, "m", range(500, 504))
    unchanged(m, lambda: m.swap_in(1, [other.seq_id]), WrongState)
    unchanged(m, lambda: m.swap_out(2, [other.seq_id]), Exception)  # not the owner
    m.check_invariants()
    back = m.swap_in(1, [s.seq_id])[0]
    assert not back.swapped and len(back.block_table) == 5
    moves = m.drain_moves()
    ins = [mv for mv in moves if mv.dst == Tier.DEVICE]
    drops = [mv for mv in moves if mv.dst is None]
    # hashed blocks still cached on the device are shared back instead of copied
    assert len(ins) + len(drops) == 5
    assert all(t.pinned == 0 for t in m.placement.lower)
    m.extend(1, {s.seq_id: [7, 7]})  # live again
    st = m.stats().classes[0]
    assert st.swapped_out_blocks == st.swapped_in_blocks == 5 and st.swapped_sequences == 0
    m.check_invariants()


def test_swap_out_without_room_or_tiers_changes_nothing():
    m, c = make(blocks=8, host_blocks=2)
    s = m.create(1, c, "m", range(12))  # 3 blocks, room for 2
    unchanged(m, lambda: m.swap_out(1, [s.seq_id]), OutOfBlocks)
    m2, c2 = make(blocks=8)
    s2 = m2.create(1, c2, "m", range(4))
    unchanged(m2, lambda: m2.swap_out(1, [s2.seq_id]), WrongState)


def test_swap_in_needs_device_room_and_changes_nothing_without_it():
    m, c = make(blocks=4, host_blocks=8)
    s = m.create(1, c, "m", range(13))  # 4 blocks (the last partial)
    m.swap_out(1, [s.seq_id])
    filler = m.create(2, c, "x", range(700, 716))  # holds the whole device
    m.drain_moves()
    unchanged(m, lambda: m.swap_in(1, [s.seq_id]), OutOfBlocks)
    m.free(2, [filler.seq_id])
    assert len(m.swap_in(1, [s.seq_id])[0].block_table) == 4
    m.check_invariants()


def test_freeing_a_swapped_sequence_drops_its_copies():
    m, c = make(blocks=8, host_blocks=8)
    s = m.create(1, c, "m", range(10))
    m.swap_out(1, [s.seq_id])
    m.drain_moves()
    m.free(1, [s.seq_id])
    moves = m.drain_moves()
    assert len(moves) == 3 and all(mv.dst is None and mv.src == Tier.HOST for mv in moves)
    assert all(len(t) == 0 for t in m.placement.lower)
    m.check_invariants()


def test_pinned_swap_copies_are_never_evicted():
    m, c = make(blocks=4, host_blocks=4)
    s = m.create(1, c, "m", range(8))  # 2 blocks
    m.swap_out(1, [s.seq_id])
    for k in range(6):  # cached traffic through a host tier half full of pinned copies
        x = m.create(2, c, "m", range(1000 * (k + 1), 1000 * (k + 1) + 16))
        m.free(2, [x.seq_id])
    m.drain_moves()
    host = m.placement.lower[0]
    assert host.pinned == 2 * G.block_bytes and len(host) == 4
    assert len(m.swap_in(1, [s.seq_id])[0].block_table) == 2
    m.check_invariants()


def test_holds_keep_blocks_until_released():
    m, c = make(blocks=4)
    s = m.create(1, c, "m", range(8))
    b = list(s.block_table)
    m.hold_blocks(c, b)
    m.free(1, [s.seq_id])
    pool = m.classes[c]
    assert all(blk not in pool.cached and blk not in pool.free for blk in b)  # still held
    m.check_invariants()
    unchanged(m, lambda: m.release_holds(c, b + b), InvalidArgument)
    m.release_holds(c, b)
    assert all(blk in pool.cached for blk in b)
    unchanged(m, lambda: m.hold_blocks(c, b), InvalidArgument)  # cached: nothing to hold
    m.check_invariants()


def test_invalidated_block_is_never_a_prefix_hit_until_its_owner_is_told():
    m, c = make(blocks=8)
    s = m.create(1, c, "m", range(8))
    m.mark_written(1, [s.seq_id])
    digest = m.invalidate_block(c, s.block_table[1])
    assert digest is not None
    assert m.lookup(c, "m", range(8)).num_cached_tokens == 4
    assert m.register_block(1, s.seq_id, s.block_table[1], digest)
    assert m.lookup(c, "m", range(8), owner=1).num_cached_tokens == 8  # its owner rewrites it...
    assert m.lookup(c, "m", range(8), owner=2).num_cached_tokens == 4  # ...others wait for that
    m.mark_written(1, [s.seq_id])
    assert m.lookup(c, "m", range(8), owner=2).num_cached_tokens == 8
    assert m.stats().classes[0].lost_blocks == 1
    m.check_invariants()


def test_restart_entries_load_oldest_first_as_far_as_they_fit():
    m, c = make(blocks=4, disk_blocks=2)
    assert m.load_lower(Tier.DISK, c, b"a" * 16, G.block_bytes)
    assert not m.load_lower(Tier.DISK, c, b"a" * 16, G.block_bytes)  # known already
    assert m.load_lower(Tier.DISK, c, b"b" * 16, G.block_bytes)
    assert not m.load_lower(Tier.DISK, c, b"c" * 16, G.block_bytes)  # full
    assert tier_keys(m.placement.lower[1]) == [(c, b"a" * 16), (c, b"b" * 16)]
    m.check_invariants()


def test_a_lost_copy_is_forgotten_unless_pinned():
    m, c = make(blocks=4, host_blocks=8)
    a = m.create(1, c, "m", range(16))
    m.free(1, [a.seq_id])
    m.evict_cached(c)
    key = m.drain_moves()[0].key
    assert m.forget_lower(key) and m.placement.locate(key) is None
    s = m.create(1, c, "m", range(300, 304))
    m.swap_out(1, [s.seq_id])
    (swap_key,) = [k for k in m.placement.lower[0].pinned_keys()]
    assert not m.forget_lower(swap_key)  # the swap-in reports the loss instead
    m.check_invariants()


def test_alignment_charges_whole_pages():
    m = KVCacheManager(4 * G.block_bytes, chunk_bytes=G.block_bytes, host_bytes=8192, tier_align=4096)
    c = m.register_class(G)
    s = m.create(1, c, "m", range(16))
    m.free(1, [s.seq_id])
    m.evict_cached(c)
    host = m.placement.lower[0]
    assert len(host) == 2 and host.used == 8192  # 64-byte blocks take a page each
    m.check_invariants()


def test_moves_are_planned_as_columns():
    m, c = make(blocks=4, host_blocks=2, disk_blocks=1)
    a = m.create(1, c, "m", range(16))
    m.free(1, [a.seq_id])
    m.evict_cached(c)
    plan = m.drain_moves()
    keys, src, dst, block, nbytes = plan.columns()
    moves = list(plan)
    assert len(plan) == len(moves) == len(keys) == 7
    assert [mv.key for mv in moves] == keys
    assert src.tolist() == [int(mv.src) for mv in moves]
    assert dst.tolist() == [DROP if mv.dst is None else int(mv.dst) for mv in moves]
    assert block.tolist() == [mv.block for mv in moves] and set(nbytes.tolist()) == {G.block_bytes}
    assert MovePlan.of(moves).columns()[2].tolist() == dst.tolist()  # Move objects convert back
    assert len(m.drain_moves()) == 0


def _tier_state(p):
    return [(list(ix._order), dict(ix._sizes), ix.used, ix.pinned, ix.blocks_in, ix.blocks_out, ix.dropped)
            for ix in p.lower]


def _moves_per_key(plan):
    out: dict = {}
    for mv in plan:
        out.setdefault(mv.key, []).append((mv.src, mv.dst, mv.block, mv.nbytes))
    return out


@pytest.mark.parametrize("seed", range(40))
def test_batch_placement_matches_key_by_key(seed):
    """The batch paths (demote_many, place_pinned_many, pin_many + take_many, drop_many) leave exactly the
    state that the single-key methods leave (LRU order, sizes, charges, counters), with the same moves per key."""
    import random

    rng = random.Random(seed)
    align = rng.choice([1, 4096])
    host, disk = rng.randrange(0, 16) * 4096, rng.randrange(0, 16) * 4096
    ref, bulk = OraclePlacement(host, disk, align=align), TierPlacement(host, disk, align=align)
    serial = 0
    for _ in range(30):
        pr, pb = MovePlan(), MovePlan()
        op = rng.choice(["demote", "demote", "pinned", "promote", "swap_in", "drop"])
        size = rng.choice([1000, 4096, 5000])  # a class: keys are (size, n)
        present = [k for ix in ref.lower for k in ix._sizes if k[0] == size]
        evictable = [k for ix in ref.lower for k in ix._order if k[0] == size]
        pinned = [k for k in present if k not in evictable]
        if op == "demote":
            keys = [(size, serial + i) for i in range(rng.randrange(1, 12))]
            serial += len(keys)
            for k in rng.sample(present, min(len(present), rng.randrange(0, 3))):  # some are there already
                keys.insert(rng.randrange(len(keys) + 1), k)
            blocks = [rng.randrange(1000) for _ in keys]
            placed = sum(ref.demote(pr, k, size, b) for k, b in zip(keys, blocks))
            assert bulk.demote_many(pb, keys, size, blocks) == placed
        elif op == "pinned":
            keys = [(size, serial + i) for i in range(rng.randrange(1, 8))]
            serial += len(keys)
            ok = ref.can_pin([size] * len(keys))
            assert bulk.can_pin_runs([(size, len(keys))]) == ok
            if ok:
                tally = [0, 0]
                for i, k in enumerate(keys):
                    tally[ref.place_pinned(pr, k, size, i) - 1] += 1
                assert bulk.place_pinned_many(pb, keys, size, list(range(len(keys)))) == tally
        elif op == "promote":  # create: pin the hit's keys, allocate (which may demote), take them
            keys = rng.sample(evictable, min(len(evictable), rng.randrange(0, 6)))
            for k in keys:
                ref.pin(k)
            runs = bulk.pin_many(keys)
            assert _tier_state(ref) == _tier_state(bulk)
            for i, k in enumerate(keys):
                ref.take(pr, k, i)
            bulk.take_many(pb, keys, list(range(len(keys))), pinned=True, runs=runs)
        elif op == "swap_in":
            keys = rng.sample(pinned, min(len(pinned), rng.randrange(0, 6)))
            for i, k in enumerate(keys):
                ref.take(pr, k, i)
            bulk.take_many(pb, keys, list(range(len(keys))), pinned=True)
        else:
            keys = rng.sample(present, min(len(present), rng.randrange(0, 6)))
            for k in keys:
                ref.drop(pr, k)
            bulk.drop_many(pb, keys)
        assert _tier_state(ref) == _tier_state(bulk), op
        assert _moves_per_key(pr) == _moves_per_key(pb), op
        bulk.check()


def test_tier_lru_orders_like_the_pool_lru():
    # the tier indexes' dict-based LRU against the OrderedDict one, over random single and batch calls
    import random

    from kvpoold.core.policy import LRUPolicy
    from kvpoold.core.policy import DictLRU

    rng = random.Random(7)
    ref, lru = LRUPolicy(), DictLRU()
    next_key = 0
    for _ in range(3000):
        op = rng.random()
        if op < 0.35 or not len(ref):
            keys = list(range(next_key, next_key + rng.randint(1, 40)))
            next_key += len(keys)
            ref.insert_many(keys)
            lru.insert_many(dict.fromkeys(keys, 64) if rng.random() < 0.5 else keys)
        elif op < 0.6:
            assert lru.victim() == ref.victim()
        elif op < 0.7:
            n = rng.randint(1, 30)
            assert lru.victims(n) == ref.victims(n)
        elif op < 0.85:
            k = rng.choice(list(ref))
            ref.touch(k)
            lru.touch(k)
        else:
            k = rng.choice(list(ref))
            ref.remove(k)
            lru.remove(k)
        assert len(lru) == len(ref)
    assert list(lru) == list(ref)
