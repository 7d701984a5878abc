"""Shared helpers for the core tests: a snapshot of every piece of state."""

from __future__ import annotations

from kvpoold.core import KVCacheManager

from oracle import prefix_state, tier_keys


def snapshot(m: KVCacheManager):
    """Everything a call could change, as plain comparable values."""
    t = m.seqs
    seqs = {
        t.seq_id(i): (
            int(t.owner[i]), int(t.cls[i]), tuple(t.blocks[i]), int(t.ntok[i]), bool(t.maybe_shared[i]),
            t.tail[i].tobytes(), t.last_hash[i], int(t.num_cached[i]),
        )
        for i in t.live_slots().tolist()
    }
    pools = [
        (
            tuple(p.free), tuple(p.cached), dict(p.extra), prefix_state(p),
            frozenset(p.slots), tuple(sorted(p._returned)), p._fresh, p.evictions,
        )
        for p in m.classes
    ]
    owners = {o: (frozenset(s.seqs), {c: tuple(r) for c, r in s.reserves.items()}) for o, s in m._owners.items()}
    tiers = [
        (tier_keys(index), dict(index._sizes), index.used, index.pinned, index.blocks_in, index.blocks_out, index.dropped)
        for index in m.placement.lower
    ]
    swapped = ({s: tuple(e) for s, e in m._swaps.swapped.items()}, t.swapped.tobytes(), t.nswapped,
               m._swaps.next_key, {c: dict(h) for c, h in m._holds.items()}, len(m._moves))
    elastic = (m.budget.total, {pool: dict(since) for pool, since in m._elastic.empty_since.items()})
    return (seqs, pools, owners, m.budget.free, t.gen.tobytes(), t.live,
            [vars(c).copy() for c in m._registry.counters],
            tiers, swapped, elastic)
