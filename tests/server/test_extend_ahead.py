"""Tokens of unknown id (``Client.extend_ahead``) against a real daemon: they get blocks and slots at once, no call
to the daemon ever carries one, and the daemon caches the ids ``fill_token`` gave them."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

import kvpool
from daemonlib import Daemon
from kvpool.errors import FailedPrecondition, InvalidArgument

BLOCK = 4
LAYOUT = kvpool.Layout("ahead", num_layers=1, num_kv_heads=1, head_dim=4, dtype="float32", block_size=BLOCK)
TOKENS = st.integers(0, 255)


class ExtendAhead(RuleBasedStateMachine):
    """The model: each live sequence's tokens, ``None`` where the id is not known yet."""

    @initialize(flush_every=st.sampled_from([2, 4, 32]))
    def attach(self, flush_every):
        self.daemon = Daemon("--pool-bytes", str(4 << 20)).start()
        self.client = kvpool.connect(self.daemon.socket, name="ahead", layout=LAYOUT, flush_every=flush_every)
        self.seqs: dict = {}  # Sequence -> list of token ids (None: unknown)
        self.freed: list[list[int]] = []

    def teardown(self):
        try:
            for toks in self.freed:
                full = len(toks) // BLOCK * BLOCK
                assert self.client.lookup(toks + [256]) >= full, f"the daemon lost or garbled {toks}"
            self.client.close()
        finally:
            self.daemon.stop()

    def _unknown(self) -> bool:
        return any(None in toks for toks in self.seqs.values())

    def _check_refused(self, call, seqs) -> bool:
        """Run ``call``; it may refuse only while a token is unknown, and then changes nothing."""
        before = {s: (s.num_tokens, self.client.block_ids(s)) for s in seqs}
        try:
            call()
        except FailedPrecondition as exc:
            assert self._unknown(), f"refused with every id known: {exc}"
            assert "not known yet" in exc.message
            assert {s: (s.num_tokens, self.client.block_ids(s)) for s in seqs} == before
            return True
        return False

    @precondition(lambda self: len(self.seqs) < 3)
    @rule(prompt=st.lists(TOKENS, min_size=1, max_size=9))
    def create(self, prompt):
        self.seqs[self.client.create_sequence(prompt)] = list(prompt)  # a Create carries no queued token

    @precondition(lambda self: self.seqs)
    @rule(data=st.data(), toks=st.lists(TOKENS, min_size=1, max_size=6))
    def extend(self, data, toks):
        seq = data.draw(st.sampled_from(sorted(self.seqs, key=lambda s: s.id)))
        if not self._check_refused(lambda: self.client.extend({seq: toks}), list(self.seqs)):
            self.seqs[seq] += toks

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def extend_ahead(self, data):
        pool = sorted(self.seqs, key=lambda s: s.id)
        chosen = data.draw(st.lists(st.sampled_from(pool), min_size=1, max_size=len(pool), unique=True))
        if self.client.can_extend_ahead(chosen):
            self.client.extend_ahead(chosen)
            for seq in chosen:
                self.seqs[seq].append(None)
        else:
            with pytest.raises(InvalidArgument, match="can_extend_ahead"):
                self.client.extend_ahead(chosen)

    @precondition(lambda self: self._unknown())
    @rule(data=st.data(), token=TOKENS)
    def fill(self, data, token):
        seq = data.draw(st.sampled_from(sorted((s for s, t in self.seqs.items() if None in t), key=lambda s: s.id)))
        position = data.draw(st.sampled_from([i for i, t in enumerate(self.seqs[seq]) if t is None]))
        self.client.fill_token(seq, position, token)
        self.seqs[seq][position] = token

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def drop_unknown(self, data):
        seq = data.draw(st.sampled_from(sorted(self.seqs, key=lambda s: s.id)))
        toks, trailing = self.seqs[seq], 0
        while trailing < len(toks) and toks[-1 - trailing] is None:
            trailing += 1
        assert self.client.drop_unknown([seq]) == trailing
        del toks[len(toks) - trailing:]

    @rule()
    def flush(self):
        self._check_refused(self.client.flush, list(self.seqs))
        if not self._unknown():
            self.client.flush()  # known ids never block a call

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def free(self, data):
        seq = data.draw(st.sampled_from(sorted(self.seqs, key=lambda s: s.id)))
        if not self._check_refused(lambda: self.client.free(seq), list(self.seqs)):
            self.freed.append(self.seqs.pop(seq))

    @invariant()
    def mirror_matches(self):
        for seq, toks in getattr(self, "seqs", {}).items():
            assert seq.num_tokens == len(toks)
            assert len(self.client.block_ids(seq)) >= -(-len(toks) // BLOCK)


ExtendAhead.TestCase.settings = settings(max_examples=20, stateful_step_count=30, deadline=None,
                                         suppress_health_check=[HealthCheck.too_slow])
test_extend_ahead_state_machine = pytest.mark.timeout(600)(ExtendAhead.TestCase)


def test_a_refused_call_leaves_the_unknown_token_in_place_and_a_filled_one_reaches_the_cache(daemon):
    with kvpool.connect(daemon.socket, name="ahead", layout=LAYOUT) as client:
        seq = client.create_sequence([1, 2, 3, 4, 5])
        client.extend_ahead([seq])
        with pytest.raises(FailedPrecondition, match="not known yet"):
            client.free(seq)
        assert seq.num_tokens == 6
        with pytest.raises(InvalidArgument, match="no token of unknown id"):
            client.fill_token(seq, 4, 9)  # position 4 is a prompt token
        client.fill_token(seq, 5, 42)
        client.extend({seq: [7, 8]})
        client.free(seq)
        assert client.lookup([1, 2, 3, 4, 5, 42, 7, 8, 0]) == 8
        assert client.lookup([1, 2, 3, 4, 5, 43, 7, 8, 0]) == 4
