"""Sequences a call returned while bytes of their blocks are still arriving.

A sequence that a call (create, swap-in) returns with blocks still arriving
(``tier_inflight``) gets a *pending record*: a ``Tracked``.  ``Create`` and
``SwapIn`` either await its batches before replying (the default) or reply at
once with the positions still arriving, and the client awaits them later with
``Wait``.  A block whose bytes failed to arrive makes every record that
contains it report fewer valid tokens: the client recomputes the KV from
there, and the hash the block lost is registered again for the sequence that
rewrites it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvpool.protocol.sizes import cdiv
from kvpoold.core import KVCacheManager, KvpoolError
from kvpoold.core.results import PageTable
from kvpoold.transfer import Arrivals

from .tier_inflight import InFlight


@dataclass
class Tracked:
    """A sequence a call returned, and the bytes it still waits for."""

    info: PageTable
    #: per batch its blocks wait on: (positions in the block table, Arrivals, indices in the batch)
    parts: list
    valid_tokens: int  # tokens whose KV is there (or arriving) as far as is known now

    @property
    def arrivals(self) -> list:
        """(positions, batch) per batch; a caller waits for the batches not ``done``."""
        return [(pos, a) for pos, a, _ in self.parts]

    @property
    def arriving(self) -> list[int]:
        """Positions in the block table whose bytes are still on their way."""
        out: list[int] = []
        for pos, a, idx in self.parts:
            if not a.done:
                out.extend(pos[a.state[idx] == Arrivals.ARRIVING].tolist())
        return sorted(out)


class _Found:
    """Where blocks sit in a set of batches: block -> (batch, index in it), by sorting (no dict per block)."""

    def __init__(self, batches: list) -> None:
        self.batches = batches
        if batches:
            blocks = np.concatenate([a.blocks for a in batches])
            which = np.repeat(np.arange(len(batches)), [len(a) for a in batches])
            index = np.concatenate([np.arange(len(a)) for a in batches])
        else:
            blocks = which = index = np.zeros(0, np.int64)
        order = np.argsort(blocks, kind="stable")
        self.blocks, self.which, self.index = blocks[order], which[order], index[order]

    def find(self, table: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(positions of ``table`` found, their batch numbers, their indices); the latest batch wins."""
        if not len(self.blocks) or not len(table):
            z = np.zeros(0, np.int64)
            return z, z, z
        at = np.searchsorted(self.blocks, table, side="right") - 1
        hit = (at >= 0) & (self.blocks[np.maximum(at, 0)] == table)
        pos = np.flatnonzero(hit)
        return pos, self.which[at[pos]], self.index[at[pos]]


class Pending:
    """One pool's pending records: (owner, sequence id) -> what the sequence still waits for."""

    def __init__(self, manager: KVCacheManager, inflight: InFlight) -> None:
        self.manager = manager
        self.inflight = inflight
        self.records: dict[tuple[int, int], Tracked] = {}

    def track(self, owner: int, infos: list[PageTable], *, swap_in: bool = False,
              recent: list | None = None) -> list[Tracked]:
        """What each returned sequence still waits for (records the pending ones).

        ``recent``: the batches the call that made ``infos`` started (what its ``sync`` calls returned).
        """
        found: dict[int, _Found] = {}
        for a in recent or ():
            found.setdefault(a.class_id, []).append(a)
        found = {cid: _Found(batches) for cid, batches in found.items()}
        out = []
        for info in infos:
            bs = self.manager.classes[info.class_id].block_size
            base = info.num_tokens if swap_in else info.num_cached_tokens
            table = np.asarray(info.block_table[:cdiv(base, bs)], np.int64)
            t = Tracked(info, self._parts(info.class_id, table, found.get(info.class_id)), base)
            self._settle(owner, t)
            if t.arriving:
                self.records[(owner, info.seq_id)] = t
            out.append(t)
        return out

    def _parts(self, cid: int, table: np.ndarray, recent: _Found | None) -> list:
        """(positions, batch, indices) of the batches that ``table``'s blocks wait on: this call's, then any
        other in flight."""
        parts = []
        rest = np.ones(len(table), bool)
        if recent is not None:
            pos, which, index = recent.find(table)
            rest[pos] = False
            for w in np.unique(which).tolist():
                sel = which == w
                parts.append((pos[sel], recent.batches[w], index[sel]))
        if rest.any():
            parts += self.inflight.parts(cid, table, np.flatnonzero(rest))
        return parts

    def _settle(self, owner: int, t: Tracked) -> None:
        """Count the failed blocks; the owner is told now, so the hashes it rewrites come back."""
        bs = self.manager.classes[t.info.class_id].block_size
        for pos, a, idx in t.parts:
            bad = np.flatnonzero(a.state[idx] >= Arrivals.LOST)
            if not len(bad):
                continue
            t.valid_tokens = min(t.valid_tokens, int(pos[bad].min()) * bs)
            for j in bad.tolist():
                i = int(idx[j])
                if i not in a.digests:  # failed while the rest of its batch still runs
                    self.inflight.fail_block(a, i)
                digest = a.digests[i]
                if digest is not None:
                    try:
                        self.manager.register_block(owner, t.info.seq_id, int(a.blocks[i]), digest)
                    except KvpoolError:
                        continue  # freed meanwhile: the hash stays forgotten
                    a.digests[i] = None

    def arrivals_of(self, owner: int, seq_ids) -> list:
        """Every batch the sequences' blocks wait for (theirs and shared ones)."""
        out = []
        for sid in seq_ids:
            t = self.records.get((owner, sid))
            if t is not None:
                out.extend(a for _, a, _ in t.parts if not a.done)
            try:
                info = self.manager.sequence(owner, sid)
            except KvpoolError:
                continue
            out.extend(self.inflight.batches_of(info.class_id, info.block_table))
        return out

    def forget(self, owner: int, seq_ids) -> None:
        for sid in seq_ids:
            self.records.pop((owner, int(sid)), None)

    def forget_owner(self, owner: int) -> None:
        for key in [k for k in self.records if k[0] == owner]:
            del self.records[key]

    def settled(self, owner: int, tracked: list[Tracked]) -> list[Tracked]:
        """``tracked`` after its arrivals are done (the records are forgotten)."""
        for t in tracked:
            self.records.pop((owner, t.info.seq_id), None)
            self._settle(owner, t)
        return tracked

    def finish(self, owner: int, seq_ids) -> list[Tracked]:
        """The records of these sequences, settled (their arrivals are done); forgets them."""
        out = []
        for sid in seq_ids:
            t = self.records.pop((owner, int(sid)), None)
            if t is None:
                info = self.manager.sequence(owner, int(sid))  # raises for unknown / others' ids
                t = Tracked(info, [], info.num_tokens if info.swapped else info.num_cached_tokens)
            else:
                self._settle(owner, t)
            out.append(t)
        return out


__all__ = ["Pending", "Tracked"]
