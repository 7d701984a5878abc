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

The hot call is :meth:`extend_columns`: a batch as three flat arrays (ids,
token counts, tokens), processed with vectorised checks; only sequences that
cross a block boundary take a Python-level step.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from itertools import repeat
from typing import Iterable, Mapping

import numpy as np

from .block_pool import DEFAULT_CHUNK_BYTES, ChunkBudget, LayoutClass
from .errors import InvalidArgument, OutOfBlocks, WrongState
from .hashing import _digest, chain_hashes, pack_tokens, root_hash
from .layout import Geometry
from .results import (
    BlockCopy,
    ClassStats,
    ExtendItem,
    ExtendDeltas,
    LookupResult,
    ManagerStats,
    SeqDelta,
    PageTable,
    TierStats,
)
from .seq_table import SeqTable
from .tiers import Key, MovePlan, Tier, TierPlacement

_NO_CHANGE = ExtendDeltas()  # immutable, so one instance serves every unchanged step


@dataclass
class _Counters:
    cow_copies: int = 0
    prefix_queries: int = 0
    prefix_hits: int = 0
    prefix_query_tokens: int = 0
    prefix_hit_tokens: int = 0
    promoted_blocks: int = 0
    demoted_blocks: int = 0
    swapped_out_blocks: int = 0
    swapped_in_blocks: int = 0
    lost_blocks: int = 0


class _Owner:
    __slots__ = ("seqs", "reserves")

    def __init__(self) -> None:
        self.seqs: set[int] = set()  # sequence ids
        self.reserves: dict[int, dict[int, None]] = {}  # class id -> reserved blocks, in grant order


def _as_array(values, dtype, name: str) -> np.ndarray:
    if type(values) is np.ndarray and values.dtype == dtype and values.ndim == 1:
        return values  # the wire path: already the right kind
    try:
        arr = np.asarray(values)
    except (TypeError, ValueError) as exc:
        raise InvalidArgument(f"{name}: {exc}") from None
    if arr.ndim != 1:
        raise InvalidArgument(f"{name} must be one-dimensional, got shape {arr.shape}")
    if arr.size and arr.dtype.kind not in "iu":
        raise InvalidArgument(f"{name} must hold integers, got {arr.dtype}")
    if arr.size and arr.dtype != dtype:
        info = np.iinfo(dtype)
        if arr.min() < info.min or arr.max() > info.max:
            raise InvalidArgument(f"{name} out of range for {np.dtype(dtype).name}")
    return arr.astype(dtype, copy=False)


