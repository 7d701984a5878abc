"""The daemon's side of transfers: holds on blocks while bytes are in flight, and lost or found bytes."""

from __future__ import annotations

from collections import deque
from typing import Iterable

import numpy as np

from .block_pool import LayoutClass
from .errors import InvalidArgument
from .seq_table import SeqTable
from .tiers import Key, Tier, TierPlacement


class TransferHolds:
    """Transfer holds on device blocks, and the bytes that were lost (``invalidate_block``, ``forget_lower``) or found."""

    def __init__(self, registry, seqs: SeqTable, placement: TierPlacement) -> None:
        self._registry = registry  # ``classes.ClassRegistry``
        self._seqs = seqs
        self._placement = placement
        #: class id -> (block -> holds taken by the daemon while bytes are in flight into the block)
        self._by_class: dict[int, dict[int, int]] = {}

    def held_in(self, class_id: int) -> bool:
        """Whether the daemon holds any block of class ``class_id``."""
        return bool(self._by_class.get(class_id))

    def items(self):
        """(class id, block -> holds) of the classes with holds."""
        return ((c, holds) for c, holds in self._by_class.items() if holds)

    def hold_blocks(self, class_id: int, blocks: Iterable[int]) -> None:
        """One more holder on each (held) block while bytes are copied into it.

        A block with a hold is never freed, evicted or handed out again, even
        if its sequence is freed meanwhile; ``release_holds`` ends the hold.
        """
        pool = self._registry.pool(class_id)
        blocks = list(blocks)
        if not self._all_held(pool, blocks):
            for b in blocks:
                if b in pool.cached or not pool.owns(b):
                    raise InvalidArgument(f"block {b} is not held: only held blocks take a transfer hold")
        holds = self._by_class.setdefault(class_id, {})
        pool.share(blocks)
        if holds.keys().isdisjoint(blocks) and len(set(blocks)) == len(blocks):
            holds.update(dict.fromkeys(blocks, 1))  # a batch's holds, in C
            return
        for b in blocks:
            holds[b] = holds.get(b, 0) + 1

    @staticmethod
    def _all_held(pool: LayoutClass, blocks: list[int]) -> bool:
        """Whether every block is an int in an owned slab and not cached (checked per batch, not per block)."""
        if not blocks:
            return True
        if not all(type(b) is int for b in blocks) or not pool.cached.isdisjoint(blocks):
            return False
        arr = np.asarray(blocks, np.int64)
        return bool((arr >= 0).all()) and bool(np.isin(arr // pool.blocks_per_slab, list(pool.slots)).all())

    def release_holds(self, class_id: int, blocks: Iterable[int]) -> None:
        pool = self._registry.pool(class_id)
        blocks = list(blocks)
        holds = self._by_class.get(class_id, {})
        if len(set(blocks)) == len(blocks) and list(map(holds.get, blocks)).count(1) == len(blocks):
            deque(map(holds.__delitem__, blocks), 0)  # a batch's holds, one each: in C
            pool.release(blocks)
            return
        count: dict[int, int] = {}
        for b in blocks:
            count[b] = count.get(b, 0) + 1
            if count[b] > holds.get(b, 0):
                raise InvalidArgument(f"block {b} has no transfer hold to release")
        for b in blocks:
            if holds[b] == 1:
                del holds[b]
            else:
                holds[b] -= 1
        pool.release(blocks)

    def invalidate_block(self, class_id: int, block: int) -> bytes | None:
        """The bytes meant for ``block`` never arrived (bad checksum, I/O error).

        Its hash is forgotten so that no prefix hit finds it; the block stays
        with its holders, whose owners rewrite it (``register_block`` gives
        the hash back once an owner was told to).  Returns the forgotten hash.
        """
        pool = self._registry.pool(class_id)
        self._registry.counters[class_id].lost_blocks += 1
        return pool.invalidate(block)

    def register_block(self, owner: int, seq_id: int, block: int, digest: bytes) -> bool:
        """Give a block of ``seq_id`` its hash back: its owner was told to rewrite it.

        Like a fresh block at ``create``, it is in the prefix index from the
        moment its owner is to write it.  False (nothing changes) if the
        sequence does not hold it or another block has that hash.
        """
        slot = self._seqs.slot_of(owner, seq_id)
        pool = self._registry.classes[int(self._seqs.cls[slot])]
        if block not in self._seqs.blocks[slot] or pool.prefix.is_hashed(block):
            return False
        if not pool.prefix.register(block, digest, writer=owner):
            return False
        self._seqs.add_unconfirmed(slot, block)
        return True

    def forget_lower(self, key: Key) -> bool:
        """A lower-tier copy was lost (its write failed): forget it unless it is pinned.

        A swapped-out sequence's copy stays recorded: its swap-in reports the loss.
        """
        return self._placement.forget(key)

    def load_lower(self, tier: Tier, class_id: int, digest: bytes, nbytes: int) -> bool:
        """Record a prefix block found in a lower tier at start (a restart); False if it has no room."""
        self._registry.pool(class_id)
        return self._placement.index(tier).load((class_id, digest), nbytes)

