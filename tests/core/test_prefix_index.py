"""PrefixIndex against a model: a hypothesis state machine (register, confirm, forget, lookup)."""

from __future__ import annotations

import hypothesis.strategies as st
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from kvpoold.core.prefix_index import PrefixIndex

BLOCKS = st.integers(0, 15)
DIGESTS = st.sampled_from([bytes([i]) * 16 for i in range(12)])
WRITERS = st.one_of(st.none(), st.integers(1, 3))


class PrefixIndexMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.index = PrefixIndex()
        self.model: dict[int, bytes] = {}  # block -> hash
        self.writer: dict[int, int] = {}  # unwritten block -> its writer

    def _register(self, block: int, digest: bytes, writer) -> bool:
        if digest in self.model.values():
            return False
        self.model[block] = digest
        if writer is not None:
            self.writer[block] = writer
        return True

    @rule(block=BLOCKS, digest=DIGESTS, writer=WRITERS)
    def register(self, block, digest, writer):
        if block in self.model:
            return  # callers register only blocks without a hash
        assert self.index.register(block, digest, writer) == self._register(block, digest, writer)

    @rule(pairs=st.lists(st.tuples(BLOCKS, DIGESTS), max_size=6, unique_by=lambda p: p[0]), writer=WRITERS)
    def register_many(self, pairs, writer):
        pairs = [(b, h) for b, h in pairs if b not in self.model]
        expect = [b for b, h in pairs if self._register(b, h, writer)]
        assert self.index.register_many([b for b, _ in pairs], [h for _, h in pairs], writer) == expect

    @rule(blocks=st.lists(BLOCKS, max_size=6), writer=st.integers(1, 3))
    def confirm(self, blocks, writer):
        self.index.confirm(blocks, writer)
        for b in blocks:
            if self.writer.get(b) == writer:
                del self.writer[b]

    @rule(blocks=st.lists(BLOCKS, max_size=6), writer=st.integers(1, 3))
    def forget_unwritten(self, blocks, writer):
        self.index.forget_unwritten(blocks, writer)
        for b in blocks:
            if self.writer.get(b) == writer:
                del self.writer[b], self.model[b]

    @rule(block=BLOCKS)
    def forget(self, block):
        assert self.index.forget(block) == self.model.pop(block, None)
        self.writer.pop(block, None)

    @rule(blocks=st.lists(BLOCKS, max_size=6, unique=True))
    def forget_many(self, blocks):
        blocks = [b for b in blocks if b in self.model]
        assert self.index.forget_many(blocks) == [self.model.pop(b) for b in blocks]
        for b in blocks:
            self.writer.pop(b, None)

    @rule(digest=DIGESTS, owner=WRITERS)
    def lookup(self, digest, owner):
        block = next((b for b, h in self.model.items() if h == digest), None)
        assert self.index.lookup(digest) == block
        if block is not None:
            assert self.index.visible(block, owner) == (self.writer.get(block) in (None, owner))

    @rule(digests=st.lists(DIGESTS, max_size=6), owner=WRITERS)
    def visible_prefix(self, digests, owner):
        blocks = self.index.lookup_many(digests)
        expect = []
        for b in blocks:
            if b is not None and self.writer.get(b) not in (None, owner):
                break
            expect.append(b)
        assert self.index.visible_prefix(blocks, owner) == expect

    @invariant()
    def agrees(self):
        self.index.check()
        assert dict(self.index.digest_items()) == {h: b for b, h in self.model.items()}
        assert dict(self.index.unwritten_items()) == self.writer
        assert set(self.index.blocks()) == set(self.model)


PrefixIndexMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
test_prefix_index = PrefixIndexMachine.TestCase
