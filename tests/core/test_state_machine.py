"""A hypothesis state machine over the core, checked against a simple model.

The model is what a client would see: each sequence's token list.  A fake
"device memory" (block -> tokens written there) is updated the way a client
updates the real pool: it writes the tokens it was not told are cached, and
runs copy-on-write copies before writing.  A fake "lower tier store" (key ->
tokens) is updated by the core's planned moves, in the order the transfer
engine runs them (device writes after everything else of the call).  After
every step each live sequence must read back exactly its own tokens through
its block table, and every hashed block, on the device or in a lower tier,
must hold the tokens its hash names: this proves prefix sharing,
copy-on-write, eviction, demotion, promotion and swapping never mix data up.
"""

from __future__ import annotations

import hypothesis.strategies as st
import pytest
from hypothesis import HealthCheck, event, settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvpoold.core import (
    ExtendItem,
    InvalidArgument,
    Geometry,
    KVCacheManager,
    KvpoolError,
    OutOfBlocks,
    Tier,
    WrongState,
)
from kvpoold.core.hashing import chain_hashes, pack_tokens, root_hash

from helpers import snapshot

# a small alphabet and a few shared stems make prefix hits frequent
STEMS = [[1, 2, 3, 4, 5, 6, 7, 8, 9], [1, 2, 3, 4, 9, 9], [5, 5, 5, 5, 5, 5, 5, 5]]
tokens = st.lists(st.integers(0, 6), max_size=12)
prompts = st.one_of(
    tokens, st.builds(lambda i, t: STEMS[i] + t, st.integers(0, len(STEMS) - 1), tokens)
)
OWNERS = (1, 2)


class CoreMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.m: KVCacheManager | None = None

    @initialize(
        bs=st.sampled_from([1, 2, 4]),
        chunks=st.integers(1, 12),
        two_classes=st.booleans(),
        host=st.integers(0, 3),
        disk=st.integers(0, 4),
    )
    def setup(self, bs, chunks, two_classes, host, disk):
        g = Geometry(1, 1, 4, "float16", bs)  # 16*bs bytes per block
        self.base_bs = bs
        self.m = KVCacheManager(chunks * 128, chunk_bytes=128, host_bytes=host * 16 * bs, disk_bytes=disk * 16 * bs,
                                max_reserve_blocks=3)
        self.cls = [self.m.register_class(g)]
        if two_classes:
            self.cls.append(self.m.register_class(Geometry(1, 1, 4, "float16", 2 * bs)))
        self.memory: dict[tuple[int, int], list] = {}
        self.tokens: dict[int, list[int]] = {}  # seq id -> tokens (the model)
        self.owner_of: dict[int, int] = {}
        self.class_of: dict[int, int] = {}
        self.model_of: dict[int, str] = {}
        self.known: set[tuple[int, str, tuple]] = set()  # full-block prefixes ever written
        self.store: dict[tuple, list] = {}  # lower-tier key -> tokens (the fake host/disk bytes)
        self.expected: dict[bytes, list] = {}  # block hash -> the tokens of that block
        self.swapped: set[int] = set()
        self.holds: list[tuple[int, list[int]]] = []

    # -- helpers -----------------------------------------------------------------
    def bs(self, cls):
        return self.m.classes[cls].block_size

    def write(self, seq_id, table, start, toks):
        cls, bs = self.class_of[seq_id], self.bs(self.class_of[seq_id])
        for pos, t in enumerate(toks, start):
            cell = self.memory.setdefault((cls, table[pos // bs]), [None] * bs)
            cell[pos % bs] = t

    def guarded(self, fn, expected=(OutOfBlocks,)):
        """Run a core call; on an error the state must be exactly as before."""
        before = snapshot(self.m)
        try:
            out = fn()
        except KvpoolError as exc:
            assert snapshot(self.m) == before, f"{type(exc).__name__} left the state changed"
            assert isinstance(exc, expected), exc
            event(f"refused: {type(exc).__name__}")
            return None
        self.apply_moves()
        return out

    def apply_moves(self):
        """Run the planned tier moves on the fake bytes, in the transfer engine's order."""
        writes = []
        for mv in self.m.drain_moves():
            if mv.dst == Tier.DEVICE:
                writes.append(mv)  # the engine runs device writes after the call's other moves
            elif mv.src == Tier.DEVICE:
                if mv.dst is not None:
                    cls = mv.key[0]
                    self.store[mv.key] = list(self.memory.get((cls, mv.block), [None] * self.bs(cls)))
                    event("demoted" if isinstance(mv.key[1], bytes) else "swapped out")
            else:
                data = self.store.pop(mv.key)
                if mv.dst is not None:
                    self.store[mv.key] = data
                    event("pushed to disk")
                else:
                    event("dropped from a lower tier")
        for mv in writes:
            self.memory[(mv.key[0], mv.block)] = list(self.store.pop(mv.key))
            event("promoted" if isinstance(mv.key[1], bytes) else "swapped in")

    # -- rules ---------------------------------------------------------------------
    @rule(owner=st.sampled_from(OWNERS), prompt=prompts, which=st.integers(0, 1), model=st.sampled_from("ab"))
    def create(self, owner, prompt, which, model):
        cls = self.cls[which % len(self.cls)]
        info = self.guarded(lambda: self.m.create(owner, cls, model, prompt))
        if info is None:
            return
        bs = self.bs(cls)
        if info.num_cached_tokens:
            event("prefix hit")
        # a hit can only be a prefix that some sequence wrote earlier
        assert info.num_cached_tokens % bs == 0
        for n in range(bs, info.num_cached_tokens + 1, bs):
            assert (cls, model, tuple(prompt[:n])) in self.known
        self.tokens[info.seq_id] = list(prompt)
        self.owner_of[info.seq_id] = owner
        self.class_of[info.seq_id] = cls
        self.model_of[info.seq_id] = model
        self.write(info.seq_id, info.block_table, info.num_cached_tokens, prompt[info.num_cached_tokens:])
        self._learn(info.seq_id, model)

    @precondition(lambda self: self.known)
    @rule(data=st.data(), owner=st.sampled_from(OWNERS), more=tokens)
    def create_known(self, data, owner, more):
        """A prompt that was written before: prefix hits on every tier, promotions."""
        cls, model, prefix = data.draw(st.sampled_from(sorted(self.known)))
        self.create(owner=owner, prompt=list(prefix) + more, which=self.cls.index(cls), model=model)

    def _learn(self, seq_id, model):
        toks, cls = self.tokens[seq_id], self.class_of[seq_id]
        bs = self.bs(cls)
        for n in range(bs, len(toks) + 1, bs):
            self.known.add((cls, model, tuple(toks[:n])))
        hashes = chain_hashes(root_hash(model), pack_tokens(toks), bs)
        for i, h in enumerate(hashes):
            self.expected[h] = list(toks[i * bs:(i + 1) * bs])

    def _live(self, owner=None, swapped=False):
        return sorted(s for s, o in self.owner_of.items()
                      if (owner is None or o == owner) and (swapped or s not in self.swapped))

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), owner=st.sampled_from(OWNERS))
    def extend(self, data, owner):
        live = self._live(owner)
        if not live:
            return
        cls = self.class_of[data.draw(st.sampled_from(live))]
        live = [s for s in live if self.class_of[s] == cls]  # one layout class per call
        chosen = data.draw(st.lists(st.sampled_from(live), unique=True, min_size=1, max_size=4))
        batch = {s: data.draw(tokens) for s in chosen}
        res = self.guarded(lambda: self.m.extend(owner, batch))
        if res is None:
            return
        self._apply(res, batch)

    def _apply(self, res, batch):
        if res.copies:
            event("copy-on-write")
        for copy in res.copies:
            self.memory[(copy.class_id, copy.dst)] = list(self.memory[(copy.class_id, copy.src)])
        changed = {d.seq_id: d for d in res.deltas}
        for seq_id, new in batch.items():
            table = self.m.sequence(self.owner_of[seq_id], seq_id).block_table
            d = changed.get(seq_id)
            if d is not None:
                assert table[d.first:] == d.blocks
                assert len(d.blocks) + d.first == len(table)
            else:  # unchanged table: the new tokens fit in the old last block
                assert len(table) == -(-(len(self.tokens[seq_id]) + len(new)) // self.bs(self.class_of[seq_id]))
            start = len(self.tokens[seq_id])
            self.tokens[seq_id] += list(new)
            self.write(seq_id, table, start, new)
            self._learn(seq_id, self.model_of[seq_id])

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), owner=st.sampled_from(OWNERS), n=st.integers(0, 9))
    def extend_with_reserve(self, data, owner, n):
        live = [s for s in self._live(owner)]
        if not live:
            return
        seq = data.draw(st.sampled_from(live))
        cls = self.class_of[seq]
        self.m.grant_reserve(owner, cls, 3)
        info = self.m.sequence(owner, seq)
        bs = self.bs(cls)
        grow = -(-(info.num_tokens + n) // bs) - len(info.block_table)
        shared_tail = info.num_tokens % bs and n and self.m.classes[cls].is_shared(info.block_table[-1])
        reserve = self.m.reserve(owner, cls)
        if shared_tail:
            return
        toks = data.draw(st.lists(st.integers(0, 6), min_size=n, max_size=n))
        take = min(grow, len(reserve))  # claims may cover only the first new blocks
        res = self.guarded(lambda: self.m.extend(owner, [ExtendItem(seq, toks, claimed=reserve[:take])]))
        if res is None:
            return
        event("reserve claimed" if take == grow > 0 else "partly claimed" if take else "reserve not needed")
        self._apply(res, {seq: toks})

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def fork(self, data):
        if self._live():
            self._fork(data.draw(st.sampled_from(self._live())))

    def _fork(self, seq):
        owner = self.owner_of[seq]
        info = self.m.fork(owner, seq)
        self.apply_moves()
        self.tokens[info.seq_id] = list(self.tokens[seq])
        self.owner_of[info.seq_id] = owner
        self.class_of[info.seq_id] = self.class_of[seq]
        self.model_of[info.seq_id] = self.model_of[seq]
        return info.seq_id

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), new=st.lists(st.integers(0, 6), min_size=1, max_size=5), child_first=st.booleans())
    def fork_and_append(self, data, new, child_first):
        """Parallel sampling: two continuations of one prefix (copy-on-write when partly full)."""
        if not self._live():
            return
        seq = data.draw(st.sampled_from(self._live()))
        child = self._fork(seq)
        owner = self.owner_of[seq]
        for s in ((child, seq) if child_first else (seq, child)):
            res = self.guarded(lambda: self.m.extend(owner, {s: new}))
            if res is not None:
                self._apply(res, {s: new})

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def free(self, data):
        seq = data.draw(st.sampled_from(self._live(swapped=True)))
        self.m.free(self.owner_of[seq], [seq])
        self.apply_moves()
        for d in (self.tokens, self.owner_of, self.class_of, self.model_of):
            del d[seq]
        self.swapped.discard(seq)

    @rule(owner=st.sampled_from(OWNERS))
    def drop_owner(self, owner):
        self.m.drop_owner(owner)
        self.apply_moves()
        for seq in self._live(owner, swapped=True):
            for d in (self.tokens, self.owner_of, self.class_of, self.model_of):
                del d[seq]
            self.swapped.discard(seq)

    @rule(prompt=prompts, model=st.sampled_from("ab"))
    def lookup(self, prompt, model):
        cls = self.cls[0]
        r = self.m.lookup(cls, model, prompt)
        bs = self.bs(cls)
        for n in range(bs, r.num_cached_tokens + 1, bs):
            assert (cls, model, tuple(prompt[:n])) in self.known

    @rule(n=st.integers(0, 3))
    def evict(self, n):
        if self.m.evict_cached(None, n):
            event("evicted")
        self.apply_moves()

    # -- tiers: swapping, transfer holds, lost blocks ------------------------------------
    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def swap_out(self, data):
        live = self._live()
        if not live:
            return
        owner = self.owner_of[data.draw(st.sampled_from(live))]
        chosen = data.draw(st.lists(st.sampled_from(self._live(owner)), unique=True, min_size=1, max_size=3))
        r = self.guarded(lambda: self.m.swap_out(owner, chosen), (OutOfBlocks, WrongState))
        if r is None:
            return
        self.swapped.update(chosen)
        for seq in chosen:
            info = self.m.sequence(owner, seq)
            assert info.swapped and info.block_table == () and info.num_tokens == len(self.tokens[seq])

    @precondition(lambda self: self.swapped)
    @rule(data=st.data())
    def swap_in(self, data):
        first = data.draw(st.sampled_from(sorted(self.swapped)))
        owner, cls = self.owner_of[first], self.class_of[first]
        same = sorted(s for s in self.swapped if self.owner_of[s] == owner and self.class_of[s] == cls)
        chosen = data.draw(st.lists(st.sampled_from(same), unique=True, min_size=1, max_size=3))
        infos = self.guarded(lambda: self.m.swap_in(owner, chosen))
        if infos is None:
            return
        self.swapped.difference_update(chosen)
        for info in infos:
            assert not info.swapped and len(info.block_table) == -(-info.num_tokens // self.bs(cls))

    @precondition(lambda self: self.swapped)
    @rule(data=st.data(), new=st.lists(st.integers(0, 6), min_size=1, max_size=3))
    def swapped_sequences_refuse_extend_and_fork(self, data, new):
        seq = data.draw(st.sampled_from(sorted(self.swapped)))
        owner = self.owner_of[seq]
        self.guarded(lambda: self.m.extend(owner, {seq: new}), (WrongState,))
        self.guarded(lambda: self.m.fork(owner, seq), (WrongState,))
        self.guarded(lambda: self.m.swap_out(owner, [seq]), (WrongState,))

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def hold_blocks(self, data):
        live = [s for s in self._live() if len(self.tokens[s])]
        if not live:
            return
        seq = data.draw(st.sampled_from(live))
        table = self.m.sequence(self.owner_of[seq], seq).block_table
        chosen = data.draw(st.lists(st.sampled_from(table), min_size=1, max_size=3))
        self.m.hold_blocks(self.class_of[seq], chosen)
        self.holds.append((self.class_of[seq], chosen))

    @precondition(lambda self: self.holds)
    @rule(data=st.data())
    def release_holds(self, data):
        cls, blocks = self.holds.pop(data.draw(st.integers(0, len(self.holds) - 1)))
        self.m.release_holds(cls, blocks)
        self.apply_moves()

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def lose_a_block(self, data):
        """The bytes of a block did not arrive: its hash is forgotten, its holders rewrite it."""
        live = [s for s in self._live() if len(self.tokens[s]) >= self.bs(self.class_of[s])]
        if not live:
            return
        seq = data.draw(st.sampled_from(live))
        table = self.m.sequence(self.owner_of[seq], seq).block_table
        if self.m.invalidate_block(self.class_of[seq], table[0]):
            event("hash forgotten")

    # -- classes: drop, evict whole, re-register ----------------------------------------
    @rule(which=st.integers(0, 1), evict_first=st.booleans())
    def drop_class(self, which, evict_first):
        """Drop a class once nothing of it is left (evicting its whole cache first if idle); its id is reused."""
        cls = self.cls[which % len(self.cls)]
        if evict_first and self.m.holds_nothing_in(cls):
            self.m.evict_class(cls)
            self.apply_moves()
            event("class evicted whole")
        if not self.m.can_drop_class(cls):
            self.guarded(lambda: self.m.drop_class(cls), (WrongState,))
            return
        pool = self.m.classes[cls]
        slots = set(pool.slots)
        free_before = self.m.budget.free
        self.m.drop_class(cls)
        assert self.m.budget.free == free_before + len(slots) * pool.slab_chunks
        released = {(c, off) for kind, c, off, _ in self.m.drain_slab_changes() if kind == "release"}
        span = pool.blocks_per_slab * pool.block_bytes
        assert {(cls, s * span) for s in slots} <= released, "a dropped class's slabs were not released"
        assert all(c.class_id != cls for c in self.m.stats().classes), "stats list a dropped class"
        with pytest.raises(InvalidArgument):
            self.m.class_pool(cls)
        # released memory reads zeros: the fake bytes of the class are gone, and so are its prefixes
        self.memory = {k: v for k, v in self.memory.items() if k[0] != cls}
        self.known = {k for k in self.known if k[0] != cls}
        event("class dropped")
        self.register_again(which, cls)

    def register_again(self, which, dropped):
        self.generation = getattr(self, "generation", 0) + 1  # a geometry never seen before
        geometry = Geometry(1, 1, 4, "float16", self.base_bs * (1 + which), tenant=f"t{self.generation}")
        lowest = min(c for c, p in enumerate(self.m.classes) if p.geometry is None)
        cid = self.m.register_class(geometry)
        assert cid == lowest, f"a new class took id {cid}, not the lowest vacant one {lowest}"
        assert self.m.register_class(geometry) == cid
        self.cls[self.cls.index(dropped)] = cid
        if len(set(self.cls)) < len(self.cls):  # both slots named the dropped class
            self.cls = [cid]

    # -- invariants ------------------------------------------------------------------
    @invariant()
    def consistent(self):
        assert not self.m._moves, "moves left unrun"
        self.m.check_invariants()
        assert {self.m.seqs.seq_id(i) for i in self.m.seqs.live_slots().tolist()} == set(self.tokens)
        for seq, toks in self.tokens.items():
            cls, bs = self.class_of[seq], self.bs(self.class_of[seq])
            info = self.m.sequence(self.owner_of[seq], seq)
            assert info.num_tokens == len(toks)
            assert info.swapped == (seq in self.swapped)
            if info.swapped:
                continue
            read = [self.memory[(cls, info.block_table[p // bs])][p % bs] for p in range(len(toks))]
            assert read == toks, f"sequence {seq} reads {read}, expected {toks}"
        # the fake lower tiers hold exactly the placed keys, and every hashed block its tokens
        placed = {k for index in self.m.placement.lower for k in index._sizes}
        assert placed == set(self.store), "lower-tier bytes differ from the placement"
        for key, data in self.store.items():
            if isinstance(key[1], bytes):
                assert data == self.expected[key[1]], f"lower-tier block {key} holds {data}"
        assert len(self.m.classes) <= 2, "dropped ids were not reused"
        for pool in self.m.classes:
            for digest, b in pool.prefix.digest_items():
                assert self.memory[(pool.class_id, b)] == self.expected[digest], f"device block {b} is wrong"

    def teardown(self):
        if self.m is None:
            return
        for cls, blocks in self.holds:
            self.m.release_holds(cls, blocks)
        for owner in OWNERS:
            self.m.drop_owner(owner)
        st_ = self.m.stats()
        self.m.check_invariants()
        assert st_.sequences == 0
        assert all(c.used_blocks == 0 for c in st_.classes)  # only free or cached remain


TestCoreMachine = CoreMachine.TestCase
TestCoreMachine.settings = settings(
    max_examples=300, stateful_step_count=40, deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
