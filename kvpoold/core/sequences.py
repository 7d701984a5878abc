"""Sequences' lifecycle: create (with its prefix match over every tier), fork, free, and prefix lookups.

A sequence belongs to the owner that created or forked it.  ``create`` reuses
the longest prefix cached on any tier (promoting lower-tier blocks back onto the
device, pinned so that the allocation's own demotions cannot take them).
"""

from __future__ import annotations

from itertools import repeat
from typing import Iterable, NamedTuple

import numpy as np

from kvpool.protocol.sizes import cdiv

from .block_pool import LayoutClass
from .errors import InvalidArgument, OutOfBlocks
from .events import PoolEvents
from .hashing import chain_hashes, pack_tokens, root_hash
from .results import LookupResult, PageTable
from .seq_table import SeqTable
from .state import Owners, check_owner, distinct_slots, page_table, refuse_swapped, slot_of
from .tiers import MovePlan, Tier, TierIndex, TierPlacement


class PrefixMatch(NamedTuple):
    """The longest prefix of a prompt's block hashes cached on some tier that its owner may use."""

    #: its device blocks, in order; -1 where a lower tier (or the remote one) holds the block
    matched: list[int]
    #: the hashes of those lower-tier blocks, in order
    lower: list[bytes]
    #: their tier keys, in the same order
    lower_keys: list
    #: the one local lower tier that holds every local one of them; None: several, or none
    holder: TierIndex | None
    #: per lower block, whether the remote tier supplies it; None: none of them does
    from_remote: list[bool] | None


