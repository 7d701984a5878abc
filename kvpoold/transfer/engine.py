"""The transfer engine: runs the core's tier moves on real bytes.

The core plans moves as columns (``MovePlan``, from
``KVCacheManager.drain_moves``) in an executable order; ``submit`` runs the
moves of one daemon call, a batch at a time (numpy masks pick the kinds of
moves; slots, keys and copies are handled per batch, never with an object
per block):

1. **Lower-tier moves** (host -> disk, drops) run in plan order; disk writes
   are asynchronous (an I/O thread pool) and their host slot is freed when
   they are done.  A drop frees its host slot at once, so the device reads
   below find room.  A lower-tier move of a key that an earlier device read
   of the same call places (the same key pushed on to disk) flushes those
   device reads first.
2. **Device reads** (demotions, swap-outs: device block -> host slot, or ->
   host staging -> disk), per layout class, in pieces of ``pipeline_blocks``:
   per piece one batch of host slots (ascending offsets: a few runs), one
   copy, and one ``put_many`` of the keys made while the copy runs; the next
   piece's slots are taken while the copies queued before it run.  They
   *complete before* ``submit`` returns: on the GPU one gather launch plus
   one DMA per run and piece, then a stream synchronize; on the CPU numpy
   copies.  The daemon replies to its client only after that, and a client
   learns that a block was handed out again only from a reply, so no block is
   reused before its bytes were copied out.
3. ``between()``: the daemon commits and releases slabs here (after the
   device reads, before device writes into newly taken slabs).
4. **Device writes** (promotions, swap-ins: host slot or disk -> device
   block) start last and may finish later.  Each layout class's writes form
   one ``Arrivals`` batch: one completion for the batch, and a per-block
   state the daemon answers "which blocks are still arriving" from.  Writes
   from host slots go in pieces too: a piece's slots are looked up while
   the copies of the pieces before it run, and each piece's completion
   frees its slots while the pieces after it are still copying, so on a GPU
   little of the bookkeeping is left outside the DMA time.  The
   daemon holds the blocks (``KVCacheManager.hold_blocks``) until the batch
   is done, so none is freed or handed out while bytes are in flight, and a
   caller that uses them waits for the batch first.

When the host buffer has no free slot the engine waits for copies in flight
to finish (backpressure), and only when nothing is in flight uses a
temporary buffer.

Completions come from worker threads (disk I/O, the CUDA event watcher)
through one queue (``completions``) and run on the caller's thread in ``poll``.

The copier moves the bytes between a class's pool and host memory:
``CudaCopier`` on a GPU, ``CpuCopier`` (numpy) for a pool in host memory.
A copier's ``to_host``/``to_device`` return an event to wait for (the GPU:
the engine's watcher thread waits) or None when the copy is already done.
"""

from __future__ import annotations

import contextlib
import gc
import logging
from functools import partial

import numpy as np

from kvpoold.core.tiers import DROP, MovePlan, Tier

from .arrivals import Arrivals
from .completions import Completions, Countdown
from .cpu_copier import CpuCopier
from .disk import DiskStore
from .host import HostStore
from .meter import Meters

log = logging.getLogger("kvpoold")

DEFAULT_STAGING_CPU = 32 << 20
DEFAULT_STAGING_GPU = 256 << 20
#: host <-> device batches are copied in pieces of this many blocks, so that the slot bookkeeping of one
#: piece (a cost per block) runs while the copies of the others are in flight.  Counted in blocks, not
#: bytes: small blocks (32 KiB: 32 MiB a piece) need the overlap; big ones (2 MiB) have little
#: bookkeeping per byte and copy fastest in few large calls (on the H200, 16-block pieces of 2 MiB
#: cut GPU<->host both ways at once from 87 to 57 GB/s).
PIPELINE_BLOCKS = 1024
GC_PAUSE_MOVES = 256  # batches this large run with the cyclic GC paused (see _gc_paused)

_DEVICE, _HOST, _DISK, _REMOTE = int(Tier.DEVICE), int(Tier.HOST), int(Tier.DISK), int(Tier.REMOTE)


