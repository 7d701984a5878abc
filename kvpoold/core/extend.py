"""Appending tokens: ``extend`` and its wire form ``extend_columns``.

The hot call is ``extend_columns``: a batch as three flat arrays (ids, token
counts, tokens), processed with vectorised checks; only sequences that cross a
block boundary take a Python-level step.  A sequence whose partly filled last
block is shared copies it first (copy-on-write); reserve claims let the
client hand its own reserved blocks to its sequences.
"""

from __future__ import annotations

from collections import deque
from typing import Callable, Iterable, Mapping

import numpy as np

from kvpool.protocol.sizes import cdiv

from .block_pool import LayoutClass
from .errors import InvalidArgument, OutOfBlocks, WrongState
from .hashing import _digest, pack_tokens
from .results import BlockCopy, ExtendItem, ExtendDeltas, SeqDelta
from .seq_table import SeqTable
from .state import Owners, check_owner, refuse_swapped

_NO_CHANGE = ExtendDeltas()  # immutable, so one instance serves every unchanged step


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



class Extending:
    """``extend``: appending tokens to sequences, copy-on-write and reserve claims."""

    def __init__(self, registry, seqs: SeqTable, owners: Owners) -> None:
        self._registry = registry  # ``classes.ClassRegistry``
        self._seqs = seqs
        self._owners = owners

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
        *,
        admit: Callable[[int], None] | None = None,
    ) -> ExtendDeltas:
        """``extend`` for a batch given as flat arrays (the wire format).

        ``tokens`` holds ``counts[i]`` tokens for ``seq_ids[i]``, in order
        (``counts=None``: exactly one token each, the decode step); ``claims``
        holds ``claim_counts[i]`` reserved blocks for it.  All the sequences
        must be of one layout class (a session has one layout).  ``admit``, if
        given, is called with the new blocks the call adds to the page tables
        (before copy-on-write) once the call is known to be well formed and
        before anything changes: it may raise to refuse the call (a quota).
        """
        check_owner(owner)
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
        t = self._seqs
        slots = t.slots_of(owner, seq_ids)
        if t.nswapped and t.swapped[slots].any():
            refuse_swapped(seq_ids[np.flatnonzero(t.swapped[slots])[0]], "extended")
        c0 = int(t.cls[slots[0]])
        if len(self._registry.classes) > 1 and not (t.cls[slots] == c0).all():
            # one layout class per call keeps the capacity check exact (a session has one layout)
            raise InvalidArgument("one extend call takes sequences of one layout class only")
        pool = self._registry.classes[c0]
        bs = pool.block_size
        nt = t.ntok[slots]
        if one_each and claim_counts is None and claims is None \
                and not (t.flagged and t.maybe_shared[slots].any()):
            return self._extend_one_each(owner, pool, slots, seq_ids, nt, tokens, admit)
        if counts is None:
            counts = np.ones(n, np.int64)
        if counts.min() < 0:
            raise InvalidArgument("token counts must be >= 0")
        if int(counts.sum()) != len(tokens):
            raise InvalidArgument(f"token counts add up to {int(counts.sum())} but {len(tokens)} tokens were sent")
        new_nt = nt + counts
        grow = cdiv(new_nt, bs) - cdiv(nt, bs)  # new blocks
        cow = self._plan_copy_on_write(pool, slots, nt, counts)
        has = None
        if claim_counts is not None or claims is not None:
            has, claims, claimed_at = self._check_claims(owner, c0, seq_ids, counts, grow, cow, claim_counts, claims)
            claims_per = np.diff(claimed_at)
            need = grow + cow - np.where(has, claims_per, 0)
        else:
            need = grow + cow
        if admit is not None:
            admit(int(grow.sum()))
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
                self._registry.counters[c0].cow_copies += 1
                first -= 1
            g = int(grow[i])
            if has is not None and has[i]:
                mine = claims[claimed_at[i]:claimed_at[i + 1]].tolist()
                self._owners.take_reserved(owner, c0, mine)
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
        t = self._seqs
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
        if self._seqs.n_unconfirmed:
            pool.prefix.confirm(self._seqs.take_unconfirmed_many(slots), owner)

    def _extend_one_each(self, owner: int, pool: LayoutClass, slots, seq_ids, nt, tokens, admit) -> ExtendDeltas:
        """Steady decode: one token for each sequence, none of them sharing its last block."""
        t = self._seqs
        bs = pool.block_size
        pos = nt % bs
        starts = (pos == 0).nonzero()[0]  # these need a new block
        if admit is not None:
            admit(len(starts))
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
            last_hash, all_blocks = t.last_hash, t.blocks
            done = filled.tolist()
            digests = [_digest(last_hash[slot] + raw[i * step:(i + 1) * step]) for i, slot in enumerate(done)]
            deque(map(last_hash.__setitem__, done, digests), 0)
            blocks = [all_blocks[slot][-1] for slot in done]
            named = pool.prefix.register_many(blocks, digests, writer=owner)
            if len(named) < len(blocks):  # a hash the device has already: that block stays unnamed
                kept = set(named)
                done = [slot for slot, b in zip(done, blocks) if b in kept]
            t.add_unconfirmed_each(done, named)
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
        reserve = self._owners.reserve(owner, c0)
        starts = np.concatenate(([0], np.cumsum(claim_counts)))
        seen: set[int] = set()
        for b in claims.tolist():
            if b not in reserve or b in seen:
                raise InvalidArgument(f"block {b} is not in this session's reserve")
            seen.add(b)
        return has, claims, starts

    def _append_general(self, owner: int, pool: LayoutClass, slots, nt, counts, tokens) -> None:
        t = self._seqs
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
                    if pool.prefix.register(b, parent, writer=owner):
                        t.add_unconfirmed(slot, b)
                    pos = 0
            t.last_hash[slot] = parent