class Sequences:
    """``create`` / ``fork`` / ``mark_written`` / ``free`` / ``drop_owner``, prefix ``lookup`` and ``evict_cached``."""

    def __init__(self, registry, *, seqs: SeqTable, owners: Owners, placement: TierPlacement, moves: MovePlan,
                 events: PoolEvents, swaps, reserves) -> None:
        self._registry = registry  # ``classes.ClassRegistry``
        self._seqs = seqs
        self._owners = owners
        self._placement = placement
        self._moves = moves
        self._events = events
        self._swaps = swaps  # ``swap.Swapping``: a freed swapped-out sequence's copies go
        self._reserves = reserves  # ``reserves.Reserves``: a dropped owner's reserves go back

    def create(
        self, owner: int, class_id: int, model_id: str, tokens, extra_key: str = "", remote=None,
        counted: bool = True,
    ) -> PageTable:
        """A new sequence holding ``tokens``; reuses the longest cached prefix.

        Args:
            remote: block hashes whose bytes the remote tier fetched for this call (``remote_candidates``);
                they extend the prefix past the local tiers and are promoted from there.
            counted: a prefix query in the statistics (False: the caller counted it with ``lookup``).
        Returns:
            The sequence's page table.
        """
        pool = self._registry.pool(class_id)
        packed = pack_tokens(tokens)
        root = root_hash(model_id, extra_key)
        check_owner(owner)
        bs = pool.block_size
        hashes = chain_hashes(root, packed, bs)
        # the longest cached prefix over every tier: a device block, or -1 for a lower-tier hit
        matched, lower, lower_keys, holder, from_remote = self._match(pool, owner, hashes, remote)
        if not lower:
            on_device = matched
        else:  # none on the device when every hit is on a lower tier (a promotion): no pass
            on_device = [b for b in matched if b >= 0] if len(lower) < len(matched) else []
        need = cdiv(len(packed), bs) - len(on_device)
        revived = len(pool.cached.present(on_device))
        avail = pool.obtainable(need + revived) - revived
        if avail < need:
            raise OutOfBlocks(need, avail)
        # -- apply --
        pool.acquire_many(on_device)
        placement = self._placement
        # pinned: no victim of the demotions that the allocation may cause
        local_keys = lower_keys if from_remote is None else [k for k, r in zip(lower_keys, from_remote) if not r]
        runs = placement.pin_many(local_keys, holder)
        fresh = pool.allocate(need)
        c = self._registry.counters[class_id]
        if lower:
            promoted = fresh[:len(lower)]
            if from_remote is None:
                placement.take_many(self._moves, lower_keys, promoted, pinned=True, runs=runs)
            else:
                placement.take_many(self._moves, local_keys, [b for b, r in zip(promoted, from_remote) if not r],
                                    pinned=True, runs=runs)
                remote_keys = [k for k, r in zip(lower_keys, from_remote) if r]
                self._moves.add_many(remote_keys, Tier.REMOTE, Tier.DEVICE,
                                     [b for b, r in zip(promoted, from_remote) if r], pool.block_bytes)
                c.remote_hit_blocks += len(remote_keys)
            pool.prefix.register_many(promoted, lower)
            if len(lower) == len(matched):
                matched = promoted
            else:
                arr = np.asarray(matched, np.int64)
                arr[arr < 0] = promoted
                matched = arr.tolist()
            fresh = fresh[len(lower):]
        unconfirmed = pool.prefix.register_many(fresh[:len(hashes) - len(matched)], hashes[len(matched):],
                                                writer=owner)
        if counted:
            c.count_prefix_query(len(packed), len(matched) * bs)
        c.promoted_blocks += len(lower)
        t = self._seqs
        seq_id = t.add(owner, class_id, matched + fresh, len(packed),
                       hashes[-1] if hashes else root, len(matched) * bs)
        rest = packed[len(hashes) * bs:]
        slot = slot_of(seq_id)
        t.tail[slot, : len(rest)] = rest
        t.add_unconfirmed_many(slot, unconfirmed)
        self._owners.add_sequence(owner, seq_id)
        return page_table(t, slot)

    def _match(self, pool: LayoutClass, owner: int, hashes: list[bytes], remote=None) -> PrefixMatch:
        """The longest prefix of ``hashes`` cached on some tier that ``owner`` may use.

        ``remote`` holds the hashes the remote tier has bytes for.  One C-level lookup per tier for
        the whole prompt.
        """
        n = len(hashes)
        on_dev = pool.prefix.lookup_many(hashes)
        hit = pool.prefix.hit_mask(hashes)
        holders = []  # (lower tier, its hits)
        keys = None
        if self._events.track_moves:
            for index in self._placement.lower:
                if len(index):
                    if keys is None:
                        keys = list(zip(repeat(pool.class_id), hashes))
                    mine = index.has_many(keys)
                    holders.append((index, mine))
                    hit |= mine
        remote_hit = None
        if remote:
            remote_hit = np.fromiter(map(remote.__contains__, hashes), np.bool_, n) & ~hit
            hit |= remote_hit
            if keys is None:
                keys = list(zip(repeat(pool.class_id), hashes))
        miss = np.flatnonzero(~hit)
        length = int(miss[0]) if len(miss) else n
        matched = pool.prefix.visible_prefix(on_dev[:length], owner)
        on_lower = matched.count(None)
        if on_lower == 0:
            return PrefixMatch(matched, [], [], None, None)
        if on_lower == len(matched):  # all from the lower tiers (a promotion): slices, no pass
            lower, lower_keys = hashes[:on_lower], keys[:on_lower]
            lower_at = np.arange(on_lower)
            matched = [-1] * on_lower
        else:
            lower = [h for h, b in zip(hashes, matched) if b is None]
            lower_keys = [k for k, b in zip(keys, matched) if b is None]
            lower_at = np.flatnonzero(np.fromiter((b is None for b in matched), np.bool_, len(matched)))
            matched = [-1 if b is None else b for b in matched]
        holder = None
        if len(holders) == 1:
            holder = holders[0][0]  # the only local lower tier with entries: it holds every local lower hit
        from_remote = None
        if remote_hit is not None and remote_hit[lower_at].any():
            from_remote = remote_hit[lower_at].tolist()
        return PrefixMatch(matched, lower, lower_keys, holder, from_remote)

    def remote_candidates(self, class_id: int, model_id: str, tokens, extra_key: str = "",
                          owner: int | None = None) -> list[bytes]:
        """The hashes of the full blocks of ``tokens`` past its longest prefix cached on the local tiers.

        What a create or lookup asks the remote tier for; allocates and counts nothing.

        Returns:
            The block hashes, in chain order (empty when every full block is cached here).
        """
        pool = self._registry.pool(class_id)
        hashes = chain_hashes(root_hash(model_id, extra_key), pack_tokens(tokens), pool.block_size)
        matched = self._match(pool, owner, hashes).matched
        return hashes[len(matched):]

    def lookup(
        self, class_id: int, model_id: str, tokens, extra_key: str = "", owner: int | None = None, remote=None,
        known: int = 0,
    ) -> LookupResult:
        """Longest cached prefix of ``tokens`` over every tier that ``owner`` may use; allocates nothing.

        ``remote``: the block hashes the remote tier holds (the chain past the local tiers).
        ``known``: leading tokens the caller holds itself; the statistics count the query and the hit
        from there (the caller asks the pool only for the rest).
        """
        pool = self._registry.pool(class_id)
        packed = pack_tokens(tokens)
        hashes = chain_hashes(root_hash(model_id, extra_key), packed, pool.block_size)
        per_tier = [0, 0, 0, 0]
        for h in hashes:
            b = pool.prefix.lookup(h)
            if b is not None:
                if not pool.prefix.visible(b, owner):
                    break  # another session is still writing it
                per_tier[0] += 1
                continue
            tier = self._placement.locate((class_id, h))
            if tier is None:
                if remote and h in remote:
                    tier = Tier.REMOTE
                else:
                    break
            per_tier[tier] += 1
        bs = pool.block_size
        known = min(max(known, 0), len(packed))
        self._registry.counters[class_id].count_prefix_query(len(packed) - known, max(sum(per_tier) * bs - known, 0))
        return LookupResult(sum(per_tier) * bs, per_tier[0] * bs, per_tier[1] * bs, per_tier[2] * bs,
                            per_tier[3] * bs)

    def fork(self, owner: int, seq_id: int) -> PageTable:
        """A new sequence sharing every block of ``seq_id`` (copy-on-write later)."""
        t = self._seqs
        slot = t.slot_of(owner, seq_id)
        if t.swapped[slot]:
            refuse_swapped(seq_id, "forked")
        c = int(t.cls[slot])
        pool = self._registry.classes[c]
        pool.share(t.blocks[slot])
        ntok = int(t.ntok[slot])
        child_id = t.add(owner, c, list(t.blocks[slot]), ntok, t.last_hash[slot], int(t.num_cached[slot]))
        child = slot_of(child_id)
        t.tail[child] = t.tail[slot]
        if ntok % pool.block_size:
            t.flag_shared(slot)
            t.flag_shared(child)
        self._owners.add_sequence(owner, child_id)
        return page_table(t, child)

    def mark_written(self, owner: int, seq_ids: Iterable[int]) -> None:
        """The owner says these sequences' KV is written: their full blocks become everyone's hits.

        Any later call on a sequence (extend, free, swap-out) says the same of
        the tokens it had before; this is for a sequence that has no next call
        soon (a prefill-only process, a prompt other sessions are waiting on).
        """
        t = self._seqs
        for slot in distinct_slots(t, owner, list(seq_ids)).tolist():
            self._registry.classes[int(t.cls[slot])].prefix.confirm(t.take_unconfirmed(slot), owner)

    def free(self, owner: int, seq_ids: Iterable[int], *, written: bool = True) -> int:
        """Free sequences (tail blocks first); returns how many blocks were released.

        Freeing says the sequences' KV is written (their full blocks become
        every session's prefix hits); ``written=False`` (a session that died)
        drops the hashes of blocks it had not confirmed instead.
        """
        seq_ids = list(seq_ids)
        slots = distinct_slots(self._seqs, owner, seq_ids)
        if not len(slots):
            return 0
        t = self._seqs
        classes = t.cls[slots]
        released = 0
        for c in np.unique(classes).tolist() if len(self._registry.classes) > 1 else [int(classes[0])]:
            mine = slots if len(self._registry.classes) == 1 else slots[classes == c]
            pool = self._registry.classes[c]
            unconfirmed = t.take_unconfirmed_many(mine)
            if written:
                pool.prefix.confirm(unconfirmed, owner)
            else:
                pool.prefix.forget_unwritten(unconfirmed, owner)
            blocks = t.blocks_tail_first(mine.tolist())
            pool.release(blocks)
            released += len(blocks)
        if t.nswapped:
            self._swaps.drop_copies(slots[t.swapped[slots]].tolist())
        t.remove_many(slots)
        self._owners.remove_sequences(owner, seq_ids)
        return released

    def drop_owner(self, owner: int) -> int:
        """Free everything an owner holds (a session ended); returns blocks released."""
        state = self._owners.get(owner)
        if state is None:
            return 0
        released = self.free(owner, sorted(state.seqs), written=False)
        for cls in list(state.reserves):
            released += self._reserves.return_reserve(owner, cls)
        self._owners.drop(owner)
        return released

    def evict_cached(self, class_id: int | None = None, max_blocks: int | None = None) -> int:
        """Drop cached (unheld) blocks, oldest first; returns how many."""
        pools = self._registry.classes if class_id is None else [self._registry.pool(class_id)]
        if max_blocks is not None and (type(max_blocks) is not int or max_blocks < 0):
            raise InvalidArgument(f"max_blocks must be a non-negative integer, got {max_blocks!r}")
        n = 0
        for pool in pools:
            n += pool.drop_cached(None if max_blocks is None else max_blocks - n)
        return n
