"""Dropping layout classes and reusing their ids (``kvpoold/core/classes.py``)."""

from __future__ import annotations

import pytest

from kvpoold.core import Geometry, InvalidArgument, KVCacheManager, Tier, WrongState

from helpers import snapshot


def geometry(i: int) -> Geometry:
    return Geometry(1 + i % 4, 1, 4, "float16", 2, tenant=f"t{i}")


def manager(**kw) -> KVCacheManager:
    return KVCacheManager(64 * 128, chunk_bytes=128, **kw)


def _refused(m, cid, why):
    assert not m.can_drop_class(cid), why
    before = snapshot(m)
    with pytest.raises(WrongState):
        m.drop_class(cid)
    assert snapshot(m) == before, why


def test_a_class_in_use_is_refused_and_nothing_changes():
    m = manager(max_reserve_blocks=4)
    cid = m.register_class(geometry(0))
    seq = m.create(1, cid, "a", [1, 2, 3])
    _refused(m, cid, "a sequence")
    m.free(1, [seq.seq_id])  # its full block keeps a hash: cached
    _refused(m, cid, "a cached block")
    m.evict_cached(cid)
    m.grant_reserve(2, cid, 2)
    _refused(m, cid, "a reserve")
    m.return_reserve(2, cid)
    seq = m.create(1, cid, "b", [4])
    m.hold_blocks(cid, list(seq.block_table))
    m.free(1, [seq.seq_id])
    _refused(m, cid, "a transfer hold")
    m.release_holds(cid, list(seq.block_table))
    assert m.can_drop_class(cid)
    m.drop_class(cid)
    m.check_invariants()


def test_a_dropped_class_gives_its_slabs_back_and_its_id_to_the_next_geometry():
    m = manager()
    a, b = m.register_class(geometry(0)), m.register_class(geometry(1))
    seq = m.create(1, a, "a", list(range(9)))
    m.drain_slab_changes()
    slots = set(m.classes[a].slots)
    m.free(1, [seq.seq_id])
    assert not m.can_drop_class(a)  # its full blocks are cached
    m.evict_cached(a)
    free_before, pool = m.budget.free, m.classes[a]
    m.drop_class(a)
    m.check_invariants()
    assert m.budget.free == free_before + len(slots) * pool.slab_chunks
    assert [c.class_id for c in m.stats().classes] == [b]
    with pytest.raises(InvalidArgument, match="unknown layout class"):
        m.class_pool(a)
    with pytest.raises(InvalidArgument):
        m.create(1, a, "a", [1])
    changes = m.drain_slab_changes()
    assert {(k, c) for k, c, _, _ in changes} == {("release", a)} and len(changes) == len(slots)
    c = m.register_class(geometry(2))
    assert c == a  # the lowest vacant id
    assert m.register_class(geometry(0)) == 2  # the dropped geometry is new again: a new id
    m.check_invariants()


@pytest.mark.parametrize("settings", [{"journal": True}, {"remote_write": "through"}])
def test_a_class_in_a_reused_id_reports_its_confirmed_blocks_like_a_new_one(settings):
    m = manager(**settings)
    a = m.register_class(geometry(0))
    m.drop_class(a)
    m.drain_slab_changes()
    assert m.register_class(geometry(1)) == a
    seq = m.create(1, a, "m", [1, 2])  # one full block
    m.free(1, [seq.seq_id])  # its KV is written: confirmed
    if settings.get("journal"):
        assert [(kind, cid) for kind, _, cid, _ in m.drain_journal()] == [("stored", a)]
    else:
        assert [(mv.src, mv.dst, mv.key[0]) for mv in m.drain_moves()] == [(Tier.DEVICE, Tier.REMOTE, a)]
    m.check_invariants()


def test_an_undrained_vacancy_is_not_reused():
    """A release of the old class must never reach the new class's memory."""
    m = manager()
    a = m.register_class(geometry(0))
    m.free(1, [m.create(1, a, "a", [1]).seq_id])
    m.drain_slab_changes()
    m.drop_class(a)
    assert m.register_class(geometry(1)) == 1
    assert ("release", a) in {(k, c) for k, c, _, _ in m.drain_slab_changes()}
    assert m.register_class(geometry(2)) == a


def test_classes_never_grow_beyond_the_most_alive_at_once():
    m = manager(host_bytes=4096)
    for i in range(200):
        cid = m.register_class(geometry(i))
        m.free(1, [m.create(1, cid, "a", [1, 2, 3, 4]).seq_id])  # cached, then demoted to the host tier
        m.evict_cached(cid)
        m.drain_moves()
        assert m.placement.entries_of(cid) == 2 and not m.can_drop_class(cid)  # demoted, so still cached
        m.evict_class(cid)  # the host tier's copies too
        m.drain_moves()
        m.drop_class(cid)
        m.drain_slab_changes()
        m.check_invariants()
    assert len(m.classes) == 1 and not m.stats().classes


def test_evict_class_refuses_a_class_in_use():
    m = manager()
    cid = m.register_class(geometry(0))
    m.create(1, cid, "a", [1, 2, 3])
    before = snapshot(m)
    with pytest.raises(WrongState):
        m.evict_class(cid)
    assert snapshot(m) == before
