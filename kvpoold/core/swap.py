"""Swapping whole sequences out to the lower tiers and back."""

from __future__ import annotations

from itertools import chain, repeat
from typing import Iterable

import numpy as np

from .errors import InvalidArgument, OutOfBlocks, WrongState
from .results import PageTable
from .seq_table import SeqTable
from .state import distinct_slots, page_table
from .tiers import Key, MovePlan, TierPlacement


class Swapping:
    """``swap_out`` / ``swap_in``: whole sequences to the lower tiers (pinned copies) and back."""

    def __init__(self, registry, seqs: SeqTable, placement: TierPlacement, moves: MovePlan) -> None:
        self._registry = registry  # ``classes.ClassRegistry``
        self._seqs = seqs
        self._placement = placement
        self._moves = moves
        #: swapped-out sequences: slot -> (tier keys, block hashes or None), one each per logical block
        self.swapped: dict[int, tuple[list[Key], list[bytes | None]]] = {}
        self.next_key = 0  # swap copies' keys are (class id, a number no other copy had)

    def swap_out(self, owner: int, seq_ids: Iterable[int]) -> tuple[int, int]:
        """Copy the sequences' blocks into the lower tiers and give their device blocks back.

        The copies are pinned (never evicted) until ``swap_in`` or ``free``;
        the page tables are empty meanwhile and the sequences refuse
        ``extend`` and ``fork`` (``WrongState``).  Hashed blocks that nobody
        else holds stay in the device's prefix cache, so a swap-in soon after
        may find them there and copy nothing.  Returns (blocks copied to the
        host tier, blocks copied to disk); the planned copies read each device
        block before it can be handed out again (``drain_moves``).
        """
        seq_ids = list(seq_ids)
        t = self._seqs
        slots = distinct_slots(t, owner, seq_ids).tolist()
        for seq_id, slot in zip(seq_ids, slots):
            if t.swapped[slot]:
                raise WrongState(f"sequence {int(seq_id)} is already swapped out")
        if not self._placement.enabled:
            raise WrongState("no host or disk tier to swap to: start kvpoold with --host-bytes or --disk-bytes")
        runs = self._placement.runs(self._registry.classes[int(t.cls[s])].block_bytes for s in slots for _ in t.blocks[s])
        if not self._placement.can_pin_runs(runs):
            raise OutOfBlocks(self._placement.charge_pinned_runs(runs), self._placement.pinned_room(),
                              "lower-tier bytes to swap to")
        # -- apply --
        per_tier = [0, 0]
        for slot in slots:
            c = int(t.cls[slot])
            pool = self._registry.classes[c]
            blocks = t.blocks[slot]
            pool.prefix.confirm(t.take_unconfirmed(slot), owner)  # a swap-out comes after the sequence ran
            keys = list(zip(repeat(c), range(self.next_key, self.next_key + len(blocks))))
            self.next_key += len(blocks)
            for i, n in enumerate(self._placement.place_pinned_many(self._moves, keys, pool.block_bytes, blocks)):
                per_tier[i] += n
            self.swapped[slot] = (keys, pool.prefix.digests_of(blocks))
            pool.release(blocks[::-1])
            t.blocks[slot] = []
            t.unflag_shared(np.array([slot]))
            t.set_swapped(slot, swapped=True)
            self._registry.counters[c].swapped_out_blocks += len(blocks)
        return per_tier[0], per_tier[1]

    def swap_in(self, owner: int, seq_ids: Iterable[int]) -> list[PageTable]:
        """Bring swapped-out sequences back onto the device, possibly into other blocks.

        A block whose hash is on the device already (cached or held) is
        shared instead of copied; the others get fresh blocks that the planned
        moves fill.  All or nothing; one layout class per call.
        """
        seq_ids = list(seq_ids)
        t = self._seqs
        slots = distinct_slots(t, owner, seq_ids).tolist()
        for seq_id, slot in zip(seq_ids, slots):
            if not t.swapped[slot]:
                raise WrongState(f"sequence {int(seq_id)} is not swapped out")
        if not slots:
            return []
        classes = {int(t.cls[s]) for s in slots}
        if len(classes) > 1:
            raise InvalidArgument("one swap-in call takes sequences of one layout class only")
        c = classes.pop()
        pool = self._registry.classes[c]
        plan: list[list[int]] = []  # per sequence, the device block of each hash found there, else -1
        on_device: list[int] = []
        for slot in slots:
            row = pool.prefix.lookup_many(self.swapped[slot][1], -1)  # None is no hash: -1
            if row.count(-1) < len(row):
                on_device.extend(b for b in row if b >= 0)
            plan.append(row)
        need = sum(row.count(-1) for row in plan)
        revive = len(set(pool.cached.present(on_device)))
        avail = pool.obtainable(need + revive) - revive
        if avail < need:
            raise OutOfBlocks(need, avail)
        # -- apply --
        for b in on_device:  # rare (a swap-in soon after the swap-out): a block hashed twice is shared twice
            pool.acquire_cached(b)
        fresh = pool.allocate(need)  # the swap copies are pinned: no victim of its demotions
        used = 0
        out = []
        for slot, row in zip(slots, plan):
            keys, hashes = self.swapped.pop(slot)
            if row.count(-1) == len(row):  # every block comes back from below
                blocks = fresh[used:used + len(row)]
                self._placement.take_many(self._moves, keys, blocks, pinned=True)
            else:
                blocks = list(row)
                copy = [i for i, b in enumerate(row) if b < 0]
                for i, b in zip(copy, fresh[used:used + len(copy)]):
                    blocks[i] = b
                self._placement.drop_many(self._moves, [k for k, b in zip(keys, row) if b >= 0], pinned=True)
                self._placement.take_many(self._moves, [keys[i] for i in copy], [blocks[i] for i in copy], pinned=True)
                hashes = [hashes[i] for i in copy]
            copied = blocks if len(hashes) == len(blocks) else [blocks[i] for i in copy]
            used += len(copied)
            if hashes.count(None) < len(hashes):
                named = [(b, h) for b, h in zip(copied, hashes) if h is not None]
                pool.prefix.register_many([b for b, _ in named], [h for _, h in named])
            t.blocks[slot] = blocks
            t.set_swapped(slot, swapped=False)
            self._registry.counters[c].swapped_in_blocks += len(blocks)
            out.append(page_table(t, slot))
        return out

    def drop_copies(self, slots: list[int]) -> None:
        """Freed swapped-out sequences: their lower-tier copies go (in one plan, in order)."""
        if slots:
            keys = list(chain.from_iterable(self.swapped.pop(slot)[0] for slot in slots))
            self._placement.drop_many(self._moves, keys, pinned=True)
