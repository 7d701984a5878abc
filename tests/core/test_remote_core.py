"""The core's side of the remote tier (3): which blocks go there, and promotions from it (pure)."""

from __future__ import annotations

from kvpoold.core import Geometry, KVCacheManager, Tier
from kvpoold.core.hashing import chain_hashes, pack_tokens, root_hash
from kvpoold.core.tiers import DROP

G = Geometry(1, 1, 4, "float16", 4)  # 64 bytes per block, 4 tokens


def make(blocks=8, host_blocks=0, remote_write="through"):
    bb = G.block_bytes
    m = KVCacheManager(blocks * bb, chunk_bytes=bb, host_bytes=host_blocks * bb, remote_write=remote_write)
    return m, m.register_class(G)


def rows(m):
    return [(mv.key, mv.src, mv.dst, mv.block) for mv in m.drain_moves()]


def hashes(tokens, model="m"):
    return chain_hashes(root_hash(model, ""), pack_tokens(tokens), G.block_size)


def test_through_copies_each_block_once_its_writer_confirmed_it():
    m, c = make()
    s = m.create(1, c, "m", range(10))  # 2 full blocks and a partial one
    assert rows(m) == []  # not written yet: nothing goes out
    m.mark_written(1, [s.seq_id])
    h = hashes(range(10))
    assert rows(m) == [((c, h[0]), Tier.DEVICE, Tier.REMOTE, s.block_table[0]),
                       ((c, h[1]), Tier.DEVICE, Tier.REMOTE, s.block_table[1])]
    m.free(1, [s.seq_id])
    assert rows(m) == []  # confirmed already
    m.check_invariants()


def test_create_promotes_the_blocks_the_remote_tier_answered_in_chain_order():
    m, c = make()
    toks = list(range(100, 118))  # 4 full blocks and 2 tokens
    h = hashes(toks)
    assert m.remote_candidates(c, "m", toks) == h
    s = m.create(1, c, "m", toks, remote={h[0]: b"", h[1]: b"", h[3]: b""})  # a gap at block 2
    assert s.num_cached_tokens == 2 * G.block_size
    assert rows(m) == [((c, h[0]), Tier.REMOTE, Tier.DEVICE, s.block_table[0]),
                       ((c, h[1]), Tier.REMOTE, Tier.DEVICE, s.block_table[1])]
    assert m.stats().classes[0].remote_hit_blocks == 2
    assert m.remote_candidates(c, "m", toks) == h[2:]  # the promoted ones are local now
    m.check_invariants()


def test_local_blocks_win_over_remote_ones_and_lookup_counts_the_remote_tail():
    m, c = make(remote_write="through")
    toks = list(range(16))
    h = hashes(toks)
    s = m.create(1, c, "m", toks[:8])
    m.free(1, [s.seq_id])
    rows(m)
    r = m.lookup(c, "m", toks, remote=set(h))
    assert (r.num_cached_tokens, r.device_tokens, r.remote_tokens) == (16, 8, 8)
    t = m.create(2, c, "m", toks, remote=dict.fromkeys(h))
    assert t.num_cached_tokens == 16 and t.block_table[:2] == s.block_table[:2]
    assert [(src, dst) for _, src, dst, _ in rows(m)] == [(Tier.REMOTE, Tier.DEVICE)] * 2
    m.check_invariants()


def test_evict_sends_blocks_leaving_the_last_local_tier():
    m, c = make(blocks=4, host_blocks=2, remote_write="evict")
    a = m.create(1, c, "m", range(16))
    m.mark_written(1, [a.seq_id])
    assert rows(m) == []  # evict: nothing goes out while the blocks stay local
    m.free(1, [a.seq_id])
    m.create(1, c, "m", range(100, 116))  # evicts all 4: 2 fit the host, the host's oldest leave for tier 3
    moved = rows(m)
    assert sum(1 for _, s, d, _ in moved if d == Tier.REMOTE) == 2
    assert all(d != DROP for _, _, d, _ in moved)
    m.check_invariants()
