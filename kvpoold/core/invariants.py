"""Every invariant of the manager's bookkeeping, asserted (tests and ``kvpoolctl check``)."""

from __future__ import annotations

import numpy as np

from kvpool.protocol.sizes import cdiv

from .block_pool import ChunkBudget
from .seq_table import SeqTable
from .state import Owners, slot_of
from .tiers import TierPlacement


def check_all(*, seqs: SeqTable, classes: list, owners: Owners, swapped: dict, holds, placement: TierPlacement,
              budget: ChunkBudget) -> None:
    """Assert that the page tables, owners, holds and swap records agree with the pools and tiers.

    Args:
        classes: the registry's classes, by id.
        swapped: the swap records (``swap.Swapping.swapped``).
        holds: the ``holds.TransferHolds``.
    """
    t = seqs
    holders: list[dict[int, int]] = [dict() for _ in classes]
    live = t.live_slots()
    assert len(live) == t.live, "live sequence count is off"
    for slot in live.tolist():
        c = int(t.cls[slot])
        pool = classes[c]
        bs, ntok = pool.block_size, int(t.ntok[slot])
        blocks = t.blocks[slot]
        seq_id = t.seq_id(slot)
        if t.swapped[slot]:
            assert not blocks, f"sequence {seq_id}: swapped out but holds device blocks"
            entries = swapped.get(slot)
            assert entries is not None and len(entries[0]) == len(entries[1]) == cdiv(ntok, bs), (
                f"sequence {seq_id}: swap copies")
            for key in entries[0]:
                tier = placement.locate(key)
                assert tier is not None and placement.index(tier).is_pinned(key), (
                    f"sequence {seq_id}: swap copy {key} is not pinned in a lower tier")
        else:
            assert slot not in swapped, f"sequence {seq_id}: a swap record but not swapped"
        assert len(blocks) == cdiv(ntok, bs) or t.swapped[slot], f"sequence {seq_id}: blocks vs tokens"
        owner = int(t.owner[slot])
        assert seq_id in owners.get(owner).seqs, f"sequence {seq_id} missing from its owner"
        if ntok % bs and len(blocks) and pool.is_shared(blocks[-1]) and not t.maybe_shared[slot]:
            # a shared partial block must be flagged, or an append would skip copy-on-write
            sharers = sum(1 for s in live.tolist() if t.blocks[s] and t.blocks[s][-1] == blocks[-1]
                          and int(t.ntok[s]) % bs and int(t.cls[s]) == c)
            assert sharers <= 1, f"sequence {seq_id}: shared partial block not flagged"
        for b in blocks:
            holders[c][b] = holders[c].get(b, 0) + 1
    for owner, state in owners.items():
        for seq_id in state.seqs:
            slot = slot_of(seq_id)
            assert int(t.owner[slot]) == owner and t.seq_id(slot) == seq_id
        for c, reserve in state.reserves.items():
            for b in reserve:
                holders[c][b] = holders[c].get(b, 0) + 1
    for c, held in holds.items():
        for b, n in held.items():
            holders[c][b] = holders[c].get(b, 0) + n
    assert set(swapped) <= set(live.tolist()), "a swap record of a freed sequence"
    assert t.nswapped == len(swapped) == int(np.count_nonzero(t.swapped[live])), "swapped count is off"
    swap_keys = {k for keys, _ in swapped.values() for k in keys}
    pinned = set().union(*(index.pinned_keys() for index in placement.lower))
    assert pinned == swap_keys, "pinned lower-tier entries differ from the swapped sequences' copies"
    assert sum(len(s.seqs) for s in owners.values()) == t.live
    assert t.flagged == int(np.count_nonzero(t.maybe_shared[live])), "shared-tail flag count is off"
    unconfirmed = {}
    for slot in live.tolist():
        for b in t.unconfirmed[slot] or ():
            key = (int(t.cls[slot]), b)
            assert key not in unconfirmed, f"block {b} unconfirmed by two sequences"
            unconfirmed[key] = int(t.owner[slot])
            assert b in t.blocks[slot] or t.swapped[slot], f"unconfirmed block {b} not in its sequence"
    assert t.n_unconfirmed == sum(1 for slot in live.tolist() if t.unconfirmed[slot]), "unconfirmed count is off"
    for pool in classes:
        for b, writer in pool.prefix.unwritten_items():
            assert unconfirmed.get((pool.class_id, b)) == writer, f"unwritten block {b} has no confirming sequence"
    assert not t.maybe_shared[t.owner == -1].any(), "a free slot is flagged"
    used_chunks = 0
    for pool in classes:
        refs = pool.check()
        assert refs == holders[pool.class_id], (
            f"class {pool.class_id}: ref counts differ from page-table holders"
        )
        used_chunks += len(pool.slots) * pool.slab_chunks
    assert used_chunks + budget.free == budget.total, "chunks lost or double counted"
    placement.check()
