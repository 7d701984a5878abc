"""The CUDA VMM chunk ledger: the safety rule as a state machine (pure; runs without a GPU)."""

from __future__ import annotations

import pytest
from hypothesis import settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvpoold.memory.chunk_ledger import ChunkLedger

CLASSES = {0: "uid 1", 1: "uid 1", 2: "uid 2"}  # two classes of one tenant, one of another
INDICES = 4


class LedgerMachine(RuleBasedStateMachine):
    """Daemon places and unplaces chunks; clients sync (sent, then maybe acked) and go away."""

    def __init__(self) -> None:
        super().__init__()
        self.ledger = ChunkLedger()
        for cid, tenant in CLASSES.items():
            self.ledger.add_class(cid, tenant)
        self.viewer_class: dict[int, int] = {}
        self.next_viewer = 1
        # what each client process really maps: viewer -> {index: chunk}
        self.client_maps: dict[int, dict[int, int]] = {}
        self.pending: dict[int, dict[int, int]] = {}  # viewer -> snapshot of a sync in progress
        self.released: set[int] = set()  # chunks given back to the GPU

    @rule(cid=st.sampled_from(sorted(CLASSES)), index=st.integers(0, INDICES - 1))
    def place(self, cid, index):
        if index in self.ledger.places[cid]:
            with pytest.raises(ValueError):
                self.ledger.place(cid, index)
            return
        placed = self.ledger.place(cid, index)
        assert placed.chunk not in self.released, "a released chunk came back"
        # nobody maps the chunk at another place, and no other tenant ever had it
        for viewer, mapping in self.client_maps.items():
            for i, c in mapping.items():
                if c == placed.chunk:
                    assert (self.viewer_class[viewer], i) == (cid, index), "a chunk reused while still mapped"
        assert self.ledger.tenant_of[placed.chunk] == CLASSES[cid]

    @rule(cid=st.sampled_from(sorted(CLASSES)), index=st.integers(0, INDICES - 1))
    def unplace(self, cid, index):
        if index not in self.ledger.places[cid]:
            return
        chunk, viewers = self.ledger.unplace(cid, index)
        mappers = {v for v, m in self.client_maps.items() if chunk in m.values()}
        assert mappers <= set(viewers), "a client still mapping the chunk was not told to sync"

    @rule()
    def settle(self):
        self.released |= set(self.ledger.take_idle())
        for mapping in self.client_maps.values():
            assert not (set(mapping.values()) & self.released), "a chunk released while a client maps it"

    @rule(cid=st.sampled_from(sorted(CLASSES)))
    def attach(self, cid):
        v = self.next_viewer
        self.next_viewer += 1
        self.viewer_class[v] = cid
        self.client_maps[v] = {}
        self.ledger.open_view(v, cid)

    @precondition(lambda self: self.viewer_class)
    @rule(data=st.data())
    def start_sync(self, data):
        v = data.draw(st.sampled_from(sorted(self.viewer_class)))
        _gen, places = self.ledger.snapshot(self.viewer_class[v])
        mine = self.client_maps[v]
        for i in [i for i, c in mine.items() if places.get(i) != c]:
            del mine[i]  # the client unmaps what left its place
        wanted = {i: c for i, c in places.items() if mine.get(i) != c}
        cut = data.draw(st.integers(0, len(wanted)))  # the dialog may break off after some batches
        got = dict(list(wanted.items())[:cut])
        self.ledger.sent(v, list(got.values()))
        mine.update(got)
        if cut == len(wanted) and data.draw(st.booleans()):
            self.ledger.acked(v, places.values())
        elif cut < len(wanted):
            mine.clear()  # a broken sync: the client unmaps everything

    @precondition(lambda self: self.viewer_class)
    @rule(data=st.data())
    def detach(self, data):
        v = data.draw(st.sampled_from(sorted(self.viewer_class)))
        del self.viewer_class[v]
        del self.client_maps[v]
        self.ledger.forget(v)

    @invariant()
    def consistent(self):
        self.ledger.check()
        for v, mapping in self.client_maps.items():
            assert set(mapping.values()) <= self.ledger.maybe[v], "a client maps a chunk the ledger forgot"


TestLedger = LedgerMachine.TestCase
TestLedger.settings = settings(max_examples=200, stateful_step_count=60, deadline=None)


def test_idle_chunks_are_reused_within_a_tenant_only():
    ledger = ChunkLedger()
    ledger.add_class(0, "a")
    ledger.add_class(1, "a")
    ledger.add_class(2, "b")
    first = ledger.place(0, 0)
    assert first.source == "new"
    ledger.unplace(0, 0)
    assert ledger.place(2, 0).source == "new"  # another tenant never gets it
    again = ledger.place(1, 3)
    assert (again.chunk, again.source) == (first.chunk, "idle")  # the same tenant may


def test_a_draining_chunk_goes_back_only_to_its_own_place():
    ledger = ChunkLedger()
    ledger.add_class(0, "a")
    placed = ledger.place(0, 2)
    ledger.open_view(7, 0)
    ledger.sent(7, [placed.chunk])
    chunk, viewers = ledger.unplace(0, 2)
    assert viewers == [7] and chunk in ledger.draining
    assert ledger.place(0, 1).chunk != chunk  # another index: a fresh chunk
    back = ledger.place(0, 2)
    assert (back.chunk, back.source) == (chunk, "draining")
    ledger.unplace(0, 2)
    ledger.acked(7, [])
    assert ledger.take_idle() == [chunk]  # let go of: now it can go back to the GPU


def test_a_class_with_chunks_cannot_be_dropped():
    ledger = ChunkLedger()
    ledger.add_class(0, "")
    ledger.place(0, 0)
    with pytest.raises(ValueError):
        ledger.drop_class(0)
    ledger.unplace(0, 0)
    ledger.drop_class(0)
    assert ledger.live_chunks() == 1 and ledger.take_idle() and ledger.live_chunks() == 0


def test_a_dropped_class_id_reused_never_gets_a_chunk_still_draining():
    ledger = ChunkLedger()
    ledger.add_class(0, "a")
    old = ledger.place(0, 0).chunk
    ledger.open_view(7, 0)
    ledger.sent(7, [old])
    ledger.unplace(0, 0)
    ledger.drop_class(0)
    ledger.add_class(0, "b")  # the id is given to another tenant's class
    assert ledger.place(0, 0).chunk != old
    ledger.check()
