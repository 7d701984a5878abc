"""The daemon's side of the memory hierarchy: one pool's transfer engine, its classes, its waits.

Each ``DevicePool`` owns one ``Tiers`` and its parts, each in its module:

* ``Tiers`` (here): the transfer engine (pinned host memory, the disk tier,
  writes to the remote tier), the classes it copies, and waking the event
  loop when copies complete.  After every core call the pool's
  ``sync_memory`` hands the call's planned moves to the engine (``sync``);
  the device blocks that bytes are still flowing into (promotions, swap-ins)
  come back as one ``Arrivals`` batch per layout class, returned to the caller.
* ``tier_inflight.InFlight``: those batches until they are done (the blocks
  they hold, which batch each block waits on, blocks that failed).
* ``tier_pending.Pending``: the sequences a call returned while their bytes
  are still arriving, and what each still waits for (``Create``, ``SwapIn``,
  ``Wait``).
* ``tier_remote.RemoteLookups``: asking the remote tier for the blocks past
  the local tiers' prefix.

Nothing here blocks the event loop: worker threads report completions
through the engine, whose ``notify`` schedules ``poll`` on the loop.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os

from kvpoold.core import Geometry, KVCacheManager, KvpoolError, Tier
from kvpoold.core.results import ManagerStats
from kvpoold.core.tiers import TIER_ALIGN
from kvpoold.transfer import DiskTierError, TransferEngine
from kvpoold.transfer.remote import RemoteLink

from .tier_inflight import InFlight

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


def layout_dict(g: Geometry) -> dict:
    """A class's layout as the lower tiers name it (the disk tier's index, the remote tier's namespace)."""
    d = {"num_layers": g.num_layers, "num_kv_heads": g.num_kv_heads, "head_dim": g.head_dim,
         "dtype": g.dtype, "block_size": g.block_size, "block_bytes": g.block_bytes}
    if g.tenant:  # a tenant's blocks come back to that tenant's class only (and none is written without)
        d["tenant"] = g.tenant
    return d


class Tiers:
    """One pool's transfer engine (None without lower tiers), the classes it copies, and its waits."""

    def __init__(self, config, manager: KVCacheManager, inflight: InFlight, backend_name: str, *,
                 device: int | None = None, disk_dir: str | None = None, remote: RemoteLink | None = None) -> None:
        """One pool's tiers: ``inflight`` holds the batches ``sync`` starts, ``device`` is the pool's GPU
        (default the first of ``--devices``), ``disk_dir`` its disk tier's directory (default
        ``resolve_disk_dir(config.disk_dir)``; a daemon serving several GPUs gives each pool its own
        subdirectory, ``devices.disk_dir_for``), ``remote`` the pool's link to the daemon's remote tier
        (None: none)."""
        self.manager = manager
        self.inflight = inflight
        self.engine: TransferEngine | None = None
        self._scheduled = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self.on_moves = None  # sees every plan before the engine runs it (KV events)
        if not manager.placement.enabled and remote is None:
            return
        if disk_dir is None:
            disk_dir = resolve_disk_dir(config.disk_dir)
        disk_dir = disk_dir if config.disk_bytes else ""
        if config.disk_bytes and not disk_dir:
            raise DiskTierError(f"--disk-bytes needs a directory: give --disk-dir (or create the systemd state "
                                f"directory {STATE_DIRECTORY})")
        cuda = (config.devices[0] if device is None else device) if backend_name == "cuda" else None
        self.engine = TransferEngine(config.host_bytes, disk_dir or None, config.disk_bytes, cuda_device=cuda,
                                     remote=remote)
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
        self.inflight.add_class(class_id, pool.num_block_ids)
        disk = self.engine.disk
        if disk is not None and class_id not in disk.gid_of:
            disk.bind(class_id, disk.layout_id(layout_dict(pool.geometry)))

    def remove_arena(self, class_id: int) -> None:
        """A class was dropped (no block of it is left in any tier): forget its arena and its disk layout binding.

        The arena's view is let go here so that closing the arena unmaps it; its id may name another
        geometry next, which ``add_arena`` binds afresh.
        """
        self.inflight.remove_class(class_id)
        if self.engine is None:
            return
        self.engine.remove_class(class_id)
        disk = self.engine.disk
        if disk is not None:
            disk.gid_of.pop(class_id, None)

    # -- after each core call -----------------------------------------------------------------------------
    def sync(self, apply_slabs) -> list:
        """Run the moves the last core call planned; ``apply_slabs`` runs between reads and writes.

        Returns the batches of device writes started (bytes arriving), held by ``inflight`` until
        done: the caller's to ``Pending.track``.
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
            self.inflight.start(a)
        return batches

    def _lost(self, key) -> None:
        if self.manager.forget_lower(key):
            log.warning("tiers: a copy of block %s could not be written: forgotten", key)

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


__all__ = ["Tiers", "resolve_disk_dir", "layout_dict", "DiskTierError", "TIER_ALIGN"]
