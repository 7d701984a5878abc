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
    InvalidArgument,
    KVCacheManager,
    KvpoolError,
    OutOfBlocks,
    Tier,
    WrongState,
)
from kvpoold.core.elastic import empty_slots
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
        head_dim=st.sampled_from([4, 3]),
        room=st.integers(0, 8),
        exact=st.booleans(),
        remote=st.sampled_from(["", "through", "evict"]),
    )
    def setup(self, bs, chunks, two_classes, host, disk, head_dim, room, exact, remote):
        # head_dim 4: 16*bs bytes a block, slabs filled exactly; 3: 12*bs bytes, slabs with a tail unless exact
        # (then 3 chunks each); ``room``: chunks the pool may grow by
        block_bytes = 4 * head_dim * bs
        self.base_bs = bs
        limit = max(chunks + room, 3 if exact else 1)
        self.m = KVCacheManager(chunks * 128, chunk_bytes=128, host_bytes=host * block_bytes,
                                disk_bytes=disk * block_bytes, max_reserve_blocks=3, max_pool_bytes=limit * 128,
                                exact_slabs=exact, remote_write=remote)
        self.cls = [self.m.register_class(Geometry(1, 1, head_dim, "float16", bs))]
        if two_classes:
            self.cls.append(self.m.register_class(Geometry(1, 1, head_dim, "float16", 2 * bs)))
        self.exact = exact
        self.clock = 0.0
        self.mapped: dict[int, set[int]] = {c: set() for c in self.cls}  # slots the fake backend backs
        self.memory: dict[tuple[int, int], list] = {}
        self.tokens: dict[int, list[int]] = {}  # seq id -> tokens (the model)
        self.owner_of: dict[int, int] = {}
        self.class_of: dict[int, int] = {}
        self.model_of: dict[int, str] = {}
        self.known: set[tuple[int, str, tuple]] = set()  # full-block prefixes ever written
        self.store: dict[tuple, list] = {}  # lower-tier key -> tokens (the fake host/disk bytes)
        self.remote: dict[tuple, list] = {}  # remote-tier key -> tokens (what other daemons could read too)
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
        moves = self.m.drain_moves()
        for mv in moves:
            if mv.dst == Tier.DEVICE:
                writes.append(mv)  # the engine runs device writes after the call's other moves
            elif mv.dst == Tier.REMOTE:  # a copy: the source keeps a device block, drops a host slot
                cls = mv.key[0]
                if mv.src == Tier.DEVICE:
                    self.remote[mv.key] = list(self.memory.get((cls, mv.block), [None] * self.bs(cls)))
                else:
                    self.remote[mv.key] = self.store.pop(mv.key)
                event(f"to the remote tier from {mv.src.name.lower()}")
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
        self.apply_slabs()  # as the daemon does: after the device reads, before the device writes
        for mv in writes:
            if mv.src == Tier.REMOTE:
                self.memory[(mv.key[0], mv.block)] = list(self.remote[mv.key])
                event("promoted from the remote tier")
                continue
            self.memory[(mv.key[0], mv.block)] = list(self.store.pop(mv.key))
            event("promoted" if isinstance(mv.key[1], bytes) else "swapped in")

    def apply_slabs(self):
        """Map and unmap slabs as the memory backend does: a released range loses its bytes."""
        for kind, cls, offset, nbytes in self.m.drain_slab_changes():
            pool = self.m.classes[cls]
            slot, rest = divmod(offset, pool.span)
            assert rest == 0 and nbytes == pool.span, "a slab's range is not its blocks' bytes"
            assert offset + nbytes <= pool.num_block_ids * pool.block_bytes, "a slab past the id space"
            if self.exact:
                assert offset % self.m.budget.chunk_bytes == 0 and nbytes == pool.slab_bytes, "an inexact slab"
            if kind == "take":
                assert slot not in self.mapped[cls], f"slab {slot} mapped twice"
                self.mapped[cls].add(slot)
                continue
            assert slot in self.mapped[cls], f"slab {slot} released but not mapped"
            self.mapped[cls].remove(slot)
            first, last = offset // pool.block_bytes, -(-(offset + nbytes) // pool.block_bytes)
            for b in range(first, last):
                self.memory.pop((cls, b), None)
            event("slab released")

    # -- rules ---------------------------------------------------------------------
    @rule(owner=st.sampled_from(OWNERS), prompt=prompts, which=st.integers(0, 1), model=st.sampled_from("ab"),
          ask_remote=st.booleans())
    def create(self, owner, prompt, which, model, ask_remote=False):
        cls = self.cls[which % len(self.cls)]
        # what the remote tier would answer for this class (the daemon fetches it before the call)
        remote = {k[1]: None for k in self.remote if k[0] == cls} if ask_remote and self.remote else None
        info = self.guarded(lambda: self.m.create(owner, cls, model, prompt, remote=remote))
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
    @rule(data=st.data(), owner=st.sampled_from(OWNERS), more=tokens, ask_remote=st.booleans())
    def create_known(self, data, owner, more, ask_remote):
        """A prompt that was written before: prefix hits on every tier, promotions."""
        cls, model, prefix = data.draw(st.sampled_from(sorted(self.known)))
        self.create(owner=owner, prompt=list(prefix) + more, which=self.cls.index(cls), model=model,
                    ask_remote=ask_remote)

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
        self.apply_moves()
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

    # -- an elastic pool --------------------------------------------------------------
    def held(self):
        return [pool.held_blocks for pool in self.m.classes]

    @rule(chunks=st.integers(0, 22), odd=st.integers(0, 127))
    def resize(self, chunks, odd):
        m, budget = self.m, self.m.budget
        held, before, evictions = self.held(), budget.total, sum(p.evictions for p in m.classes)
        r = self.guarded(lambda: m.resize(chunks * 128 + odd), (InvalidArgument,))
        if r is None:
            assert chunks > budget.limit
            return
        assert self.held() == held, "a resize took held blocks"
        assert r.pool_bytes == budget.total * 128 and r.target_bytes == chunks * 128 + odd
        assert r.evicted_blocks == sum(p.evictions for p in m.classes) - evictions
        if chunks >= before:
            assert r.met and budget.total == chunks and r.freed_chunks == 0
            event("grown" if chunks > before else "same size")
            return
        assert chunks <= budget.total <= before and r.met == (budget.total == chunks)
        if not r.met:  # stopped short: every chunk left is a slab with a held block
            event("shrink stopped short")
            assert budget.free == 0
            bps = [p.blocks_per_slab for p in m.classes]
            for pool, n in zip(m.classes, bps):
                unheld = set(pool.free) | set(pool.cached)
                assert all(any(b not in unheld for b in range(s * n, (s + 1) * n)) for s in pool.slots)
        else:
            event("shrunk, evicting" if r.evicted_blocks else "shrunk")

    @rule(dt=st.sampled_from([0, 0.5, 1, 3]), after=st.sampled_from([0, 1, 2.5]))
    def release_idle(self, dt, after):
        self.clock += dt
        held, free = self.held(), self.m.budget.free
        chunks = self.m.release_idle(self.clock, after)
        self.apply_moves()
        assert self.held() == held
        assert self.m.budget.free == free + chunks
        if after == 0:
            assert not any(empty_slots(pool) for pool in self.m.classes), "an empty slab left"
        if chunks:
            event("idle slabs released")

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
        assert self.mapped[cls] == slots
        self.apply_slabs()  # the memory backend releases every slab the dropped class had
        assert not self.mapped[cls], "a dropped class's slabs were not released"
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
        assert all(self.mapped[p.class_id] == p.slots for p in self.m.classes), "mapped slabs differ from owned"
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
        for key, data in self.remote.items():
            assert data == self.expected[key[1]], f"remote block {key} holds {data}"
        assert len(self.m.classes) <= 2, "dropped ids were not reused"
        for owners in ((1,), (2,), OWNERS):  # what the per-user pool share counts
            want = sum(-(-len(toks) // self.bs(self.class_of[s])) * self.m.classes[self.class_of[s]].block_bytes
                       for s, toks in self.tokens.items() if self.owner_of[s] in owners and s not in self.swapped)
            want += sum(len(self.m.reserve(o, c)) * self.m.classes[c].block_bytes
                        for o in owners for c in self.cls if self.m.reserve(o, c))
            assert self.m.held_bytes(owners) == want, f"owners {owners} hold {self.m.held_bytes(owners)}, not {want}"
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
        r = self.m.resize(0)  # nothing held: the whole pool can go
        assert r.met and not any(p.slots for p in self.m.classes)
        self.m.check_invariants()


TestCoreMachine = CoreMachine.TestCase
TestCoreMachine.settings = settings(
    max_examples=300, stateful_step_count=40, deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
