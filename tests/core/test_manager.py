"""KVCacheManager: sequences, prefix cache, copy-on-write, reserves, errors."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpoold.core import (
    BlockCopy,
    ExtendItem,
    Geometry,
    InvalidArgument,
    KVCacheManager,
    KvpoolError,
    LayoutDoesNotFit,
    NotOwner,
    OutOfBlocks,
    SeqDelta,
    UnknownSequence,
    WrongState,
)
from kvpoold.core.hashing import chain_hashes, pack_tokens, root_hash
from kvpoold.core.tiers import Tier

from helpers import snapshot
from oracle import refcount

G = Geometry(num_layers=1, num_kv_heads=1, head_dim=8, dtype="float16", block_size=4)  # 128 B


def make(blocks=16, **kw):
    m = KVCacheManager(blocks * 128, chunk_bytes=512, **kw)  # 4 blocks a slab
    return m, m.register_class(G)


def test_create_allocates_ceil_blocks_and_reports_no_hit():
    m, c = make()
    s = m.create(1, c, "llama", range(10))
    assert s.block_table == (0, 1, 2) and s.num_tokens == 10 and s.num_cached_tokens == 0
    m.check_invariants()


def test_prefix_hit_reuses_full_blocks_only():
    m, c = make()
    a = m.create(1, c, "llama", range(10))
    m.mark_written(1, [a.seq_id])  # owner 1 wrote the prompt's KV
    b = m.create(2, c, "llama", list(range(8)) + [99, 98, 97])
    assert b.block_table[:2] == a.block_table[:2]
    assert b.block_table[2] not in a.block_table
    assert b.num_cached_tokens == 8
    assert refcount(m.classes[c], a.block_table[0]) == 2
    other_model = m.create(3, c, "qwen", range(10))
    assert other_model.num_cached_tokens == 0
    lora = m.create(3, c, "llama", range(10), extra_key="lora-7")
    assert lora.num_cached_tokens == 0
    m.check_invariants()


def test_lookup_allocates_nothing_and_counts():
    m, c = make()
    a = m.create(1, c, "llama", range(12))
    m.mark_written(1, [a.seq_id])
    before = m.stats().classes[0]
    r = m.lookup(c, "llama", list(range(9)))
    assert r.num_cached_tokens == 8 and r.device_tokens == 8
    after = m.stats().classes[0]
    assert after.used_blocks == before.used_blocks and after.free_blocks == before.free_blocks
    assert after.prefix_queries == before.prefix_queries + 1
    assert after.prefix_hit_tokens == before.prefix_hit_tokens + 8


def test_freed_blocks_stay_cached_and_tail_is_evicted_first():
    m, c = make(blocks=4)  # one slab of 4 blocks
    a = m.create(1, c, "llama", range(16))
    m.free(1, [a.seq_id])
    st = m.stats().classes[0]
    assert st.cached_blocks == 4 and st.free_blocks == 0
    assert list(m.classes[c].cached) == list(a.block_table[::-1])
    b = m.create(1, c, "llama", [7, 7, 7, 7])  # needs one block: evicts the old tail
    assert b.block_table == (a.block_table[3],)
    assert m.lookup(c, "llama", range(16)).num_cached_tokens == 12
    assert m.create(2, c, "llama", range(12)).num_cached_tokens == 12
    m.check_invariants()


def test_extend_returns_only_new_blocks_and_hashes_filled_blocks():
    m, c = make()
    a = m.create(1, c, "llama", range(3))
    r = m.extend(1, {a.seq_id: [3]})
    assert r.deltas == () and r.copies == ()  # the block table did not change
    assert m.sequence(1, a.seq_id).num_tokens == 4
    r = m.extend(1, {a.seq_id: [4, 5]})
    assert r.deltas == (SeqDelta(a.seq_id, 1, (1,)),)
    # the first block (tokens 0..3) is now in the prefix cache
    assert m.lookup(c, "llama", range(4)).num_cached_tokens == 4
    assert m.sequence(1, a.seq_id).block_table == (0, 1)


def test_extend_batch_is_one_call_for_many_sequences():
    m, c = make(blocks=64)
    seqs = [m.create(1, c, "m", [i] * 4) for i in range(8)]
    r = m.extend(1, {s.seq_id: [1] for s in seqs})
    assert [d.seq_id for d in r.deltas] == [s.seq_id for s in seqs]
    assert all(len(d.blocks) == 1 for d in r.deltas)
    assert all(m.sequence(1, s.seq_id).num_tokens == 5 for s in seqs)


def test_fork_shares_and_copy_on_write_on_first_append():
    m, c = make()
    a = m.create(1, c, "llama", range(6))  # blocks 0 (full), 1 (2 of 4 tokens)
    f = m.fork(1, a.seq_id)
    assert f.block_table == a.block_table
    r = m.extend(1, {f.seq_id: [50]})
    (copy,) = r.copies
    assert copy == BlockCopy(c, a.block_table[1], r.deltas[0].blocks[0])
    assert r.deltas[0].first == 1
    assert m.sequence(1, f.seq_id).block_table == (a.block_table[0], copy.dst)
    # the parent is now the only holder: no second copy
    r2 = m.extend(1, {a.seq_id: [60]})
    assert r2.copies == () and r2.deltas == ()
    assert m.stats().classes[0].cow_copies == 1
    m.check_invariants()


def test_fork_at_block_boundary_needs_no_copy():
    m, c = make()
    a = m.create(1, c, "llama", range(8))
    f = m.fork(1, a.seq_id)
    r = m.extend(1, {f.seq_id: [1], a.seq_id: [2]})
    assert r.copies == ()
    assert r.deltas[0].blocks != r.deltas[1].blocks


def test_out_of_blocks_is_typed_and_changes_nothing():
    m, c = make(blocks=4)
    a = m.create(1, c, "llama", range(12))
    before = snapshot(m)
    with pytest.raises(OutOfBlocks) as err:
        m.create(1, c, "llama", range(100, 108))
    assert err.value.needed == 2 and err.value.available == 1
    assert snapshot(m) == before
    with pytest.raises(OutOfBlocks):
        m.extend(1, {a.seq_id: list(range(8))})
    assert snapshot(m) == before


def test_extend_is_all_or_nothing_across_the_batch():
    m, c = make(blocks=4)
    a = m.create(1, c, "llama", range(4))
    b = m.create(1, c, "llama", range(10, 14))
    before = snapshot(m)
    with pytest.raises(OutOfBlocks):
        m.extend(1, {a.seq_id: [1], b.seq_id: list(range(8))})
    assert snapshot(m) == before
    with pytest.raises(UnknownSequence):
        m.extend(1, {a.seq_id: [1], 999: [1]})
    assert snapshot(m) == before


@pytest.mark.parametrize(
    "call, error",
    [
        (lambda m, c, s: m.free(1, [s + 100]), UnknownSequence),
        (lambda m, c, s: m.extend(1, {s: ["x"]}), InvalidArgument),
        (lambda m, c, s: m.extend(1, {s: [-1]}), InvalidArgument),
        (lambda m, c, s: m.extend(1, {s: [2**32]}), InvalidArgument),
        (lambda m, c, s: m.extend(1, {s: [1.5]}), InvalidArgument),
        (lambda m, c, s: m.extend(1, {s: "abc"}), InvalidArgument),
        (lambda m, c, s: m.extend(1, {"1": [1]}), InvalidArgument),
        (lambda m, c, s: m.create(1, c, "m", [None]), InvalidArgument),
        (lambda m, c, s: m.create(1, c, "", [1]), InvalidArgument),
        (lambda m, c, s: m.create(1, 7, "m", [1]), InvalidArgument),
        (lambda m, c, s: m.free(2, [s]), NotOwner),
        (lambda m, c, s: m.extend(2, {s: [1]}), NotOwner),
        (lambda m, c, s: m.fork(2, s), NotOwner),
        (lambda m, c, s: m.free(1, [s, s]), InvalidArgument),
        (lambda m, c, s: m.grant_reserve(1, c, -1), InvalidArgument),
        (lambda m, c, s: m.return_reserve(1, c, [0]), InvalidArgument),
        (lambda m, c, s: m.evict_cached(c, -3), InvalidArgument),
    ],
)
def test_invalid_calls_raise_typed_errors_and_change_nothing(call, error):
    m, c = make()
    s = m.create(1, c, "m", range(6)).seq_id
    before = snapshot(m)
    with pytest.raises(error):
        call(m, c, s)
    assert snapshot(m) == before


def test_double_free_names_the_sequence():
    m, c = make()
    s = m.create(1, c, "m", range(6)).seq_id
    m.free(1, [s])
    before = snapshot(m)
    with pytest.raises(UnknownSequence, match=f"sequence {s} was already freed"):
        m.free(1, [s])
    assert snapshot(m) == before


def test_layout_that_does_not_fit():
    m = KVCacheManager(4096, chunk_bytes=1024)
    with pytest.raises(LayoutDoesNotFit):
        m.register_class(Geometry(64, 8, 128, "float16", 16))
    with pytest.raises(InvalidArgument):
        Geometry(0, 1, 1, "float16")
    with pytest.raises(InvalidArgument):
        Geometry(1, 1, 1, "int7")
    with pytest.raises(InvalidArgument):
        KVCacheManager(100, chunk_bytes=1024)


@pytest.mark.parametrize("dtype", ["float8_e5m2", "int8", "uint8", "float64"])
def test_a_dtype_no_kernel_takes_is_refused_by_both_sides_naming_the_accepted_ones(dtype):
    import kvpool

    for make in (lambda: Geometry(1, 1, 8, dtype), lambda: kvpool.Layout("m", 1, 1, 8, dtype=dtype)):
        with pytest.raises(InvalidArgument, match=r"a kernel takes, \['bfloat16', 'float16', 'float32', "
                                                  r"'float8_e4m3fn'\], got"):
            make()


def test_both_sides_raise_the_same_error_classes():
    import kvpool
    from kvpoold.core import TooManyClasses

    assert InvalidArgument is kvpool.InvalidArgument and KvpoolError is kvpool.KvpoolError
    m = KVCacheManager(4096, chunk_bytes=1024)
    with pytest.raises(kvpool.NotFound, match="^sequence 7 does not exist$"):
        m.free(1, [7])
    for core, shared in ((UnknownSequence, kvpool.NotFound), (NotOwner, kvpool.PermissionDenied),
                         (WrongState, kvpool.FailedPrecondition), (OutOfBlocks, kvpool.OutOfBlocks),
                         (TooManyClasses, kvpool.TooManyClasses)):
        assert issubclass(core, shared) and core.code == shared.code
    assert str(TooManyClasses("max_classes 2")).startswith(kvpool.errors.TOO_MANY_CLASSES_PREFIX)


def test_reserve_claims_move_blocks_into_sequences():
    m, c = make(blocks=32, max_reserve_blocks=6)
    a = m.create(1, c, "m", range(4))
    granted = m.grant_reserve(1, c, 10)
    assert len(granted) == 6  # capped
    assert m.stats().classes[0].reserved_blocks == 6
    r = m.extend(1, [ExtendItem(a.seq_id, [1, 2, 3, 4, 5], claimed=granted[:2])])
    assert r.deltas[0].blocks == granted[:2]
    assert m.reserve(1, c) == granted[2:]
    with pytest.raises(InvalidArgument, match="needs 1 new blocks"):
        m.extend(1, [ExtendItem(a.seq_id, [1, 2, 3, 4], claimed=granted[2:4])])
    # claims may cover the first new blocks only; the daemon allocates the rest
    r = m.extend(1, [ExtendItem(a.seq_id, list(range(8)), claimed=granted[2:3])])
    assert r.deltas[0].blocks[0] == granted[2] and len(r.deltas[0].blocks) == 2
    assert m.reserve(1, c) == granted[3:]
    with pytest.raises(InvalidArgument, match="not in this session's reserve"):
        m.extend(1, [ExtendItem(a.seq_id, [1, 2, 3, 4], claimed=(granted[0],))])
    b = m.create(2, c, "m", range(4))
    with pytest.raises(InvalidArgument, match="not in this session's reserve"):
        m.extend(2, [ExtendItem(b.seq_id, [1], claimed=(granted[3],))])
    m.check_invariants()
    assert m.drop_owner(1) == 5 + 3  # its sequence's 5 blocks and the 3 left in its reserve
    m.check_invariants()


def test_claims_refused_for_a_shared_partial_block():
    m, c = make()
    a = m.create(1, c, "m", range(6))
    m.fork(1, a.seq_id)
    blocks = m.grant_reserve(1, c, 2)
    with pytest.raises(WrongState, match="shares its last block"):
        m.extend(1, [ExtendItem(a.seq_id, [1, 2, 3], claimed=blocks[:1])])


def test_drop_owner_frees_everything_but_keeps_cache():
    m, c = make()
    s = m.create(1, c, "m", range(9))
    m.mark_written(1, [s.seq_id])
    m.grant_reserve(1, c, 3)
    m.drop_owner(1)
    st = m.stats()
    assert st.sequences == 0 and st.classes[0].used_blocks == 0
    assert st.classes[0].cached_blocks == 2  # the two full blocks
    m.check_invariants()


def test_two_classes_share_memory_without_static_split():
    m = KVCacheManager(8 * 512, chunk_bytes=512)
    small = m.register_class(G)  # 4 blocks / chunk
    big = m.register_class(Geometry(2, 1, 8, "float16", 4))  # 256 B: 2 blocks / chunk
    a = m.create(1, small, "a", range(4 * 30))  # 30 blocks: 8 chunks minus ...
    assert m.budget.free == 0
    assert len(m.drain_slab_changes()) == 8  # the daemon commits them
    with pytest.raises(OutOfBlocks):
        m.create(2, big, "b", range(4))
    m.free(1, [a.seq_id])
    b = m.create(2, big, "b", range(4 * 16))  # takes the whole pool, evicting a's cache
    assert len(b.block_table) == 16 and m.stats().classes[0].total_blocks == 0
    changes = m.drain_slab_changes()
    assert sorted(o for kind, c, o, n in changes if kind == "release") == [i * 512 for i in range(8)]
    assert sorted(o for kind, c, o, n in changes if kind == "take" and c == big) == [i * 512 for i in range(8)]
    m.check_invariants()


def test_tier_placement_records_demotions():
    m, c = make(blocks=4, host_bytes=2 * 128, disk_bytes=128)
    a = m.create(1, c, "m", range(16))
    m.free(1, [a.seq_id])
    m.evict_cached(c)
    moves = m.drain_moves()
    # evicted tail first (h3, h2, h1, h0): the host keeps the last two, h2 is
    # pushed to disk, and h3, pushed to disk first, is pushed out of it
    per_key: dict = {}
    for mv in moves:
        per_key.setdefault(mv.key, []).append((mv.src.name, mv.dst.name if mv.dst is not None else None))
    hashes = chain_hashes(root_hash("m"), pack_tokens(range(16)), 4)
    assert [per_key[(c, h)] for h in hashes] == [
        [("DEVICE", "HOST")], [("DEVICE", "HOST")],
        [("DEVICE", "HOST"), ("HOST", "DISK")],
        [("DEVICE", "HOST"), ("HOST", "DISK"), ("DISK", None)],
    ]
    # an executable order: replayed in plan order, no tier ever holds more than its capacity
    held = {"HOST": 0, "DISK": 0}
    for mv in moves:
        if mv.src != Tier.DEVICE:
            held[mv.src.name] -= 1
        if mv.dst is not None:
            held[mv.dst.name] += 1
        assert held["HOST"] <= 2 and held["DISK"] <= 1
    r = m.lookup(c, "m", range(16))
    assert (r.num_cached_tokens, r.device_tokens, r.host_tokens, r.disk_tokens) == (12, 0, 8, 4)
    m.check_invariants()


def test_extend_takes_one_class_per_call():
    m = KVCacheManager(8 * 512, chunk_bytes=512)
    a_cls = m.register_class(G)
    b_cls = m.register_class(Geometry(2, 1, 8, "float16", 4))
    a = m.create(1, a_cls, "a", range(3))
    b = m.create(1, b_cls, "b", range(3))
    before = snapshot(m)
    with pytest.raises(InvalidArgument, match="one layout class"):
        m.extend(1, {a.seq_id: [1], b.seq_id: [1]})
    assert snapshot(m) == before


def test_extend_columns_matches_mapping_form():
    m1, c1 = make(blocks=64)
    m2, c2 = make(blocks=64)
    ids = [m1.create(1, c1, "m", range(i)).seq_id for i in range(6)]
    ids2 = [m2.create(1, c2, "m", range(i)).seq_id for i in range(6)]
    assert ids == ids2
    batch = {s: list(range(100, 100 + k)) for k, s in enumerate(ids)}
    r1 = m1.extend(1, batch)

    counts = np.array([len(v) for v in batch.values()])
    tokens = np.concatenate([np.array(v, np.uint32) for v in batch.values()])
    r2 = m2.extend_columns(1, np.array(ids), counts, tokens)
    assert r1 == r2
    with pytest.raises(InvalidArgument, match="add up"):
        m2.extend_columns(1, np.array(ids), counts, tokens[:-1])
    with pytest.raises(InvalidArgument, match="appears twice"):
        m2.extend_columns(1, np.array([ids[1], ids[1]]), np.array([1, 1]), np.array([1, 2]))
    with pytest.raises(InvalidArgument, match="out of range"):
        m2.extend_columns(1, np.array([ids[1]]), np.array([1]), np.array([-5]))


def test_blocks_are_shared_across_owners_only_once_written():
    m, c = make()
    a = m.create(1, c, "llama", range(12))
    # owner 2 must not read owner 1's blocks before their KV is written
    assert m.create(2, c, "llama", range(12)).num_cached_tokens == 0
    assert m.lookup(c, "llama", range(12), owner=2).num_cached_tokens == 0
    # the writer itself may (its own batch writes them in the same forward)
    assert m.create(1, c, "llama", range(12)).num_cached_tokens == 12
    m.extend(1, {a.seq_id: [1]})  # a later call on the sequence says its earlier KV is written
    assert m.create(2, c, "llama", range(12)).num_cached_tokens == 12
    # blocks filled by that call wait for the next one
    d = m.create(1, c, "llama", range(100, 103))
    m.extend(1, {d.seq_id: [103]})
    assert m.lookup(c, "llama", range(100, 104), owner=2).num_cached_tokens == 0
    m.free(1, [d.seq_id])  # freeing says so too
    assert m.lookup(c, "llama", range(100, 104), owner=2).num_cached_tokens == 4
    m.check_invariants()


def test_a_session_that_dies_unwritten_leaves_no_hits():
    m, c = make()
    m.create(1, c, "llama", range(12))
    m.drop_owner(1)  # died before writing: the blocks may hold garbage
    assert m.lookup(c, "llama", range(12), owner=2).num_cached_tokens == 0
    st = m.stats().classes[0]
    assert st.cached_blocks == 0 and st.used_blocks == 0
    m.check_invariants()


def test_fork_then_both_append_in_one_call_copies_once():
    m, c = make()
    a = m.create(1, c, "llama", range(6))  # block 1 is half full
    f = m.fork(1, a.seq_id)
    r = m.extend(1, {a.seq_id: [40], f.seq_id: [50]})
    (copy,) = r.copies  # one copies, the last of the batch (the fork) keeps the block
    assert copy.src == a.block_table[1]
    assert m.sequence(1, a.seq_id).block_table == (a.block_table[0], copy.dst)
    assert m.sequence(1, f.seq_id).block_table == a.block_table
    g = m.fork(1, f.seq_id)
    h = m.fork(1, f.seq_id)
    r = m.extend(1, {g.seq_id: [1], h.seq_id: [2]})  # f holds the block too: both copy
    assert len(r.copies) == 2
    m.check_invariants()


@given(lengths=st.lists(st.integers(0, 13), min_size=1, max_size=5), data=st.data())
@settings(max_examples=60, deadline=None)
def test_extend_admit_sees_the_growth_and_a_refusal_changes_nothing(lengths, data):
    """``admit`` is called once with the blocks the call adds (decode fast path and general path alike),
    before anything changes: raising from it leaves the manager as it was."""
    m, c = make(blocks=64)
    seqs = [m.create(1, c, "llama", range(100 * i, 100 * i + n)) for i, n in enumerate(lengths)]
    counts = np.array(data.draw(st.lists(st.integers(0, 9), min_size=len(seqs), max_size=len(seqs))), np.int64)
    if data.draw(st.booleans()):
        counts[:] = 1  # the decode step's shape
    ids = np.array([s.seq_id for s in seqs], np.int64)
    tokens = np.arange(int(counts.sum()), dtype=np.uint32) + 7
    bs = G.block_size
    want = sum(-(-(n + k) // bs) - -(-n // bs) for n, k in zip(lengths, counts.tolist()))
    seen = []

    def refuse(grow):
        seen.append(grow)
        raise KvpoolError("refused")

    before = snapshot(m)
    with pytest.raises(KvpoolError, match="refused"):
        m.extend_columns(1, ids, counts, tokens, admit=refuse)
    assert seen == [want] and snapshot(m) == before
    m.check_invariants()
    m.extend_columns(1, ids, counts, tokens, admit=seen.append)
    assert seen == [want, want]
    assert [m.sequence(1, int(i)).num_tokens for i in ids] == [n + k for n, k in zip(lengths, counts.tolist())]
    m.check_invariants()