@contextlib.contextmanager
def _gc_paused(n: int):
    """Pause the cyclic garbage collector around a large batch.

    A batch makes few Python objects, but a daemon holds many long-lived ones
    (keys, index entries), and a collection triggered in the middle of a batch
    costs more than the batch's own bookkeeping.  Nothing here makes cycles;
    the collector catches up after the batch.
    """
    if n < GC_PAUSE_MOVES or not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def _pick(keys: list, idx: np.ndarray) -> list:
    """``[keys[i] for i in idx]``, a list slice when ``idx`` is a range (a batch usually is)."""
    n = len(idx)
    if n and int(idx[-1]) - int(idx[0]) == n - 1:
        return keys[int(idx[0]):int(idx[-1]) + 1]
    return [keys[i] for i in idx.tolist()]


class _Class:
    __slots__ = ("block_bytes", "pool", "rows")

    def __init__(self, block_bytes: int, pool) -> None:
        self.block_bytes = block_bytes
        self.pool = pool  # torch uint8 [num_blocks, block_bytes] over the arena (or numpy rows), or None
        if pool is None or isinstance(pool, np.ndarray):
            self.rows = pool
        else:
            self.rows = None if pool.is_cuda else pool.numpy()

    @property
    def target(self):
        """What the copier copies to and from: numpy rows in host memory, else the device tensor."""
        return self.rows if self.rows is not None else self.pool


class _DiskBatch:
    """Disk writes of one batch from host slots: each slot is freed when its write is done."""

    __slots__ = ("engine", "left")

    def __init__(self, engine: "TransferEngine", n: int) -> None:
        self.engine = engine
        self.left = n
        engine.completions.inflight += 1

    def written(self, offset: int, ok: bool, key) -> None:
        eng = self.engine
        if offset >= 0:
            eng.host.slots.free(offset)
        if not ok:
            eng._lost(key)
        self.left -= 1
        if self.left == 0:
            eng.completions.inflight -= 1