class KVCacheManager:
    """Block bookkeeping for a whole pool of several layout classes."""

    def __init__(
        self,
        pool_bytes: int,
        *,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        host_bytes: int = 0,
        disk_bytes: int = 0,
        policy: str = "lru",
        max_reserve_blocks: int = 1024,
        tier_align: int = 1,
    ) -> None:
        for name, value in (("pool_bytes", pool_bytes), ("chunk_bytes", chunk_bytes)):
            if type(value) is not int or value <= 0:
                raise InvalidArgument(f"{name} must be a positive integer, got {value!r}")
        if pool_bytes < chunk_bytes:
            raise InvalidArgument(f"pool_bytes ({pool_bytes}) is smaller than one chunk ({chunk_bytes})")
        if type(max_reserve_blocks) is not int or max_reserve_blocks < 0:
            raise InvalidArgument(f"max_reserve_blocks must be >= 0, got {max_reserve_blocks!r}")
        self.budget = ChunkBudget(pool_bytes // chunk_bytes, chunk_bytes)
        self.placement = TierPlacement(host_bytes, disk_bytes, policy, tier_align)
        self._track_moves = host_bytes > 0 or disk_bytes > 0
        self.policy = policy
        self.max_reserve_blocks = max_reserve_blocks
        self.classes: list[LayoutClass] = []
        self._counters: list[_Counters] = []
        self._class_ids: dict[Geometry, int] = {}
        self._block_size = np.zeros(0, np.int64)  # class id -> block size
        self.seqs = SeqTable()
        self._owners: dict[int, _Owner] = {}
        self._moves = MovePlan()  # planned tier moves, as columns (drained by the daemon after each call)
        #: swapped-out sequences: slot -> (tier keys, block hashes or None), one each per logical block
        self._swapped: dict[int, tuple[list[Key], list[bytes | None]]] = {}
        self._next_swap = 0
        #: per class, block -> holds taken by the daemon while bytes are in flight into the block
        self._holds: list[dict[int, int]] = []

    # -- classes ----------------------------------------------------------------
    def register_class(self, geometry: Geometry) -> int:
        """The class id of ``geometry``, creating the class on first use."""
        if not isinstance(geometry, Geometry):
            raise InvalidArgument(f"expected a Geometry, got {type(geometry).__name__}")
        cid = self._class_ids.get(geometry)
        if cid is None:
            cid = len(self.classes)
            pool = LayoutClass(cid, geometry, self.budget, self.policy, self._on_evict)
            self.classes.append(pool)
            self._counters.append(_Counters())
            self._holds.append({})
            self._class_ids[geometry] = cid
            self._block_size = np.append(self._block_size, geometry.block_size)
            self.seqs.ensure_tail_width(geometry.block_size)
        return cid

    def class_of(self, geometry: Geometry) -> int | None:
        """The class id of ``geometry`` if registered, else None."""
        return self._class_ids.get(geometry)

    def class_pool(self, class_id: int) -> LayoutClass:
        if type(class_id) is not int or not 0 <= class_id < len(self.classes):
            raise InvalidArgument(f"unknown layout class {class_id!r}")
        return self.classes[class_id]

    def _on_evict(self, class_id: int, blocks: list[int], digests: list[bytes]) -> None:
        """A batch of cached blocks was evicted, oldest first: demote them (one plan for the batch)."""
        if self._track_moves:
            keys = list(zip(repeat(class_id), digests))
            placed = self.placement.demote_many(self._moves, keys, self.classes[class_id].block_bytes, blocks)
            self._counters[class_id].demoted_blocks += placed

    def drain_moves(self) -> MovePlan:
        """Tier moves planned since the last call, as columns (for the transfer engine)."""
        out, self._moves = self._moves, MovePlan()
        return out

    def drain_slab_changes(self) -> list[tuple[str, int, int, int]]:
        """("take" | "release", class id, byte offset, bytes) of slabs since the last call.

        The daemon commits the memory of taken slabs and releases that of
        returned ones; a slab can appear as released and taken again.
        """
        out = []
        for pool in self.classes:
            taken, released = pool.drain_slab_changes()
            span = pool.blocks_per_slab * pool.block_bytes
            out.extend(("release", pool.class_id, slot * span, pool.slab_bytes) for slot in released)
            out.extend(("take", pool.class_id, slot * span, pool.slab_bytes) for slot in taken)
        return out

    # -- owners and sequence lookups ----------------------------------------------
    @staticmethod
    def _check_owner(owner) -> None:
        if type(owner) is not int:
            raise InvalidArgument(f"owner must be an int, got {type(owner).__name__}")

    def _owner(self, owner: int) -> _Owner:
        state = self._owners.get(owner)
        if state is None:
            self._check_owner(owner)
            state = self._owners[owner] = _Owner()
        return state

    def _info(self, slot: int) -> PageTable:
        t = self.seqs
        return PageTable(
            t.seq_id(slot), int(t.cls[slot]), tuple(t.blocks[slot]), int(t.ntok[slot]), int(t.num_cached[slot]),
            bool(t.swapped[slot]),
        )

    def sequence(self, owner: int, seq_id: int) -> PageTable:
        return self._info(self.seqs.slot_of(owner, seq_id))

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
        self, owner: int, class_id: int, model_id: str, tokens, extra_key: str = ""
    ) -> PageTable:
        """A new sequence holding ``tokens``; reuses the longest cached prefix."""
        pool = self.class_pool(class_id)
        packed = pack_tokens(tokens)
        root = root_hash(model_id, extra_key)
        self._check_owner(owner)
        bs = pool.block_size
        hashes = chain_hashes(root, packed, bs)
        # the longest cached prefix over every tier: a device block, or -1 for a lower-tier hit
        matched, lower, lower_keys, holder = self._match(pool, owner, hashes)
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
        runs = placement.pin_many(lower_keys, holder)
        fresh = pool.allocate(need)
        if lower:
            promoted = fresh[:len(lower)]
            placement.take_many(self._moves, lower_keys, promoted, pinned=True, runs=runs)
            pool.register_many(promoted, lower)
            if len(lower) == len(matched):
                matched = promoted
            else:
                arr = np.asarray(matched, np.int64)
                arr[arr < 0] = promoted
                matched = arr.tolist()
            fresh = fresh[len(lower):]
        unconfirmed = pool.register_many(fresh[:len(hashes) - len(matched)], hashes[len(matched):], writer=owner)
        c = self._counters[class_id]
        c.prefix_queries += 1
        c.prefix_hits += bool(matched)
        c.prefix_query_tokens += len(packed)
        c.prefix_hit_tokens += len(matched) * bs
        c.promoted_blocks += len(lower)
        state = self._owner(owner)
        t = self.seqs
        seq_id = t.add(owner, class_id, matched + fresh, len(packed),
                       hashes[-1] if hashes else root, len(matched) * bs)
        rest = packed[len(hashes) * bs:]
        t.tail[seq_id & 0xFFFFFFFF, : len(rest)] = rest
        t.add_unconfirmed_many(seq_id & 0xFFFFFFFF, unconfirmed)
        state.seqs.add(seq_id)
        return self._info(seq_id & 0xFFFFFFFF)

    def _match(self, pool: LayoutClass, owner: int, hashes: list[bytes]):
        """The longest prefix of ``hashes`` cached on some tier that ``owner`` may use.

        Returns its device blocks (-1 where a lower tier holds the block), the hashes of those
        lower-tier blocks and their tier keys, in order, and the one lower tier that holds all of
        them (None: several, or none).  One C-level lookup per tier for the whole prompt.
        """
        n = len(hashes)
        on_dev = list(map(pool.by_hash.get, hashes))
        hit = np.fromiter(map(pool.by_hash.__contains__, hashes), np.bool_, n)
        holders = []  # (lower tier, its hits)
        if self._track_moves:
            keys = None
            for index in self.placement.lower:
                if len(index):
                    if keys is None:
                        keys = list(zip(repeat(pool.class_id), hashes))
                    mine = np.fromiter(map(index._sizes.__contains__, keys), np.bool_, n)
                    holders.append((index, mine))
                    hit |= mine
        miss = np.flatnonzero(~hit)
        length = int(miss[0]) if len(miss) else n
        matched = on_dev[:length]
        if pool.unwritten and not pool.unwritten.keys().isdisjoint(matched):
            for i, b in enumerate(matched):  # another session may still be writing some of them
                if b is not None and not pool.visible(b, owner):
                    matched = matched[:i]
                    break
        on_lower = matched.count(None)
        if on_lower == 0:
            return matched, [], [], None
        if on_lower == len(matched):  # all from the lower tiers (a promotion): slices, no pass
            lower, lower_keys = hashes[:on_lower], keys[:on_lower]
            matched = [-1] * on_lower
        else:
            lower = [h for h, b in zip(hashes, matched) if b is None]
            lower_keys = [k for k, b in zip(keys, matched) if b is None]
            matched = [-1 if b is None else b for b in matched]
        holder = None
        if len(holders) == 1:
            holder = holders[0][0]  # the only lower tier with entries: it holds every lower hit
        return matched, lower, lower_keys, holder

    def extend(self, owner: int, items: Mapping[int, object] | Iterable[ExtendItem]) -> ExtendDeltas:
        """Append tokens to many sequences in one call; returns only what changed.

        ``items`` maps sequence ids to token lists, or is a list of
        ``ExtendItem`` (which may carry reserve claims).
        """
        if isinstance(items, Mapping):
            items = [ExtendItem(k, v) for k, v in items.items()]
        ids, counts, packed, claim_counts, claims = [], [], [], [], []
        for item in items:
            if not isinstance(item, ExtendItem):
                raise InvalidArgument(f"extend takes ExtendItem objects, got {type(item).__name__}")
            if type(item.seq_id) is not int:
                raise InvalidArgument(f"sequence ids are integers, got {type(item.seq_id).__name__}")
            p = pack_tokens(item.tokens)
            ids.append(item.seq_id)
            counts.append(len(p))
            packed.append(p)
            claim_counts.append(len(item.claimed))
            claims.extend(item.claimed)
        tokens = np.concatenate([np.frombuffer(p, "<u4") for p in packed]) if packed else np.zeros(0, "<u4")
        return self.extend_columns(
            owner, _as_array(ids, np.int64, "sequence ids"), np.asarray(counts, np.int64), tokens,
            np.asarray(claim_counts, np.int64) if claims else None,
            _as_array(claims, np.int64, "claimed blocks") if claims else None,
        )

    def extend_columns(
        self,
        owner: int,
        seq_ids,
        counts,
        tokens,
        claim_counts=None,
        claims=None,
    ) -> ExtendDeltas:
        """``extend`` for a batch given as flat arrays (the wire format).

        ``tokens`` holds ``counts[i]`` tokens for ``seq_ids[i]``, in order
        (``counts=None``: exactly one token each, the decode step); ``claims``
        holds ``claim_counts[i]`` reserved blocks for it.  All the sequences
        must be of one layout class (a session has one layout).
        """
        self._check_owner(owner)
        seq_ids = _as_array(seq_ids, np.int64, "sequence ids")
        tokens = _as_array(tokens, np.uint32, "token ids")
        n = len(seq_ids)
        if counts is None:
            if len(tokens) != n:
                raise InvalidArgument(
                    f"without token counts each sequence takes one token: {n} sequences, {len(tokens)} tokens"
                )
            one_each = True
        else:
            counts = _as_array(counts, np.int64, "token counts")
            if len(counts) != n:
                raise InvalidArgument(f"{n} sequence ids but {len(counts)} token counts")
            one_each = len(tokens) == n and bool((counts == 1).all())
        if n == 0:
            if len(tokens):
                raise InvalidArgument(f"no sequences but {len(tokens)} tokens were sent")
            return ExtendDeltas()
        t = self.seqs
        slots = t.slots_of(owner, seq_ids)
        if t.nswapped and t.swapped[slots].any():
            self._refuse_swapped(seq_ids[np.flatnonzero(t.swapped[slots])[0]], "extended")
        c0 = int(t.cls[slots[0]])
        if len(self.classes) > 1 and not (t.cls[slots] == c0).all():
            # one layout class per call keeps the capacity check exact (a session has one layout)
            raise InvalidArgument("one extend call takes sequences of one layout class only")
        pool = self.classes[c0]
        bs = pool.block_size
        nt = t.ntok[slots]
        if one_each and claim_counts is None and claims is None \
                and not (t.flagged and t.maybe_shared[slots].any()):
            return self._extend_one_each(owner, pool, slots, seq_ids, nt, tokens)
        if counts is None:
            counts = np.ones(n, np.int64)
        if counts.min() < 0:
            raise InvalidArgument("token counts must be >= 0")
        if int(counts.sum()) != len(tokens):
            raise InvalidArgument(f"token counts add up to {int(counts.sum())} but {len(tokens)} tokens were sent")
        new_nt = nt + counts
        grow = -(-new_nt // bs) + (nt // -bs)  # new blocks: ceil(new/bs) - ceil(old/bs)
        cow = self._plan_copy_on_write(pool, slots, nt, counts)
        has = None
        if claim_counts is not None or claims is not None:
            has, claims, claimed_at = self._check_claims(owner, c0, seq_ids, counts, grow, cow, claim_counts, claims)
            claims_per = np.diff(claimed_at)
            need = grow + cow - np.where(has, claims_per, 0)
        else:
            need = grow + cow
        total = int(need.sum())
        avail = pool.obtainable(total)
        if avail < total:
            raise OutOfBlocks(total, avail)
        # -- apply: block changes (a few sequences per step) --
        self._confirm_written(owner, pool, slots)
        fresh = iter(pool.allocate(total))
        deltas = []
        copies = []
        for i in np.flatnonzero((grow > 0) | cow).tolist():
            slot = int(slots[i])
            blocks = t.blocks[slot]
            first = len(blocks)
            if cow[i]:
                src = blocks[-1]
                dst = next(fresh)
                pool.release([src])
                blocks[-1] = dst
                copies.append(BlockCopy(c0, src, dst))
                self._counters[c0].cow_copies += 1
                first -= 1
            g = int(grow[i])
            if has is not None and has[i]:
                mine = claims[claimed_at[i]:claimed_at[i + 1]].tolist()
                reserve = self._owners[owner].reserves[c0]
                for b in mine:
                    del reserve[b]
                blocks.extend(mine)
                g -= len(mine)
            blocks.extend(next(fresh) for _ in range(g))
            deltas.append(SeqDelta(int(seq_ids[i]), first, tuple(blocks[first:])))
        t.unflag_shared(slots[(grow > 0) | cow])
        self._append_general(owner, pool, slots, nt, counts, tokens)
        t.ntok[slots] = new_nt
        return ExtendDeltas.from_deltas(deltas, copies)

    def _plan_copy_on_write(self, pool: LayoutClass, slots, nt, counts) -> np.ndarray:
        """Which sequences of the batch must copy their shared, partly filled last block.

        When every holder of such a block appends in this one call, the last
        of them keeps the block and the others copy it (one copy fewer).
        """
        t = self.seqs
        cow = np.zeros(len(slots), np.bool_)
        sharers: dict[int, list[int]] = {}
        for i in np.flatnonzero((counts > 0) & (nt % pool.block_size != 0) & t.maybe_shared[slots]).tolist():
            last = t.blocks[slots[i]][-1]
            if pool.is_shared(last):
                sharers.setdefault(last, []).append(i)
        for block, idx in sharers.items():
            keeper = idx[-1] if len(idx) == 1 + pool.extra[block] else None
            for i in idx:
                cow[i] = i != keeper
        return cow

    def _confirm_written(self, owner: int, pool: LayoutClass, slots) -> None:
        """A call on these sequences says the KV of the tokens they had before is written."""
        t = self.seqs
        if not t.n_unconfirmed:
            return
        pending = slots[t.has_unconfirmed[slots]]
        if not len(pending):
            return
        unconfirmed, unwritten = t.unconfirmed, pool.unwritten
        for slot in pending.tolist():  # SeqTable.take_unconfirmed + LayoutClass.confirm, inlined
            for b in unconfirmed[slot]:
                if unwritten.get(b) == owner:
                    del unwritten[b]
            unconfirmed[slot] = None
        t.has_unconfirmed[pending] = False
        t.n_unconfirmed -= len(pending)

    def _extend_one_each(self, owner: int, pool: LayoutClass, slots, seq_ids, nt, tokens) -> ExtendDeltas:
        """Steady decode: one token for each sequence, none of them sharing its last block."""
        t = self.seqs
        bs = pool.block_size
        pos = nt % bs
        starts = (pos == 0).nonzero()[0]  # these need a new block
        if len(starts):
            avail = pool.obtainable(len(starts))
            if avail < len(starts):
                raise OutOfBlocks(len(starts), avail)
        self._confirm_written(owner, pool, slots)
        fresh: list[int] = []
        if len(starts):
            fresh = pool.allocate(len(starts))
            all_blocks = t.blocks
            for slot, b in zip(slots[starts].tolist(), fresh):
                all_blocks[slot].append(b)
        t.tail[slots, pos] = tokens
        filled = slots[pos == bs - 1]
        if len(filled):
            raw = t.tail[filled, :bs].tobytes()  # the full blocks' tokens, one gather
            step = 4 * bs
            last_hash, all_blocks, by_hash, hash_of = t.last_hash, t.blocks, pool.by_hash, pool.hash_of
            unwritten, unconfirmed, newly = pool.unwritten, t.unconfirmed, []
            for i, slot in enumerate(filled.tolist()):
                h = _digest(last_hash[slot] + raw[i * step:(i + 1) * step])
                if h not in by_hash:  # LayoutClass.register(b, h, writer=owner), inlined for the hot path
                    b = all_blocks[slot][-1]
                    by_hash[h] = b
                    hash_of[b] = h
                    unwritten[b] = owner
                    if unconfirmed[slot] is None:  # SeqTable.add_unconfirmed, inlined
                        unconfirmed[slot] = [b]
                        newly.append(slot)
                    else:
                        unconfirmed[slot].append(b)
                last_hash[slot] = h
            if newly:
                t.has_unconfirmed[newly] = True
                t.n_unconfirmed += len(newly)
        t.ntok[slots] = nt + 1
        if not len(starts):
            return _NO_CHANGE
        # each delta is one new block at the old end (old length is a multiple of bs)
        return ExtendDeltas._adopt(
            seq_ids[starts], (nt[starts] // bs).astype(np.int32), np.ones(len(starts), np.int32),
            np.array(fresh, np.int32),
        )

    def _check_claims(self, owner, c0, seq_ids, counts, grow, cow, claim_counts, claims):
        """Validate reserve claims; returns (has-claims mask, claims, offsets)."""
        n = len(seq_ids)
        claim_counts = _as_array(claim_counts if claim_counts is not None else [], np.int64, "claim counts")
        claims = _as_array(claims if claims is not None else [], np.int64, "claimed blocks")
        if len(claim_counts) != n or (n and claim_counts.min() < 0) or int(claim_counts.sum()) != len(claims):
            raise InvalidArgument("claim counts must give one non-negative count per sequence, adding up to the claims")
        has = claim_counts > 0
        bad = has & ((claim_counts > grow) | cow)
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            if cow[i]:
                raise WrongState(
                    f"sequence {int(seq_ids[i])} shares its last block: extend it without claimed blocks"
                )
            raise InvalidArgument(
                f"sequence {int(seq_ids[i])} needs {int(grow[i])} new blocks for {int(counts[i])} tokens, "
                f"{int(claim_counts[i])} were claimed (claims may cover part of them, not more)"
            )
        state = self._owners.get(owner)
        reserve = state.reserves.get(c0, {}) if state else {}
        starts = np.concatenate(([0], np.cumsum(claim_counts)))
        seen: set[int] = set()
        for b in claims.tolist():
            if b not in reserve or b in seen:
                raise InvalidArgument(f"block {b} is not in this session's reserve")
            seen.add(b)
        return has, claims, starts

    def _append_general(self, owner: int, pool: LayoutClass, slots, nt, counts, tokens) -> None:
        t = self.seqs
        bs = pool.block_size
        offsets = np.concatenate(([0], np.cumsum(counts)))
        for i in np.flatnonzero(counts).tolist():
            slot = int(slots[i])
            pos, ntok = int(nt[i] % bs), int(nt[i])
            new = tokens[offsets[i]:offsets[i + 1]]
            row = t.tail[slot]
            parent = t.last_hash[slot]
            blocks = t.blocks[slot]
            k = 0
            while k < len(new):
                take = min(bs - pos, len(new) - k)
                row[pos:pos + take] = new[k:k + take]
                k += take
                pos += take
                if pos == bs:
                    parent = _digest(parent + row[:bs].tobytes())
                    b = blocks[(ntok + k) // bs - 1]
                    if pool.register(b, parent, writer=owner):
                        t.add_unconfirmed(slot, b)
                    pos = 0
            t.last_hash[slot] = parent

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
        child = child_id & 0xFFFFFFFF
        t.tail[child] = t.tail[slot]
        if ntok % pool.block_size:
            t.flag_shared(slot)
            t.flag_shared(child)
        self._owners[owner].seqs.add(child_id)
        return self._info(child)

    def check_free(self, owner: int, seq_ids: Iterable[int]) -> list[int]:
        """Validate a free without doing it; returns the slots."""
        slots = [self.seqs.slot_of(owner, i) for i in seq_ids]
        if len(set(slots)) != len(slots):
            raise InvalidArgument("a sequence appears twice in one free")
        return slots

    def mark_written(self, owner: int, seq_ids: Iterable[int]) -> None:
        """The owner says these sequences' KV is written: their full blocks become everyone's hits.

        Any later call on a sequence (extend, free, swap-out) says the same of
        the tokens it had before; this is for a sequence that has no next call
        soon (a prefill-only process, a prompt other sessions are waiting on).
        """
        t = self.seqs
        slots = self.check_free(owner, list(seq_ids))
        for slot in slots:
            self.classes[int(t.cls[slot])].confirm(t.take_unconfirmed(slot), owner)

    def free(self, owner: int, seq_ids: Iterable[int], *, written: bool = True) -> int:
        """Free sequences (tail blocks first); returns how many blocks were released.

        Freeing says the sequences' KV is written (their full blocks become
        every session's prefix hits); ``written=False`` (a session that died)
        drops the hashes of blocks it had not confirmed instead.
        """
        seq_ids = list(seq_ids)
        t = self.seqs
        slots = self.check_free(owner, seq_ids)
        released = 0
        for seq_id, slot in zip(seq_ids, slots):
            blocks = t.blocks[slot]
            pool = self.classes[int(t.cls[slot])]
            if written:
                pool.confirm(t.take_unconfirmed(slot), owner)
            else:
                pool.unregister_unwritten(t.take_unconfirmed(slot), owner)
            pool.release(blocks[::-1])
            released += len(blocks)
            if slot in self._swapped:  # a swapped-out sequence: its copies go
                self.placement.drop_many(self._moves, self._swapped.pop(slot)[0], pinned=True)
            t.remove(slot)
            self._owners[owner].seqs.discard(int(seq_id))
        return released

    # -- swapping whole sequences (tiers) ---------------------------------------------
    @staticmethod
    def _refuse_swapped(seq_id, what: str) -> None:
        raise WrongState(f"sequence {int(seq_id)} is swapped out: it cannot be {what} until it is swapped in")

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
        t = self.seqs
        slots = self.check_free(owner, seq_ids)
        for seq_id, slot in zip(seq_ids, slots):
            if t.swapped[slot]:
                raise WrongState(f"sequence {int(seq_id)} is already swapped out")
        if not self.placement.enabled:
            raise WrongState("no host or disk tier to swap to: start kvpoold with --host-bytes or --disk-bytes")
        runs = self.placement.runs(self.classes[int(t.cls[s])].block_bytes for s in slots for _ in t.blocks[s])
        if not self.placement.can_pin_runs(runs):
            raise OutOfBlocks(self.placement.charge_pinned_runs(runs), self.placement.pinned_room(),
                              "lower-tier bytes to swap to")
        # -- apply --
        per_tier = [0, 0]
        for slot in slots:
            c = int(t.cls[slot])
            pool = self.classes[c]
            blocks = t.blocks[slot]
            pool.confirm(t.take_unconfirmed(slot), owner)  # a swap-out comes after the sequence ran
            keys = list(zip(repeat(c), range(self._next_swap, self._next_swap + len(blocks))))
            self._next_swap += len(blocks)
            for i, n in enumerate(self.placement.place_pinned_many(self._moves, keys, pool.block_bytes, blocks)):
                per_tier[i] += n
            self._swapped[slot] = (keys, list(map(pool.hash_of.get, blocks)))
            pool.release(blocks[::-1])
            t.blocks[slot] = []
            t.unflag_shared(np.array([slot]))
            t.set_swapped(slot, True)
            self._counters[c].swapped_out_blocks += len(blocks)
        return per_tier[0], per_tier[1]

    def swap_in(self, owner: int, seq_ids: Iterable[int]) -> list[PageTable]:
        """Bring swapped-out sequences back onto the device, possibly into other blocks.

        A block whose hash is on the device already (cached or held) is
        shared instead of copied; the others get fresh blocks that the planned
        moves fill.  All or nothing; one layout class per call.
        """
        seq_ids = list(seq_ids)
        t = self.seqs
        slots = self.check_free(owner, seq_ids)
        for seq_id, slot in zip(seq_ids, slots):
            if not t.swapped[slot]:
                raise WrongState(f"sequence {int(seq_id)} is not swapped out")
        if not slots:
            return []
        classes = {int(t.cls[s]) for s in slots}
        if len(classes) > 1:
            raise InvalidArgument("one swap-in call takes sequences of one layout class only")
        c = classes.pop()
        pool = self.classes[c]
        plan: list[list[int]] = []  # per sequence, the device block of each hash found there, else -1
        on_device: list[int] = []
        for slot in slots:
            row = list(map(pool.by_hash.get, self._swapped[slot][1], repeat(-1)))  # None is no hash: -1
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
            keys, hashes = self._swapped.pop(slot)
            if row.count(-1) == len(row):  # every block comes back from below
                blocks = fresh[used:used + len(row)]
                self.placement.take_many(self._moves, keys, blocks, pinned=True)
            else:
                blocks = list(row)
                copy = [i for i, b in enumerate(row) if b < 0]
                for i, b in zip(copy, fresh[used:used + len(copy)]):
                    blocks[i] = b
                self.placement.drop_many(self._moves, [k for k, b in zip(keys, row) if b >= 0], pinned=True)
                self.placement.take_many(self._moves, [keys[i] for i in copy], [blocks[i] for i in copy], pinned=True)
                hashes = [hashes[i] for i in copy]
            copied = blocks if len(hashes) == len(blocks) else [blocks[i] for i in copy]
            used += len(copied)
            if hashes.count(None) < len(hashes):
                named = [(b, h) for b, h in zip(copied, hashes) if h is not None]
                pool.register_many([b for b, _ in named], [h for _, h in named])
            t.blocks[slot] = blocks
            t.set_swapped(slot, False)
            self._counters[c].swapped_in_blocks += len(blocks)
            out.append(self._info(slot))
        return out

    # -- the daemon's side of transfers ------------------------------------------------
    def hold_blocks(self, class_id: int, blocks: Iterable[int]) -> None:
        """One more holder on each (held) block while bytes are copied into it.

        A block with a hold is never freed, evicted or handed out again, even
        if its sequence is freed meanwhile; ``release_holds`` ends the hold.
        """
        pool = self.class_pool(class_id)
        blocks = list(blocks)
        if not self._all_held(pool, blocks):
            for b in blocks:
                if b in pool.cached or not pool.owns(b):
                    raise InvalidArgument(f"block {b} is not held: only held blocks take a transfer hold")
        holds = self._holds[class_id]
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
        pool = self.class_pool(class_id)
        blocks = list(blocks)
        holds = self._holds[class_id]
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
        pool = self.class_pool(class_id)
        self._counters[class_id].lost_blocks += 1
        digest = pool.hash_of.pop(block, None)
        if digest is None:
            return None
        del pool.by_hash[digest]
        pool.unwritten.pop(block, None)
        if block in pool.cached:  # nobody holds it: it is free now
            pool.cached.remove(block)
            pool.free.append(block)
        return digest

    def register_block(self, owner: int, seq_id: int, block: int, digest: bytes) -> bool:
        """Give a block of ``seq_id`` its hash back: its owner was told to rewrite it.

        Like a fresh block at ``create``, it is in the prefix index from the
        moment its owner is to write it.  False (nothing changes) if the
        sequence does not hold it or another block has that hash.
        """
        info = self.sequence(owner, seq_id)
        pool = self.classes[info.class_id]
        if block not in info.block_table or block in pool.hash_of:
            return False
        if not pool.register(block, digest, writer=owner):
            return False
        self.seqs.add_unconfirmed(self.seqs.slot_of(owner, seq_id), block)
        return True

    def forget_lower(self, key: Key) -> bool:
        """A lower-tier copy was lost (its write failed): forget it unless it is pinned.

        A swapped-out sequence's copy stays recorded: its swap-in reports the loss.
        """
        tier = self.placement.locate(key)
        if tier is None or self.placement.index(tier).is_pinned(key):
            return False
        self.placement.drop(None, key)
        self.placement.index(tier).dropped += 1
        return True

    def load_lower(self, tier: Tier, class_id: int, digest: bytes, nbytes: int) -> bool:
        """Record a prefix block found in a lower tier at start (a restart); False if it has no room."""
        self.class_pool(class_id)
        index = self.placement.index(tier)
        key = (class_id, digest)
        if key in index or index.used + index.charge(nbytes) > index.capacity:
            return False
        index.add(key, nbytes)
        index.blocks_in -= 1  # found, not placed
        return True

    def lookup(
        self, class_id: int, model_id: str, tokens, extra_key: str = "", owner: int | None = None
    ) -> LookupResult:
        """Longest cached prefix of ``tokens`` over every tier that ``owner`` may use; allocates nothing."""
        pool = self.class_pool(class_id)
        packed = pack_tokens(tokens)
        hashes = chain_hashes(root_hash(model_id, extra_key), packed, pool.block_size)
        per_tier = [0, 0, 0]
        for h in hashes:
            b = pool.by_hash.get(h)
            if b is not None:
                if not pool.visible(b, owner):
                    break  # another session is still writing it
                per_tier[0] += 1
                continue
            tier = self.placement.locate((class_id, h))
            if tier is None:
                break
            per_tier[tier] += 1
        bs = pool.block_size
        c = self._counters[class_id]
        c.prefix_queries += 1
        c.prefix_hits += bool(sum(per_tier))
        c.prefix_query_tokens += len(packed)
        c.prefix_hit_tokens += sum(per_tier) * bs
        return LookupResult(sum(per_tier) * bs, per_tier[0] * bs, per_tier[1] * bs, per_tier[2] * bs)

    # -- reserves ----------------------------------------------------------------
    def grant_reserve(self, owner: int, class_id: int, target: int) -> tuple[int, ...]:
        """Top the owner's reserve up towards ``target`` blocks; returns the blocks added.

        Best effort and cheap: reserves take free memory only, they never evict
        the prefix cache or take memory from other classes.
        """
        pool = self.class_pool(class_id)
        if type(target) is not int or target < 0:
            raise InvalidArgument(f"reserve target must be a non-negative integer, got {target!r}")
        self._check_owner(owner)
        current = self._owners[owner].reserves.get(class_id, {}) if owner in self._owners else {}
        want = min(target, self.max_reserve_blocks) - len(current)
        cheap = len(pool.free) + (self.budget.free // pool.slab_chunks) * pool.blocks_per_slab
        n = min(want, cheap)
        if n <= 0:
            return ()
        ids = pool.allocate(n)
        self._owner(owner).reserves.setdefault(class_id, {}).update(dict.fromkeys(ids))
        return tuple(ids)

    def check_reserve_return(self, owner: int, class_id: int, blocks: Iterable[int] | None = None) -> list[int]:
        """Validate a reserve return without doing it; returns the blocks."""
        self.class_pool(class_id)
        state = self._owners.get(owner)
        reserve = state.reserves.get(class_id, {}) if state else {}
        blocks = list(reserve) if blocks is None else list(blocks)
        if len(set(blocks)) != len(blocks):
            raise InvalidArgument("a block appears twice in one reserve return")
        for b in blocks:
            if b not in reserve:
                raise InvalidArgument(f"block {b!r} is not in this session's reserve")
        return blocks

    def return_reserve(self, owner: int, class_id: int, blocks: Iterable[int] | None = None) -> int:
        """Give reserved blocks back (all of them when ``blocks`` is None)."""
        pool = self.class_pool(class_id)
        blocks = self.check_reserve_return(owner, class_id, blocks)
        reserve = self._owners[owner].reserves[class_id] if blocks else {}
        for b in blocks:
            del reserve[b]
        pool.release(blocks)
        return len(blocks)

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

    def stats(self) -> ManagerStats:
        reserved = [0] * len(self.classes)
        swapped = [0] * len(self.classes)
        for slot in self._swapped:
            swapped[int(self.seqs.cls[slot])] += 1
        for state in self._owners.values():
            for cls, r in state.reserves.items():
                reserved[cls] += len(r)
        classes = []
        for pool, c in zip(self.classes, self._counters):
            classes.append(
                ClassStats(
                    class_id=pool.class_id,
                    geometry=pool.geometry.describe(),
                    block_bytes=pool.block_bytes,
                    capacity_blocks=pool.num_block_ids,
                    total_blocks=pool.total_blocks,
                    used_blocks=pool.held_blocks,
                    reserved_blocks=reserved[pool.class_id],
                    cached_blocks=len(pool.cached),
                    free_blocks=len(pool.free),
                    cow_copies=c.cow_copies,
                    evictions=pool.evictions,
                    prefix_queries=c.prefix_queries,
                    prefix_hits=c.prefix_hits,
                    prefix_query_tokens=c.prefix_query_tokens,
                    prefix_hit_tokens=c.prefix_hit_tokens,
                    promoted_blocks=c.promoted_blocks,
                    demoted_blocks=c.demoted_blocks,
                    swapped_out_blocks=c.swapped_out_blocks,
                    swapped_in_blocks=c.swapped_in_blocks,
                    swapped_sequences=swapped[pool.class_id],
                    lost_blocks=c.lost_blocks,
                )
            )
        tiers = tuple(
            TierStats(t.tier.name.lower(), t.capacity, t.used, len(t), pinned_bytes=t.pinned,
                      blocks_in=t.blocks_in, blocks_out=t.blocks_out, dropped_blocks=t.dropped)
            for t in self.placement.lower
        )
        return ManagerStats(
            pool_bytes=self.budget.total * self.budget.chunk_bytes,
            chunk_bytes=self.budget.chunk_bytes,
            free_chunks=self.budget.free,
            sequences=self.seqs.live,
            owners=len(self._owners),
            classes=tuple(classes),
            tiers=tiers,
        )

    def check_invariants(self) -> None:
        """Assert every invariant of the bookkeeping (for tests and ``kvpoolctl check``)."""
        t = self.seqs
        holders: list[dict[int, int]] = [dict() for _ in self.classes]
        live = t.live_slots()
        assert len(live) == t.live, "live sequence count is off"
        for slot in live.tolist():
            c = int(t.cls[slot])
            pool = self.classes[c]
            bs, ntok = pool.block_size, int(t.ntok[slot])
            blocks = t.blocks[slot]
            seq_id = t.seq_id(slot)
            if t.swapped[slot]:
                assert not blocks, f"sequence {seq_id}: swapped out but holds device blocks"
                entries = self._swapped.get(slot)
                assert entries is not None and len(entries[0]) == len(entries[1]) == -(-ntok // bs), (
                    f"sequence {seq_id}: swap copies")
                for key in entries[0]:
                    tier = self.placement.locate(key)
                    assert tier is not None and self.placement.index(tier).is_pinned(key), (
                        f"sequence {seq_id}: swap copy {key} is not pinned in a lower tier")
            else:
                assert slot not in self._swapped, f"sequence {seq_id}: a swap record but not swapped"
            assert len(blocks) == -(-ntok // bs) or t.swapped[slot], f"sequence {seq_id}: blocks vs tokens"
            owner = int(t.owner[slot])
            assert seq_id in self._owners[owner].seqs, f"sequence {seq_id} missing from its owner"
            if ntok % bs and len(blocks) and pool.is_shared(blocks[-1]) and not t.maybe_shared[slot]:
                # a shared partial block must be flagged, or an append would skip copy-on-write
                sharers = sum(1 for s in live.tolist() if t.blocks[s] and t.blocks[s][-1] == blocks[-1]
                              and int(t.ntok[s]) % bs and int(t.cls[s]) == c)
                assert sharers <= 1, f"sequence {seq_id}: shared partial block not flagged"
            for b in blocks:
                holders[c][b] = holders[c].get(b, 0) + 1
        for owner, state in self._owners.items():
            for seq_id in state.seqs:
                assert int(t.owner[seq_id & 0xFFFFFFFF]) == owner and t.seq_id(seq_id & 0xFFFFFFFF) == seq_id
            for c, reserve in state.reserves.items():
                for b in reserve:
                    holders[c][b] = holders[c].get(b, 0) + 1
        for c, holds in enumerate(self._holds):
            for b, n in holds.items():
                holders[c][b] = holders[c].get(b, 0) + n
        assert set(self._swapped) <= set(live.tolist()), "a swap record of a freed sequence"
        assert t.nswapped == len(self._swapped) == int(np.count_nonzero(t.swapped[live])), "swapped count is off"
        swap_keys = {k for keys, _ in self._swapped.values() for k in keys}
        pinned = set().union(*(index.pinned_keys() for index in self.placement.lower))
        assert pinned == swap_keys, "pinned lower-tier entries differ from the swapped sequences' copies"
        assert sum(len(s.seqs) for s in self._owners.values()) == t.live
        assert t.flagged == int(np.count_nonzero(t.maybe_shared[live])), "shared-tail flag count is off"
        unconfirmed = {}
        for slot in live.tolist():
            for b in t.unconfirmed[slot] or ():
                key = (int(t.cls[slot]), b)
                assert key not in unconfirmed, f"block {b} unconfirmed by two sequences"
                unconfirmed[key] = int(t.owner[slot])
                assert b in t.blocks[slot] or t.swapped[slot], f"unconfirmed block {b} not in its sequence"
        assert t.n_unconfirmed == sum(1 for slot in live.tolist() if t.unconfirmed[slot]), "unconfirmed count is off"
        for pool in self.classes:
            for b, writer in pool.unwritten.items():
                assert unconfirmed.get((pool.class_id, b)) == writer, f"unwritten block {b} has no confirming sequence"
        assert not t.maybe_shared[t.owner == -1].any(), "a free slot is flagged"
        used_chunks = 0
        for pool in self.classes:
            refs = pool.check()
            assert refs == holders[pool.class_id], (
                f"class {pool.class_id}: ref counts differ from page-table holders"
            )
            used_chunks += len(pool.slots) * pool.slab_chunks
        assert used_chunks + self.budget.free == self.budget.total, "chunks lost or double counted"
        self.placement.check()
