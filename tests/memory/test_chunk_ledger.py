"""The CUDA VMM chunk ledger: the safety rule as a state machine (pure; runs without a GPU)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from hypothesis import settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvpoold.memory.chunk_ledger import ChunkLedger
from kvpoold.server.chunk_sync import ChunkSync

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
        self.backend = SimpleNamespace(ledger=self.ledger, export=lambda chunk: -1, settle=lambda: None)
        self.pending: dict[int, tuple] = {}  # viewer -> (its ChunkSync, (index, chunk) pairs still to send)
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

    @precondition(lambda self: set(self.viewer_class) - set(self.pending))
    @rule(data=st.data())
    def begin_sync(self, data):
        """The daemon's answer (step 1 of the dialog): the client unmaps what left its place, wants the rest."""
        v = data.draw(st.sampled_from(sorted(set(self.viewer_class) - set(self.pending))))
        sync = ChunkSync(self.backend, v, self.viewer_class[v])
        mine = self.client_maps[v]
        for i in [i for i, c in mine.items() if sync.places.get(i) != c]:
            del mine[i]
        self.pending[v] = (sync, [(i, c) for i, c in sync.places.items() if mine.get(i) != c])

    @precondition(lambda self: self.pending)
    @rule(data=st.data())
    def deliver_batch(self, data):
        """One batch of descriptors, or ``moved``; the daemon's other work may run between two batches."""
        v = data.draw(st.sampled_from(sorted(self.pending)))
        sync, wanted = self.pending[v]
        size = data.draw(st.integers(1, 3))
        batch, rest = wanted[:size], wanted[size:]
        if batch and not sync.still_placed([c for _, c in batch]):
            del self.pending[v]  # moved: the dialog ends; the client starts again later
            return
        sync.export([c for _, c in batch])
        self.client_maps[v].update(batch)
        self.pending[v] = (sync, rest)
        if not rest:
            del self.pending[v]
            if data.draw(st.booleans()):
                sync.ack()

    @precondition(lambda self: self.pending)
    @rule(data=st.data())
    def break_sync(self, data):
        """The dialog breaks off: the client keeps what it mapped (the daemon counts it as mapped)."""
        del self.pending[data.draw(st.sampled_from(sorted(self.pending)))]

    @precondition(lambda self: self.viewer_class)
    @rule(data=st.data())
    def detach(self, data):
        v = data.draw(st.sampled_from(sorted(self.viewer_class)))
        del self.viewer_class[v]
        del self.client_maps[v]
        self.pending.pop(v, None)
        self.ledger.forget(v)

    @invariant()
    def consistent(self):
        self.ledger.check()
        for v, mapping in self.client_maps.items():
            assert set(mapping.values()) <= self.ledger.maybe[v], "a client maps a chunk the ledger forgot"
            for i, c in mapping.items():
                home = (self.viewer_class[v], i)
                assert home in (self.ledger.where.get(c), self.ledger.draining.get(c)), \
                    f"a client maps chunk {c} at {home}, which the daemon gave to {self.ledger.where.get(c)}"


TestLedger = LedgerMachine.TestCase
TestLedger.settings = settings(max_examples=400, stateful_step_count=60, deadline=None)


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


def test_a_chunk_that_left_its_place_during_a_sync_is_not_sent():
    """The daemon's answer lists a chunk; before the client asks for it, it leaves its place unmapped by anyone
    and backs another class's place. Sending it would let two places share memory."""
    ledger = ChunkLedger()
    ledger.add_class(0, "a")
    ledger.add_class(1, "a")
    backend = SimpleNamespace(ledger=ledger, export=lambda chunk: -1, settle=lambda: None)
    chunk = ledger.place(0, 2).chunk
    sync = ChunkSync(backend, 7, 0)
    assert sync.places == {2: chunk} and sync.still_placed([chunk])
    ledger.unplace(0, 2)
    assert ledger.place(1, 0).chunk == chunk  # reused at once: nobody mapped it
    assert not sync.still_placed([chunk])
    again = ChunkSync(backend, 7, 0)  # the client starts again: the place is empty now
    assert again.places == {}
