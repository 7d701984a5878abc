"""The core's one entry point: sequences, page tables, prefix cache, reserves.

``KVCacheManager`` is pure bookkeeping: integers, token ids and hashes, no
I/O.  Every public call validates everything first and then applies, so an
error (a ``KvpoolError``) always leaves the state exactly as it was.  It is
not thread-safe: the daemon calls it under one lock.

Owners are opaque integers (the daemon's session ids).  A sequence belongs to
the owner that created or forked it; any other owner naming it gets
``NotOwner``.  A *reserve* is a set of blocks an owner holds outside any page
table: the client assigns them to its sequences locally and reports the
assignment with its next ``extend`` (claims), which is how a decode loop
calls the daemon far less than once per step.

Each concern lives in its own module (``extend``, ``swap``, ``holds``, ``elastic``,
``reserves``, ``stats``, ``invariants``) as a class over the shared fields of
``state.ManagerState``; this module assembles them and holds sequences'
lifecycle (create, fork, free), prefix lookups and the queries for quotas.
"""

from __future__ import annotations

from collections import Counter
from itertools import repeat
from typing import Iterable

import numpy as np

from .block_pool import LayoutClass
from .elastic import Elastic
from .classes import ClassLifecycle
from .errors import InvalidArgument, OutOfBlocks
from .extend import Extending
from .hashing import chain_hashes, pack_tokens, root_hash
from .holds import TransferHolds
from .invariants import InvariantChecks
from .layout import Geometry
from .results import LookupResult, PageTable
from .reserves import Reserves
from .state import ManagerState
from .stats import Statistics
from .swap import Swapping
from .tiers import MovePlan, Tier