class TransferEngine:
    def __init__(self, host_bytes: int = 0, disk_dir: str | None = None, disk_bytes: int = 0, *,
                 cuda_device: int | None = None, staging_bytes: int | None = None, io_threads: int = 4,
                 direct: bool = True, copier=None, pipeline_blocks: int = PIPELINE_BLOCKS, remote=None) -> None:
        """``remote``: the pool's ``RemoteLink`` (tier 3), or None; ``copier`` replaces the default one (``CudaCopier`` with ``cuda_device``, else ``CpuCopier``);
        ``pipeline_blocks`` is the size, in blocks, of the pieces a host <-> device batch is copied in."""
        if pipeline_blocks <= 0:
            raise ValueError("pipeline_blocks must be > 0")
        self.pipeline_blocks = pipeline_blocks
        self.meters = Meters()
        self.completions = Completions()
        self.on_lost = lambda key: None  # a lower-tier copy could not be written
        if staging_bytes is None:
            staging_bytes = DEFAULT_STAGING_GPU if cuda_device is not None else DEFAULT_STAGING_CPU
        self.host = HostStore(host_bytes, staging_bytes, cuda_device)
        self.disk = DiskStore(disk_dir, disk_bytes, post=self.post, meters=self.meters, io_threads=io_threads,
                              direct=direct) if disk_dir and disk_bytes else None
        if copier is None and cuda_device is not None:
            from .cuda import CudaCopier

            copier = CudaCopier(cuda_device)
        self.copier = copier if copier is not None else CpuCopier()
        self.classes: dict[int, _Class] = {}
        self.remote = remote

    # -- plumbing ---------------------------------------------------------------------------------
    def add_class(self, class_id: int, block_bytes: int, pool=None) -> None:
        """Bytes of class ``class_id`` live in ``pool`` (torch uint8 [blocks, block_bytes]; None: none yet)."""
        self.classes[class_id] = _Class(block_bytes, pool)

    def remove_class(self, class_id: int) -> None:
        """Class ``class_id`` was dropped: let go of its arena's view (the arena can then be unmapped)."""
        self.classes.pop(class_id, None)

    @property
    def notify(self):
        """Called (from any thread) after a completion was queued: the daemon wakes its loop."""
        return self.completions.notify

    @notify.setter
    def notify(self, fn) -> None:
        self.completions.notify = fn

    def post(self, fn) -> None:
        """Queue ``fn`` to run on the loop's thread (from any thread)."""
        self.completions.post(fn)

    def poll(self) -> int:
        """Run the completions queued so far; returns how many."""
        return self.completions.poll()

    def wait(self, arrivals, timeout: float | None = None) -> bool:
        """Block until every batch is done (tests, benchmarks; the daemon awaits instead)."""
        for a in arrivals:
            while not a.done:
                if not self.completions.wait_one(timeout):
                    return False
        return True

    def idle(self) -> bool:
        return self.completions.idle()

    def drain(self) -> None:
        """Wait for every copy in flight."""
        self.completions.drain()

    def _host_slots(self, nbytes: int, n: int, settle=None) -> list[tuple[np.ndarray, np.ndarray, int]]:
        """Host room for ``n`` blocks: [(buffer, offsets, count)], the store's slots then, rarely, a temporary.

        When the store is full, waits for copies in flight to free slots; ``settle()`` first finishes
        the caller's own device reads (queued disk writes of their slots must not start before them).
        """
        host = self.host
        got = host.alloc_array(nbytes, n)
        if len(got) < n and settle is not None:
            settle()
        while len(got) < n:
            if self.disk is not None:
                self.disk.flush()  # queued disk jobs must run for their slots to come back
            if not self.completions.wait_one():  # nothing in flight will free one
                break
            got = np.concatenate((got, host.alloc_array(nbytes, n - len(got))))
        parts = [(host.buf, got, len(got))] if len(got) else []
        if len(got) < n:
            k = n - len(got)
            buf, stride = host.temp(nbytes, k)
            parts.append((buf, np.arange(k, dtype=np.int64) * stride, k))
        return parts

    # -- a call's moves ------------------------------------------------------------------------------
    def submit(self, moves, between=None) -> list[Arrivals]:
        """Run one call's moves (module docstring); returns one ``Arrivals`` per class with device writes.

        ``moves`` is a ``MovePlan`` (or ``Move`` objects, converted).
        """
        plan = MovePlan.of(moves)
        with _gc_paused(len(plan)):
            return self._submit(plan, between)

    def _submit(self, plan: MovePlan, between) -> list[Arrivals]:
        keys, src, dst, block, nbytes = plan.columns()
        to_dev = dst == _DEVICE
        from_dev = src == _DEVICE
        outs = np.flatnonzero(from_dev & (dst != DROP) & (dst != _REMOTE))
        to_remote = np.flatnonzero(from_dev & (dst == _REMOTE))
        lower = np.flatnonzero(~from_dev & ~to_dev)
        done_outs = 0  # outs[:done_outs] are copied already
        if len(lower):
            out_at: dict = {}  # key -> its first device read in this call
            if len(outs):
                ol = outs.tolist()
                out_at = dict(zip([keys[i] for i in reversed(ol)], reversed(ol)))
            pop = self.host.entries.pop
            freed: list[int] = []
            batch = _DiskBatch(self, 1) if self.disk is not None else None  # 1: still submitting
            sl, dl, nl = src.tolist(), dst.tolist(), nbytes.tolist()
            for i in lower.tolist():
                key = keys[i]
                j = out_at.get(key)
                if j is not None and j < i and done_outs < len(outs) and outs[done_outs] < i:
                    upto = int(np.searchsorted(outs, i))
                    self.host.free_many(freed)
                    freed = []
                    self._flush_out(keys, dst, block, outs[done_outs:upto])
                    done_outs = upto
                s, d = sl[i], dl[i]
                if s == _HOST:
                    off = pop(key, -1)
                    if d == _REMOTE:
                        if off >= 0:  # copied now: the slot is free for the device reads below
                            self._host_to_remote(key, self.host.buf[off:off + nl[i]])
                            freed.append(off)
                    elif d == DROP:
                        if off >= 0:
                            freed.append(off)
                    elif off < 0 or batch is None:
                        if off >= 0:
                            freed.append(off)
                        self._lost(key)
                    else:
                        batch.left += 1
                        self.disk.write(key, self.host.buf[off:off + self.host.stride(nl[i])], nl[i],
                                        partial(batch.written, off))
                elif s == _DISK and d == DROP and self.disk is not None:
                    self.disk.drop(key)
            self.host.free_many(freed)
            if batch is not None:
                batch.written(-1, ok=True, key=None)  # submitted: the last write's completion ends the batch
        if done_outs < len(outs):
            self._flush_out(keys, dst, block, outs[done_outs:])
        if len(to_remote):
            self._device_to_remote(keys, block, to_remote)
        if self.disk is not None:
            self.disk.flush()
        if between is not None:
            between()
        arrivals = self._device_in(keys, src, block, np.flatnonzero(to_dev)) if to_dev.any() else []
        if self.disk is not None:
            self.disk.flush()
        return arrivals

    def _device_to_remote(self, keys: list, block: np.ndarray, idx: np.ndarray) -> None:
        """Copy device blocks into fresh buffers (done before ``submit`` returns, like every device read)
        and hand them to the remote tier's writer."""
        if self.remote is None:
            return
        for cid, sel in self._by_class(keys, idx).items():
            cls = self.classes.get(cid)
            ns = self.remote.namespaces.get(cid)
            if cls is None or cls.target is None or ns is None:
                continue
            bb, k = cls.block_bytes, len(sel)
            buf = np.empty(k * bb, np.uint8)
            ev = self.copier.to_host(cls.target, block[sel], buf, np.arange(k, dtype=np.int64) * bb)
            if ev is not None:
                ev.synchronize()
            self.remote.store.put_many(ns, [keys[i][1] for i in sel.tolist()], buf.reshape(k, bb))

    def _host_to_remote(self, key, view: np.ndarray) -> None:
        """A block leaving the host tier with nowhere lower to go: a copy to the remote tier's writer."""
        ns = self.remote.namespaces.get(key[0]) if self.remote is not None else None
        if ns is not None:
            self.remote.store.put_many(ns, [key[1]], [np.array(view)])

    def _lost(self, key) -> None:
        try:
            self.on_lost(key)
        except Exception:  # noqa: BLE001 - a completion must not break the loop
            log.exception("reporting a lost block failed")

    def _by_class(self, keys: list, idx: np.ndarray) -> dict[int, np.ndarray]:
        """``idx`` split by the layout class of its keys (usually one)."""
        if len(self.classes) == 1:
            return {next(iter(self.classes)): idx}
        c = np.asarray([keys[i][0] for i in idx.tolist()], np.int64)
        return {int(cid): idx[c == cid] for cid in np.unique(c)}

    def _flush_out(self, keys: list, dst: np.ndarray, block: np.ndarray, outs: np.ndarray) -> None:
        """Device reads: copy blocks to host slots (the host tier's, or staging for the disk), per class.

        A class's batch goes in pieces of ``pipeline_blocks``: a piece's slots are taken and its copy
        starts, then its keys are recorded while that copy runs, and the next piece's slots are taken
        while the copies queued before it still run; so on a GPU only the first piece's slot
        bookkeeping is not hidden behind a DMA.  Every copy is done before this returns.
        """
        if not len(outs):
            return
        for cid, idx in self._by_class(keys, outs).items():
            cls = self.classes[cid]
            bb = cls.block_bytes
            ids = block[idx]
            step = self.pipeline_blocks
            meter = self.meters.host_write
            meter.start()
            events: list = []

            def settle() -> None:
                """Finish the copies started so far (before a disk job may read their slots)."""
                while events:
                    ev = events.pop(0)
                    if ev is not None:
                        ev.synchronize()

            try:
                for c0 in range(0, len(idx), step):
                    c1 = min(len(idx), c0 + step)
                    parts = self._host_slots(bb, c1 - c0, settle)
                    i0 = c0
                    for buf, offs, k in parts:
                        events.append(self.copier.to_host(cls.target, ids[i0:i0 + k], buf, offs))
                        i0 += k
                    # the keys are recorded while the copy runs (disk writes only queue until ``flush``;
                    # nothing reads the host tier before ``submit`` returns)
                    i0 = c0
                    for buf, offs, k in parts:
                        self._place_out(keys, dst, idx[i0:i0 + k], buf, offs, bb)
                        i0 += k
            finally:
                settle()
                meter.stop(bb * len(idx), len(idx))

    def _place_out(self, keys, dst, idx: np.ndarray, buf: np.ndarray, offs: np.ndarray, bb: int) -> None:
        """Blocks copied into ``buf`` at ``offs``: record the host tier's, write the disk's."""
        in_store = buf is self.host.buf
        d = dst[idx]
        to_host = d == _HOST
        if to_host.all() and in_store:
            self.host.put_many(_pick(keys, idx), offs.tolist())
            return
        il = idx.tolist()
        ol = offs.tolist()
        stride = self.host.stride(bb)
        if to_host.any() and not in_store:
            # the store had no slot left and no copy in flight would free one: these cached blocks are not
            # kept on the host (the tier's index learns it from ``on_lost``)
            for j in np.flatnonzero(to_host).tolist():
                self._lost(keys[il[j]])
        elif to_host.any():
            sel = np.flatnonzero(to_host).tolist()
            self.host.put_many([keys[il[j]] for j in sel], [ol[j] for j in sel])
        rest = np.flatnonzero(~to_host).tolist()
        if self.disk is None:
            for j in rest:
                if in_store:
                    self.host.slots.free(ol[j])
                self._lost(keys[il[j]])
            return
        batch = _DiskBatch(self, len(rest))
        for j in rest:
            key = keys[il[j]]
            self.disk.write(key, buf[ol[j]:ol[j] + stride], bb, partial(batch.written, ol[j] if in_store else -1))

    def _device_in(self, keys: list, src: np.ndarray, block: np.ndarray, writes: np.ndarray) -> list[Arrivals]:
        """Device writes: promotions and swap-ins, from host slots or from disk; one batch per class."""
        out = []
        for cid, idx in self._by_class(keys, writes).items():
            cls = self.classes[cid]
            arr = Arrivals(cid, block[idx])
            out.append(arr)
            s = src[idx]
            from_host = np.flatnonzero(s == _HOST)
            from_disk = np.flatnonzero(s == _DISK)
            from_remote = np.flatnonzero(s == _REMOTE)
            other = np.flatnonzero((s != _HOST) & (s != _DISK) & (s != _REMOTE))
            if len(other):
                arr.settle(other, Arrivals.LOST)
            if len(from_remote):
                self._remote_in(cls, arr, _pick(keys, idx[from_remote]), from_remote)
            if len(from_disk):
                if self.disk is None:
                    arr.settle(from_disk, Arrivals.LOST)
                else:
                    self._disk_in(cls, arr, _pick(keys, idx[from_disk]), from_disk)
            # in pieces of ``pipeline_blocks``: a piece's slots are looked up while the copies of the
            # pieces before it run, and its slots are freed (on the loop) while the pieces after it run
            step = self.pipeline_blocks
            for c0 in range(0, len(from_host), step):
                part = from_host[c0:c0 + step]
                offs = self.host.pop_array(_pick(keys, idx[part]))
                have = offs >= 0
                if not have.all():
                    arr.settle(part[~have], Arrivals.LOST)
                    part, offs = part[have], offs[have]
                if len(part):
                    self._host_in(cls, arr, part, self.host.buf, offs, free=True)
        return out

    def _remote_in(self, cls: _Class, arr: Arrivals, keys: list, index: np.ndarray) -> None:
        """Payloads the remote tier fetched for this call (``RemoteLink.staged``) into the batch's blocks
        ``index``; a block whose payload is not there is lost (its owner recomputes it)."""
        staged = self.remote.staged if self.remote is not None else {}
        payloads = [staged.get(k[1]) for k in keys]
        have = np.fromiter((p is not None for p in payloads), np.bool_, len(payloads))
        if not have.all():
            arr.settle(index[~have], Arrivals.LOST)
        index = index[have]
        if not len(index):
            return
        got = [p for p in payloads if p is not None]
        if cls.rows is not None:  # the pool is in host memory: one copy, straight into the blocks
            rows = cls.rows
            for b, p in zip(arr.blocks[index].tolist(), got):
                rows[b] = np.frombuffer(p, np.uint8)
            arr.settle(index, Arrivals.OK)
            return
        bb = cls.block_bytes
        buf = np.empty(len(index) * bb, np.uint8)
        for j, p in enumerate(got):
            buf[j * bb:(j + 1) * bb] = np.frombuffer(p, np.uint8)
        self._host_in(cls, arr, index, buf, np.arange(len(index), dtype=np.int64) * bb, free=False)

    def _host_in(self, cls: _Class, arr: Arrivals, index: np.ndarray, buf: np.ndarray, offs: np.ndarray,
                 free: bool) -> None:
        """Copy host bytes at ``offs`` into the batch's blocks ``index``; the slots are freed after."""
        bb = cls.block_bytes
        meter = self.meters.host_read
        meter.start()
        try:
            ev = self.copier.to_device(cls.target, arr.blocks[index], buf, offs)
        except BaseException:
            meter.stop(0, 0)
            raise
        host = self.host

        def done(keep=buf):  # ``buf`` lives until the copy is done (a temporary one has no other owner)
            if free:
                host.free_many(offs)
            arr.settle(index, Arrivals.OK)

        if ev is None:
            meter.stop(bb * len(index), len(index))
            done()
        else:
            self.completions.watch(ev, meter, bb * len(index), len(index), self.completions.tracked(done))

    def _disk_in(self, cls: _Class, arr: Arrivals, keys: list, index: np.ndarray) -> None:
        """Disk reads into the batch's blocks ``index``: straight into a pool in host memory, or into
        pinned staging and then one copy for all the blocks read."""
        bb = cls.block_bytes
        disk = self.disk
        il = index.tolist()
        if cls.rows is not None:  # the pool is in host memory: read straight into the blocks
            rows = cls.rows
            blocks = arr.blocks.tolist()

            def read_direct(i, ok, corrupt):
                arr.settle([i], Arrivals.OK if ok else Arrivals.CORRUPT if corrupt else Arrivals.LOST)

            track = Countdown(self.completions, len(il))
            for key, i in zip(keys, il):
                disk.read(key, rows[blocks[i]], partial(track.one, read_direct, i))
            return
        parts = self._host_slots(bb, len(il))
        stride = self.host.stride(bb)
        places = [(buf, o, buf is self.host.buf) for buf, offs, _ in parts for o in offs.tolist()]
        good: list[int] = []  # positions in il whose read succeeded

        def read_staged(j, ok, corrupt):
            if ok:
                good.append(j)
                return
            buf, o, in_store = places[j]
            if in_store:
                self.host.slots.free(o)
            arr.settle([il[j]], Arrivals.CORRUPT if corrupt else Arrivals.LOST)

        def all_read():
            if not good:
                return
            good.sort()
            for in_store in (True, False):
                sel = [j for j in good if places[j][2] is in_store]
                if not sel:
                    continue
                buf = places[sel[0]][0] if not in_store else self.host.buf
                offs = np.asarray([places[j][1] for j in sel], np.int64)
                if not in_store:  # one temporary buffer: its own offsets
                    for j in sel:
                        assert places[j][0] is buf
                self._host_in(cls, arr, np.asarray([il[j] for j in sel], np.int64), buf, offs, free=in_store)

        track = Countdown(self.completions, len(il), all_read)
        for j, key in enumerate(keys):
            buf, o, _ = places[j]
            disk.read(key, buf[o:o + stride], partial(track.one, read_staged, j))

    # -- operators --------------------------------------------------------------------------------------
    def traffic(self) -> dict[str, dict]:
        """Per lower tier: bytes and busy seconds written and read, corrupt blocks, failed writes and reads."""
        m = self.meters
        disk = self.disk
        return {
            "host": {"bytes_written": m.host_write.bytes, "write_seconds": m.host_write.busy_seconds,
                     "bytes_read": m.host_read.bytes, "read_seconds": m.host_read.busy_seconds, "corrupt": 0},
            "disk": {"bytes_written": m.disk_write.bytes, "write_seconds": m.disk_write.busy_seconds,
                     "bytes_read": m.disk_read.bytes, "read_seconds": m.disk_read.busy_seconds,
                     "corrupt": disk.corrupt if disk is not None else 0,
                     "failed_writes": getattr(disk, "failed_writes", 0),
                     "failed_reads": getattr(disk, "failed_reads", 0)},
        }

    def close(self) -> None:
        """Finish every copy in flight, make the disk tier durable, free the host buffer."""
        try:
            if self.disk is not None:
                self.disk.drain()
            self.poll()
            self.completions.stop_watching()
            self.poll()
            if self.disk is not None:
                self.disk.sync()
        finally:
            if self.disk is not None:
                self.disk.close()
            self.host.close()
