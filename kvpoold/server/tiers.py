"""The daemon's side of the memory hierarchy: engine, arrivals, waits.

Each ``DevicePool`` owns one ``Tiers``.  After every core call the pool's
``sync_memory`` hands the call's planned moves to the transfer engine
(``sync``); the device blocks that bytes are still flowing into (promotions,
swap-ins) come back as one ``Arrivals`` batch per layout class, returned to
the caller, which passes its call's batches to ``track``.  Their blocks
get a transfer hold in the core and are marked in a per-class array
(block -> batch) until the batch is done: one completion per batch, and the
batch's per-block state answers "which blocks are still arriving".  A
sequence that a call returns with such blocks gets a *pending record*;
``Create``/``SwapIn`` either await its batches before replying (the default)
or reply at once with the positions still arriving, and the client awaits
them later with ``Wait``.

A block whose bytes failed to arrive (a bad checksum on disk, an I/O error)
loses its hash in the core (no prefix hit finds it again) and every pending
record that contains it reports fewer valid tokens: the client recomputes
the KV from there.  Nothing here blocks the event loop: worker threads
report completions through the engine, whose ``notify`` schedules ``poll``
on the loop.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
from dataclasses import dataclass
from functools import partial

import numpy as np

from kvpoold.core import Geometry, KvpoolError, Tier
from kvpoold.core.results import ManagerStats, PageTable
from kvpoold.core.tiers import TIER_ALIGN
from kvpoold.transfer import Arrivals, DiskTierError, TransferEngine
from kvpoold.transfer.remote import RemoteLink, RemoteStore

log = logging.getLogger("kvpoold")

STATE_DIRECTORY = "/var/lib/kvpoold"  # the systemd unit's StateDirectory=


def resolve_disk_dir(configured: str) -> str:
    """``--disk-dir``, else the systemd state directory when it exists, else ""."""
    if configured:
        return configured
    env = os.environ.get("STATE_DIRECTORY", "").split(":")[0]  # set by systemd for StateDirectory=
    for candidate in (env, STATE_DIRECTORY):
        if candidate and os.path.isdir(candidate):
            return candidate
    return ""


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


class Tiers:
    def __init__(self, config, manager, backend_name: str, *, device: int | None = None,
                 disk_dir: str | None = None, remote: RemoteStore | None = None) -> None:
        """One pool's tiers: ``device`` is its GPU (default the first of ``--devices``), ``disk_dir``
        its disk tier's directory (default ``resolve_disk_dir(config.disk_dir)``; a daemon serving
        several GPUs gives each pool its own subdirectory, ``pools.disk_dir_for``), ``remote`` the
        daemon's remote tier (None: none)."""
        self.manager = manager
        self.engine: TransferEngine | None = None
        #: per class: block -> the serial of the batch its bytes are arriving in (-1: none)
        self.batch_of: dict[int, np.ndarray] = {}
        self.batches: dict[int, tuple[Arrivals, np.ndarray, np.ndarray]] = {}  # serial -> (batch, held, sorter)
        self._serial = 0
        self.pending: dict[tuple[int, int], Tracked] = {}  # (owner, seq id) -> what it waits for
        self._scheduled = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self.on_moves = None  # sees every plan before the engine runs it (KV events)
        self.remote = RemoteLink(remote) if remote is not None else None
        if not manager.placement.enabled and self.remote is None:
            return
        if disk_dir is None:
            disk_dir = resolve_disk_dir(config.disk_dir)
        disk_dir = disk_dir if config.disk_bytes else ""
        if config.disk_bytes and not disk_dir:
            raise DiskTierError(f"--disk-bytes needs a directory: give --disk-dir (or create the systemd state "
                                f"directory {STATE_DIRECTORY})")
        cuda = (config.devices[0] if device is None else device) if backend_name == "cuda" else None
        self.engine = TransferEngine(config.host_bytes, disk_dir or None, config.disk_bytes, cuda_device=cuda,
                                     remote=self.remote)
        self.engine.on_lost = self._lost
        if self.engine.disk is not None:
            self._load_disk()
            log.info("tiers: host %d bytes, disk %d bytes in %s", config.host_bytes, config.disk_bytes, disk_dir)
        elif config.host_bytes:
            log.info("tiers: host %d bytes, no disk tier", config.host_bytes)

    @property
    def enabled(self) -> bool:
        return self.engine is not None

    # -- classes --------------------------------------------------------------------------------------
    @staticmethod
    def _geometry_dict(g: Geometry) -> dict:
        d = {"num_layers": g.num_layers, "num_kv_heads": g.num_kv_heads, "head_dim": g.head_dim,
             "dtype": g.dtype, "block_size": g.block_size, "block_bytes": g.block_bytes}
        if g.tenant:  # a tenant's blocks come back to that tenant's class only (and none is written without)
            d["tenant"] = g.tenant
        return d

    def _load_disk(self) -> None:
        """Offer the blocks a previous daemon left on disk to the core, oldest first."""
        disk = self.engine.disk
        for gid, geom in sorted(disk.geoms.items()):
            try:
                g = Geometry(**{k: v for k, v in geom.items() if k != "block_bytes"})
                if g.block_bytes != geom.get("block_bytes"):
                    raise ValueError("block size differs")
                cid = self.manager.register_class(g)
            except (KvpoolError, TypeError, ValueError) as exc:
                log.warning("disk tier: blocks of layout %s cannot be used here (%s): dropping them", geom, exc)
                continue
            disk.bind(cid, gid)
            self.engine.add_class(cid, g.block_bytes, None)
            for digest, e in list(disk.found.get(gid, {}).items()):
                if self.manager.load_lower(Tier.DISK, cid, digest, e.nbytes):
                    disk.adopt(cid, digest)
        dropped = disk.reject_found()
        if dropped:
            log.warning("disk tier: dropped %d blocks that did not fit in --disk-bytes", dropped)

    def add_arena(self, class_id: int, arena, pool) -> None:
        """A class's arena exists: the engine can copy its blocks."""
        if self.engine is None:
            return
        tensor = arena.as_tensor("uint8", (pool.num_block_ids, pool.block_bytes))
        self.engine.add_class(class_id, pool.block_bytes, tensor)
        self.batch_of[class_id] = np.full(pool.num_block_ids, -1, np.int64)
        disk = self.engine.disk
        if disk is not None and class_id not in disk.gid_of:
            disk.bind(class_id, disk.layout_id(self._geometry_dict(pool.geometry)))
        if self.remote is not None:
            self.remote.bind(class_id, self._geometry_dict(pool.geometry))

    # -- the remote tier -------------------------------------------------------------------------------------
    def remote_chains(self, class_id: int, model_id: str, prompts, owner: int) -> list[list[bytes]] | None:
        """Per prompt, the block hashes past its prefix cached on the local tiers: what to ask the remote
        tier for; None when there is nothing to ask (no remote tier, every block local, or a backoff)."""
        if self.remote is None or class_id not in self.remote.namespaces:
            return None
        chains = [self.manager.remote_candidates(class_id, model_id, tokens, extra_key, owner)
                  for tokens, extra_key in prompts]
        if not any(chains) or not self.remote.store.available():
            return None
        return chains

    async def fetch_remote(self, class_id: int, chains: list[list[bytes]], read: bool = True) -> dict:
        """The remote tier's longest prefix of each chain: hash -> payload (``read`` False: -> None).

        Runs on a worker thread; past ``--remote-timeout`` the blocks count as missing (empty answer)
        and the tier backs off.  Never raises for the store's faults.
        """
        store = self.remote.store
        asked = sum(map(len, chains))
        fut = store.submit_fetch(self.remote.namespaces[class_id], chains, read)
        try:
            got = await asyncio.wait_for(asyncio.wrap_future(fut), store.settings.timeout)
        except asyncio.TimeoutError:
            store.slow()
            store.count_lookup(asked, 0)
            return {}
        store.count_lookup(asked, len(got.payloads))
        return got.payloads

    def remove_arena(self, class_id: int) -> None:
        """A class was dropped (no block of it is left in any tier): forget its arena and its disk layout binding.

        The arena's view is let go here so that closing the arena unmaps it; its id may name another
        geometry next, which ``add_arena`` binds afresh.
        """
        self.batch_of.pop(class_id, None)
        if self.engine is None:
            return
        self.engine.remove_class(class_id)
        disk = self.engine.disk
        if disk is not None:
            disk.gid_of.pop(class_id, None)

    # -- after each core call -----------------------------------------------------------------------------
    def sync(self, apply_slabs) -> list:
        """Run the moves the last core call planned; ``apply_slabs`` runs between reads and writes.

        Returns the batches of device writes started (bytes arriving): the caller's to ``track``.
        """
        if self.engine is None:
            apply_slabs()
            return []
        if self._loop is None:  # completions wake the loop from now on (not only while someone awaits)
            try:
                self._bind_loop()
            except RuntimeError:
                pass  # no running loop: tests and tools poll
        self.engine.poll()
        moves = self.manager.drain_moves()
        if self.on_moves is not None:
            self.on_moves(moves)
        if not moves:
            apply_slabs()
            return []
        applied = []

        def between():
            applied.append(True)
            apply_slabs()

        try:
            batches = self.engine.submit(moves, between)
        finally:
            if not applied:
                apply_slabs()
        for a in batches:
            self._start(a)
        return batches

    def _start(self, a: Arrivals) -> None:
        """A batch started: hold its blocks still arriving until it is done."""
        self._failed(a)  # blocks whose copy was missing fail at once
        if a.done:
            return
        held = a.blocks[a.arriving()]
        serial = self._serial
        self._serial += 1
        self.batches[serial] = (a, held, np.argsort(a.blocks, kind="stable"))
        self.batch_of[a.class_id][held] = serial
        self.manager.hold_blocks(a.class_id, held.tolist())
        a.waiters.append(partial(self._arrived, serial))

    def _arrived(self, serial: int, a: Arrivals) -> None:
        _, held, _ = self.batches.pop(serial)
        self.batch_of[a.class_id][held] = -1
        self._failed(a)
        self.manager.release_holds(a.class_id, held.tolist())

    def _failed(self, a: Arrivals) -> None:
        """Forget the hashes of the batch's failed blocks not handled yet (their owners recompute them)."""
        for i in a.failed().tolist():
            if i not in a.digests:
                self._fail_block(a, i)

    def _fail_block(self, a: Arrivals, i: int) -> None:
        block = int(a.blocks[i])
        log.warning("tiers: the bytes of block %d (class %d) did not arrive (%s): its owners recompute it",
                    block, a.class_id, "bad checksum" if a.state[i] == Arrivals.CORRUPT else "lost")
        a.digests[i] = self.manager.invalidate_block(a.class_id, block)

    def _lost(self, key) -> None:
        if self.manager.forget_lower(key):
            log.warning("tiers: a copy of block %s could not be written: forgotten", key)

    # -- sequences waiting for bytes ---------------------------------------------------------------------------
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
            limit = -(-base // bs)
            t = Tracked(info, self._parts(info.class_id, np.asarray(info.block_table[:limit], np.int64),
                                          found.get(info.class_id)), base)
            self._settle(owner, t)
            if t.arriving:
                self.pending[(owner, info.seq_id)] = t
            out.append(t)
        return out

    def _parts(self, cid: int, table: np.ndarray, recent: _Found | None) -> list:
        """(positions, batch, indices) of the batches that ``table``'s blocks wait on: this call's, then any in flight."""
        parts = []
        rest = np.ones(len(table), bool)
        if recent is not None:
            pos, which, index = recent.find(table)
            rest[pos] = False
            for w in np.unique(which).tolist():
                sel = which == w
                parts.append((pos[sel], recent.batches[w], index[sel]))
        batch_of = self.batch_of.get(cid)
        if batch_of is not None and rest.any():
            pos = np.flatnonzero(rest)
            serials = batch_of[table[pos]]
            inflight = serials >= 0
            pos, serials = pos[inflight], serials[inflight]
            for s in np.unique(serials).tolist():
                a, _, order = self.batches[s]
                p = pos[serials == s]
                index = order[np.searchsorted(a.blocks[order], table[p])]
                parts.append((p, a, index))
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
                    self._fail_block(a, i)
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
            t = self.pending.get((owner, sid))
            if t is not None:
                out.extend(a for _, a, _ in t.parts if not a.done)
            try:
                info = self.manager.sequence(owner, sid)
            except KvpoolError:
                continue
            batch_of = self.batch_of.get(info.class_id)
            if batch_of is None or not info.block_table:
                continue
            serials = np.unique(batch_of[np.asarray(info.block_table, np.int64)])
            out.extend(self.batches[s][0] for s in serials.tolist() if s >= 0)
        return out

    def forget(self, owner: int, seq_ids) -> None:
        for sid in seq_ids:
            self.pending.pop((owner, int(sid)), None)

    def forget_owner(self, owner: int) -> None:
        for key in [k for k in self.pending if k[0] == owner]:
            del self.pending[key]

    def settled(self, owner: int, tracked: list[Tracked]) -> list[Tracked]:
        """``tracked`` after its arrivals are done (the records are forgotten)."""
        for t in tracked:
            self.pending.pop((owner, t.info.seq_id), None)
            self._settle(owner, t)
        return tracked

    def finish(self, owner: int, seq_ids) -> list[Tracked]:
        """The records of these sequences, settled (their arrivals are done); forgets them."""
        out = []
        for sid in seq_ids:
            t = self.pending.pop((owner, int(sid)), None)
            if t is None:
                info = self.manager.sequence(owner, int(sid))  # raises for unknown / others' ids
                t = Tracked(info, [], info.num_tokens if info.swapped else info.num_cached_tokens)
            else:
                self._settle(owner, t)
            out.append(t)
        return out

    # -- waiting on the event loop ------------------------------------------------------------------------------
    def poll(self) -> None:
        self._scheduled = False
        if self.engine is not None:
            self.engine.poll()

    def _bind_loop(self) -> None:
        loop = asyncio.get_running_loop()
        if self._loop is loop:
            return
        self._loop = loop

        def notify():
            if not self._scheduled:
                self._scheduled = True
                try:
                    loop.call_soon_threadsafe(self.poll)
                except RuntimeError:
                    pass  # the loop is closed: shutting down

        self.engine.notify = notify

    async def wait(self, arrivals) -> None:
        """Until every batch is done (the loop keeps serving other calls meanwhile)."""
        pending = [a for a in arrivals if not a.done]
        if not pending or self.engine is None:
            return
        self._bind_loop()
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        left = [len(pending)]

        def one(_a):
            left[0] -= 1
            if left[0] == 0 and not fut.done():
                fut.set_result(None)

        for a in pending:
            if a.done:
                one(a)
            else:
                a.waiters.append(one)
        self.poll()
        await fut

    # -- operators ------------------------------------------------------------------------------------------------
    def decorate(self, stats: ManagerStats) -> ManagerStats:
        """The core's tier counters plus the engine's bytes, seconds and corrupt blocks."""
        if self.engine is None:
            return stats
        traffic = self.engine.traffic()
        tiers = []
        for t in stats.tiers:
            m = traffic.get(t.tier)
            if m is None:
                tiers.append(t)
                continue
            tiers.append(dataclasses.replace(
                t, corrupt_blocks=m["corrupt"], bytes_written=m["bytes_written"], write_seconds=m["write_seconds"],
                bytes_read=m["bytes_read"], read_seconds=m["read_seconds"],
                failed_writes=m.get("failed_writes", 0), failed_reads=m.get("failed_reads", 0)))
        return dataclasses.replace(stats, tiers=tuple(tiers))

    def close(self) -> None:
        """Finish the copies in flight and make the disk tier durable (shutdown)."""
        if self.engine is not None:
            engine, self.engine = self.engine, None
            engine.close()


__all__ = ["Tiers", "Tracked", "resolve_disk_dir", "DiskTierError", "TIER_ALIGN"]