class KVCacheManager(
    Extending, Swapping, TransferHolds, Reserves, Elastic, Statistics, InvariantChecks, ClassLifecycle, ManagerState
):
    """Block bookkeeping for a whole pool of several layout classes."""

    # -- classes ----------------------------------------------------------------
    def class_of(self, geometry: Geometry) -> int | None:
        """The class id of ``geometry`` if registered, else None."""
        return self._class_ids.get(geometry)

    def drain_moves(self) -> MovePlan:
        """Tier moves planned since the last call, as columns (for the transfer engine)."""
        out, self._moves = self._moves, MovePlan()
        return out

    def drain_slab_changes(self) -> list[tuple[str, int, int, int]]:
        """("take" | "release", class id, byte offset, bytes) of slabs since the last call.

        The daemon commits the memory of taken slabs and releases that of
        returned ones.  A slab's range is its blocks' bytes, ``[slot * span,
        (slot + 1) * span)``: never the tail a slab's chunks hold past its last
        block, which is the next slab's first block.  A slab taken and given
        back (or the reverse) since the last call appears once, as the net
        change, so a backend never maps a slab twice nor keeps an unowned one.
        """
        out = []
        for pool in self.classes:
            taken, released = pool.drain_slab_changes()
            if not taken and not released:
                continue
            net = Counter(taken)
            net.subtract(released)
            span = pool.span
            out.extend(("release", pool.class_id, slot * span, span) for slot, n in net.items() if n < 0)
            out.extend(("take", pool.class_id, slot * span, span) for slot, n in net.items() if n > 0)
        return out

    # -- owners and sequence lookups ----------------------------------------------
    def sequences(self, owner: int) -> list[PageTable]:
        state = self._owners.get(owner)
        return [self.sequence(owner, i) for i in sorted(state.seqs)] if state else []

    def owners(self) -> dict[int, tuple[int, int]]:
        """owner -> (sequences, reserved blocks)."""
        return {
            o: (len(s.seqs), sum(len(r) for r in s.reserves.values())) for o, s in self._owners.items()
        }

    def reserve(self, owner: int, class_id: int) -> tuple[int, ...]:
        state = self._owners.get(owner)
        return tuple(state.reserves.get(class_id, ())) if state else ()

    # -- sequences --------------------------------------------------------------
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
        pool = self.class_pool(class_id)
        packed = pack_tokens(tokens)
        root = root_hash(model_id, extra_key)
        self._check_owner(owner)
        bs = pool.block_size
        hashes = chain_hashes(root, packed, bs)
        # the longest cached prefix over every tier: a device block, or -1 for a lower-tier hit
        matched, lower, lower_keys, holder, from_remote = self._match(pool, owner, hashes, remote)
        if not lower:
            on_device = matched
        else:  # none on the device when every hit is on a lower tier (a promotion): no pass
            on_device = [b for b in matched if b >= 0] if len(lower) < len(matched) else []
        need = -(-len(packed) // bs) - len(on_device)
        revived = len(pool.cached.present(on_device))
        avail = pool.obtainable(need + revived) - revived
        if avail < need:
            raise OutOfBlocks(need, avail)
        # -- apply --
        pool.acquire_many(on_device)
        placement = self.placement
        # pinned: no victim of the demotions that the allocation may cause
        local_keys = lower_keys if from_remote is None else [k for k, r in zip(lower_keys, from_remote) if not r]
        runs = placement.pin_many(local_keys, holder)
        fresh = pool.allocate(need)
        c = self._counters[class_id]
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
        state = self._owner(owner)
        t = self.seqs
        seq_id = t.add(owner, class_id, matched + fresh, len(packed),
                       hashes[-1] if hashes else root, len(matched) * bs)
        rest = packed[len(hashes) * bs:]
        slot = self._slot(seq_id)
        t.tail[slot, : len(rest)] = rest
        t.add_unconfirmed_many(slot, unconfirmed)
        state.seqs.add(seq_id)
        return self._info(slot)

    def _match(self, pool: LayoutClass, owner: int, hashes: list[bytes], remote=None):
        """The longest prefix of ``hashes`` cached on some tier that ``owner`` may use.

        Returns its device blocks (-1 where a lower tier holds the block), the hashes of those
        lower-tier blocks and their tier keys, in order, the one local lower tier that holds all of
        the local ones (None: several, or none), and which of them come from the remote tier (None:
        none does).  ``remote`` holds the hashes the remote tier has bytes for.  One C-level lookup
        per tier for the whole prompt.
        """
        n = len(hashes)
        on_dev = pool.prefix.lookup_many(hashes)
        hit = pool.prefix.hit_mask(hashes)
        holders = []  # (lower tier, its hits)
        keys = None
        if self._track_moves:
            for index in self.placement.lower:
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
            return matched, [], [], None, None
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
        return matched, lower, lower_keys, holder, from_remote

    def remote_candidates(self, class_id: int, model_id: str, tokens, extra_key: str = "",
                          owner: int | None = None) -> list[bytes]:
        """The hashes of the full blocks of ``tokens`` past its longest prefix cached on the local tiers.

        What a create or lookup asks the remote tier for; allocates and counts nothing.

        Returns:
            The block hashes, in chain order (empty when every full block is cached here).
        """
        pool = self.class_pool(class_id)
        hashes = chain_hashes(root_hash(model_id, extra_key), pack_tokens(tokens), pool.block_size)
        matched = self._match(pool, owner, hashes)[0]
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
        pool = self.class_pool(class_id)
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
            tier = self.placement.locate((class_id, h))
            if tier is None:
                if remote and h in remote:
                    tier = Tier.REMOTE
                else:
                    break
            per_tier[tier] += 1
        bs = pool.block_size
        known = min(max(known, 0), len(packed))
        self._counters[class_id].count_prefix_query(len(packed) - known, max(sum(per_tier) * bs - known, 0))
        return LookupResult(sum(per_tier) * bs, per_tier[0] * bs, per_tier[1] * bs, per_tier[2] * bs,
                            per_tier[3] * bs)

    def fork(self, owner: int, seq_id: int) -> PageTable:
        """A new sequence sharing every block of ``seq_id`` (copy-on-write later)."""
        t = self.seqs
        slot = t.slot_of(owner, seq_id)
        if t.swapped[slot]:
            self._refuse_swapped(seq_id, "forked")
        c = int(t.cls[slot])
        pool = self.classes[c]
        pool.share(t.blocks[slot])
        ntok = int(t.ntok[slot])
        child_id = t.add(owner, c, list(t.blocks[slot]), ntok, t.last_hash[slot], int(t.num_cached[slot]))
        child = self._slot(child_id)
        t.tail[child] = t.tail[slot]
        if ntok % pool.block_size:
            t.flag_shared(slot)
            t.flag_shared(child)
        self._owners[owner].seqs.add(child_id)
        return self._info(child)

    def mark_written(self, owner: int, seq_ids: Iterable[int]) -> None:
        """The owner says these sequences' KV is written: their full blocks become everyone's hits.

        Any later call on a sequence (extend, free, swap-out) says the same of
        the tokens it had before; this is for a sequence that has no next call
        soon (a prefill-only process, a prompt other sessions are waiting on).
        """
        t = self.seqs
        for slot in self.check_free(owner, list(seq_ids)):
            self.classes[int(t.cls[slot])].prefix.confirm(t.take_unconfirmed(slot), owner)

    def free(self, owner: int, seq_ids: Iterable[int], *, written: bool = True) -> int:
        """Free sequences (tail blocks first); returns how many blocks were released.

        Freeing says the sequences' KV is written (their full blocks become
        every session's prefix hits); ``written=False`` (a session that died)
        drops the hashes of blocks it had not confirmed instead.
        """
        seq_ids = list(seq_ids)
        slots = self._slots(owner, seq_ids)
        if not len(slots):
            return 0
        t = self.seqs
        classes = t.cls[slots]
        released = 0
        for c in np.unique(classes).tolist() if len(self.classes) > 1 else [int(classes[0])]:
            mine = slots if len(self.classes) == 1 else slots[classes == c]
            pool = self.classes[c]
            unconfirmed = t.take_unconfirmed_many(mine)
            if written:
                pool.prefix.confirm(unconfirmed, owner)
            else:
                pool.prefix.forget_unwritten(unconfirmed, owner)
            blocks = t.blocks_tail_first(mine.tolist())
            pool.release(blocks)
            released += len(blocks)
        if t.nswapped:
            self._drop_swap_copies(slots[t.swapped[slots]].tolist())
        t.remove_many(slots)
        self._owners[owner].seqs.difference_update(map(int, seq_ids))
        return released

    def drop_owner(self, owner: int) -> int:
        """Free everything an owner holds (a session ended); returns blocks released."""
        state = self._owners.get(owner)
        if state is None:
            return 0
        released = self.free(owner, sorted(state.seqs), written=False)
        for cls in list(state.reserves):
            released += self.return_reserve(owner, cls)
        del self._owners[owner]
        return released

    # -- admin --------------------------------------------------------------------
    def evict_cached(self, class_id: int | None = None, max_blocks: int | None = None) -> int:
        """Drop cached (unheld) blocks, oldest first; returns how many."""
        pools = self.classes if class_id is None else [self.class_pool(class_id)]
        if max_blocks is not None and (type(max_blocks) is not int or max_blocks < 0):
            raise InvalidArgument(f"max_blocks must be a non-negative integer, got {max_blocks!r}")
        n = 0
        for pool in pools:
            n += pool.drop_cached(None if max_blocks is None else max_blocks - n)
        return n


    # -- queries for quotas ----------------------------------------------------------
    def block_size(self, class_id: int) -> int:
        """Tokens per block of a layout class."""
        return self.class_pool(class_id).block_size

    def held_device_blocks(self, owner: int) -> int:
        """Device blocks in ``owner``'s page tables (ceil(tokens / block size) per sequence).

        A block two of its sequences share counts twice; swapped-out sequences hold none.
        """
        t = self.seqs
        mine = t.owner == owner
        if t.nswapped:
            mine &= ~t.swapped
        if not mine.any():
            return 0
        return int((-(-t.ntok[mine] // self._block_size[t.cls[mine]])).sum())

    def held_bytes(self, owners: Iterable[int]) -> int:
        """Device bytes ``owners`` hold: their page tables' blocks (as ``held_device_blocks``) and reserves."""
        owners = list(owners)
        if not owners:
            return 0
        t = self.seqs
        mine = t.owner == owners[0]  # a few compares beat np.isin's sort for the few sessions of a user
        for owner in owners[1:]:
            mine |= t.owner == owner
        if t.nswapped:
            mine &= ~t.swapped
        slots = np.flatnonzero(mine)
        held = 0
        if len(slots):
            cls = t.cls[slots]
            block_bytes = np.fromiter((getattr(c, "block_bytes", 0) for c in self.classes), np.int64,
                                      len(self.classes))  # a vacant class has none (and no sequence)
            held = int((-(-t.ntok[slots] // self._block_size[cls]) * block_bytes[cls]).sum())
        for owner in owners:
            state = self._owners.get(owner)
            if state is not None:
                held += sum(len(r) * self.classes[c].block_bytes for c, r in state.reserves.items())
        return held

    def device_blocks_of(self, owner: int, seq_ids: Iterable[int]) -> int:
        """Device blocks the sequences' tokens fill (what a swap-in brings back, what a free gives back)."""
        slots = [self.seqs.slot_of(owner, i) for i in seq_ids]
        if not slots:
            return 0
        t = self.seqs
        return int((-(-t.ntok[slots] // self._block_size[t.cls[slots]])).sum())

    def extend_growth(self, owner: int, seq_ids, counts) -> int | None:
        """New blocks that appending ``counts[i]`` tokens (None: one each) to ``seq_ids[i]`` takes, before any
        copy-on-write; None if the counts do not fit the ids (``extend`` rejects them with the precise error)."""
        t = self.seqs
        slots = t.slots_of(owner, np.asarray(seq_ids, np.int64))
        counts = np.ones(len(slots), np.int64) if counts is None else np.asarray(counts)
        if len(counts) != len(slots) or (len(counts) and counts.min() < 0):
            return None
        bs = self._block_size[t.cls[slots]]
        nt = t.ntok[slots]
        return int((-(-(nt + counts) // bs) + (nt // -bs)).sum())
