"""The transfer engine: runs the core's tier moves on real bytes.

The core plans ``Move``s (``KVCacheManager.drain_moves``) in an executable
order; ``submit`` runs the moves of one daemon call:

1. **Device reads** (demotions, swap-outs: device block -> host slot, or ->
   host staging -> disk) are batched and *complete before* ``submit``
   returns: on the GPU one gather launch plus DMAs, then a stream
   synchronize; on the CPU memcpys.  The daemon replies to its client only
   after that, and a client learns that a block was handed out again only
   from a reply, so no block is reused before its bytes were copied out.
   A move that depends on a pending device read (the same key pushed on to
   disk in the same call) flushes the batch first.
2. Lower-tier moves (host -> disk, drops) run in plan order; disk writes are
   asynchronous (an I/O thread pool) and their host slot stays pinned until
   they are done.
3. ``between()``: the daemon commits and releases slabs here (after the
   device reads, before device writes into newly taken slabs).
4. **Device writes** (promotions, swap-ins: host slot or disk -> device
   block) start last and may finish later: each gets an ``Arrival``.  The
   daemon holds the block (``KVCacheManager.hold_blocks``) until its arrival
   is done, so it is never freed or handed out while bytes are in flight, and
   a caller that uses it waits for the arrival first.

Slots of the host tier and of the disk files are reused only when no copy
reads or writes them any more (pins).  When the host buffer has no free slot
the engine waits for copies in flight to finish (backpressure), and only when
nothing is in flight uses a temporary buffer.

Completions come from worker threads (disk I/O, the CUDA event watcher)
through one queue; they run on the caller's thread in ``poll`` (the daemon's
event loop: ``notify`` wakes it), so the bookkeeping is single-threaded.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import queue
import threading
from collections import defaultdict

from kvpoold.core.tiers import Move, Tier

from .disk import DiskStore
from .host import HostStore, Slot
from .meter import Meters

log = logging.getLogger("kvpoold")

DEFAULT_STAGING_CPU = 32 << 20
DEFAULT_STAGING_GPU = 256 << 20
GC_PAUSE_MOVES = 256  # batches this large run with the cyclic GC paused (see _gc_paused)


@contextlib.contextmanager
def _gc_paused(n: int):
    """Pause the cyclic garbage collector around a large batch.

    A batch makes a few Python objects per block (moves, slots, arrivals);
    with a daemon's worth of long-lived objects, the collections that those
    allocations trigger cost more than the bookkeeping itself (measured: 1.5
    vs 2-5 us per block).  Nothing here makes cycles; the collector catches
    up after the batch.
    """
    if n < GC_PAUSE_MOVES or not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


class Arrival:
    """Bytes on their way into one device block."""

    __slots__ = ("class_id", "block", "done", "ok", "corrupt", "waiters", "digest")

    def __init__(self, class_id: int, block: int) -> None:
        self.class_id = class_id
        self.block = block
        self.digest = None  # the daemon keeps the hash a failed block lost here
        self.done = False
        self.ok = False
        self.corrupt = False
        self.waiters: list = []

    def finish(self, ok: bool, corrupt: bool = False) -> None:
        self.done, self.ok, self.corrupt = True, ok, corrupt
        waiters, self.waiters = self.waiters, []
        for w in waiters:
            w(self)

    def __repr__(self) -> str:
        state = "arriving" if not self.done else "ok" if self.ok else "corrupt" if self.corrupt else "lost"
        return f"Arrival(class {self.class_id}, block {self.block}, {state})"


class _Class:
    __slots__ = ("block_bytes", "pool", "rows")

    def __init__(self, block_bytes: int, pool) -> None:
        self.block_bytes = block_bytes
        self.pool = pool  # torch uint8 [num_blocks, block_bytes] over the arena, or None
        self.rows = None if pool is None or pool.is_cuda else pool.numpy()


class TransferEngine:
    def __init__(self, host_bytes: int = 0, disk_dir: str | None = None, disk_bytes: int = 0, *,
                 cuda_device: int | None = None, staging_bytes: int | None = None, io_threads: int = 4,
                 direct: bool = True) -> None:
        self.meters = Meters()
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self.notify = None  # called (from any thread) after a completion was queued
        self.on_lost = lambda key: None  # a lower-tier copy could not be written
        self._inflight = 0  # asynchronous copies whose completion has not run yet
        if staging_bytes is None:
            staging_bytes = DEFAULT_STAGING_GPU if cuda_device is not None else DEFAULT_STAGING_CPU
        self.host = HostStore(host_bytes, staging_bytes, cuda_device)
        self.disk = DiskStore(disk_dir, disk_bytes, post=self.post, meters=self.meters, io_threads=io_threads,
                              direct=direct) if disk_dir and disk_bytes else None
        self.copier = None
        self._watch_q: queue.SimpleQueue | None = None
        if cuda_device is not None:
            from .cuda import CudaCopier

            self.copier = CudaCopier(cuda_device)
            self._watch_q = queue.SimpleQueue()
            self._watcher = threading.Thread(target=self._watch, name="kvpool-cuda-events", daemon=True)
            self._watcher.start()
        self.classes: dict[int, _Class] = {}

    # -- plumbing ---------------------------------------------------------------------------------
    def add_class(self, class_id: int, block_bytes: int, pool=None) -> None:
        """Bytes of class ``class_id`` live in ``pool`` (torch uint8 [blocks, block_bytes]; None: none yet)."""
        self.classes[class_id] = _Class(block_bytes, pool)

    def post(self, fn) -> None:
        """Queue ``fn`` to run on the loop's thread (from any thread)."""
        self._q.put(fn)
        notify = self.notify
        if notify is not None:
            notify()

    def _tracked(self, fn):
        """``fn`` as the completion of an asynchronous copy (counted in flight until it runs)."""
        self._inflight += 1

        def done(*args):
            self._inflight -= 1
            fn(*args)

        return done

    def poll(self) -> int:
        """Run the completions queued so far; returns how many."""
        n = 0
        with _gc_paused(self._q.qsize() * GC_PAUSE_MOVES):  # a completion often finishes a whole batch
            while True:
                try:
                    fn = self._q.get_nowait()
                except queue.Empty:
                    return n
                fn()
                n += 1

    def _wait_one(self, timeout: float | None = None) -> bool:
        """Block until one completion ran; False if nothing is in flight (or the timeout passed)."""
        if self._inflight == 0 and self._q.empty():
            return False
        try:
            fn = self._q.get(timeout=timeout)
        except queue.Empty:
            return False
        fn()
        return True

    def wait(self, arrivals, timeout: float | None = None) -> bool:
        """Block until every arrival is done (tests, benchmarks; the daemon awaits instead)."""
        with _gc_paused(len(arrivals)):
            for a in arrivals:
                while not a.done:
                    if not self._wait_one(timeout):
                        return False
        return True

    def idle(self) -> bool:
        return self._inflight == 0 and self._q.empty()

    def drain(self) -> None:
        """Wait for every copy in flight."""
        while self._wait_one():
            pass

    def _watch(self) -> None:
        """Wait for CUDA events in order and report them (a thread: nothing else blocks on the GPU)."""
        while True:
            item = self._watch_q.get()
            if item is None:
                return
            event, meter, nbytes, blocks, fn = item
            try:
                event.synchronize()
            finally:
                meter.stop(nbytes, blocks)
                self.post(fn)

    def _host_slot(self, nbytes: int) -> Slot:
        while True:
            slot = self.host.alloc(nbytes)
            if slot is not None:
                return slot
            if self.disk is not None:
                self.disk.flush()  # queued disk jobs must run for their slots to come back
            if not self._wait_one():  # nothing in flight will free one
                return self.host.temp(nbytes)

    # -- a call's moves ------------------------------------------------------------------------------
    def submit(self, moves: list[Move], between=None) -> list[Arrival]:
        """Run one call's moves (module docstring); returns the arrivals of its device writes."""
        with _gc_paused(len(moves)):
            return self._submit(moves, between)

    def _submit(self, moves: list[Move], between) -> list[Arrival]:
        outs: list[Move] = []
        out_keys: set = set()
        writes: list[Move] = []
        for mv in moves:
            if mv.dst == Tier.DEVICE:
                writes.append(mv)
                continue
            if mv.src == Tier.DEVICE:
                if mv.dst is not None:
                    outs.append(mv)
                    out_keys.add(mv.key)
                continue
            if mv.key in out_keys:
                self._flush_out(outs)
                outs, out_keys = [], set()
            if mv.dst is None:
                self._drop(mv)
            else:
                self._host_to_disk(mv)
        if outs:
            self._flush_out(outs)
        if self.disk is not None:
            self.disk.flush()
        if between is not None:
            between()
        arrivals = self._device_in(writes) if writes else []
        if self.disk is not None:
            self.disk.flush()
        return arrivals

    def _drop(self, mv: Move) -> None:
        if mv.src == Tier.HOST:
            self.host.drop(mv.key)
        elif mv.src == Tier.DISK and self.disk is not None:
            self.disk.drop(mv.key)

    def _lost(self, key) -> None:
        try:
            self.on_lost(key)
        except Exception:  # noqa: BLE001 - a completion must not break the loop
            log.exception("reporting a lost block failed")

    def _to_disk(self, key, slot: Slot, nbytes: int) -> None:
        """Write a host slot's bytes to disk as ``key``; the slot is freed when the write is done."""
        host = self.host
        host.pin(slot)
        host.release(slot)

        def done(ok, key):
            host.unpin(slot)
            if not ok:
                self._lost(key)

        self.disk.write(key, slot.view, nbytes, self._tracked(done))

    def _host_to_disk(self, mv: Move) -> None:
        slot = self.host.pop(mv.key)
        if slot is None or self.disk is None:
            self._lost(mv.key)
            return
        self._to_disk(mv.key, slot, mv.nbytes)

    def _flush_out(self, outs: list[Move]) -> None:
        """Device reads: copy each block to a host slot (the host tier's, or staging for the disk)."""
        groups: dict[int, list[Move]] = defaultdict(list)
        for mv in outs:
            groups[mv.key[0]].append(mv)
        for cid, group in groups.items():
            cls = self.classes[cid]
            bb = cls.block_bytes
            slots = [self._host_slot(bb) for _ in group]
            meter = self.meters.host_write
            meter.start()
            try:
                if self.copier is not None:
                    self.copier.to_host(cls.pool, [mv.block for mv in group], self.host.tensor, slots).synchronize()
                else:
                    rows = cls.rows
                    for mv, slot in zip(group, slots):
                        slot.view[:bb] = rows[mv.block]
            finally:
                meter.stop(bb * len(group), len(group))
            for mv, slot in zip(group, slots):
                if mv.dst == Tier.HOST:
                    self.host.put(mv.key, slot)
                elif self.disk is not None:
                    self._to_disk(mv.key, slot, bb)
                else:
                    self.host.release(slot)
                    self._lost(mv.key)

    def _device_in(self, writes: list[Move]) -> list[Arrival]:
        """Device writes: promotions and swap-ins, from host slots or from disk."""
        arrivals = []
        groups: dict[int, list[Move]] = defaultdict(list)
        for mv in writes:
            groups[mv.key[0]].append(mv)
        for cid, group in groups.items():
            cls = self.classes[cid]
            bb = cls.block_bytes
            from_host: list[tuple[Move, Slot, Arrival]] = []
            for mv in group:
                a = Arrival(cid, mv.block)
                arrivals.append(a)
                if mv.src == Tier.HOST:
                    slot = self.host.pop(mv.key)
                    if slot is None:
                        a.finish(False)
                        continue
                    self.host.pin(slot)
                    self.host.release(slot)
                    from_host.append((mv, slot, a))
                elif mv.src == Tier.DISK and self.disk is not None:
                    self._disk_in(cls, mv, a)
                else:
                    a.finish(False)
            if from_host:
                self._host_in(cls, from_host)
        return arrivals

    def _host_in(self, cls: _Class, items: list) -> None:
        bb = cls.block_bytes
        meter = self.meters.host_read
        meter.start()
        if self.copier is None:
            try:
                for mv, slot, a in items:
                    cls.rows[mv.block] = slot.view[:bb]
            finally:
                meter.stop(bb * len(items), len(items))
            for mv, slot, a in items:
                self.host.unpin(slot)
                a.finish(True)
            return
        event = self.copier.to_device(cls.pool, [mv.block for mv, _, _ in items], self.host.tensor,
                                      [slot for _, slot, _ in items])

        def done():
            for mv, slot, a in items:
                self.host.unpin(slot)
                a.finish(True)

        self._watch_q.put((event, meter, bb * len(items), len(items), self._tracked(done)))

    def _disk_in(self, cls: _Class, mv: Move, a: Arrival) -> None:
        bb = cls.block_bytes
        if self.copier is None:  # the CPU pool: read straight into the block
            self.disk.read(mv.key, cls.rows[mv.block], self._tracked(lambda ok, corrupt: a.finish(ok, corrupt)))
            return
        slot = self._host_slot(bb)  # the GPU: read into pinned staging, then one DMA
        self.host.pin(slot)
        self.host.release(slot)

        def read(ok, corrupt):
            if not ok:
                self.host.unpin(slot)
                a.finish(False, corrupt)
                return
            self._host_in(cls, [(mv, slot, a)])

        self.disk.read(mv.key, slot.view, self._tracked(read))

    # -- operators --------------------------------------------------------------------------------------
    def traffic(self) -> dict[str, dict]:
        """Per lower tier: bytes and busy seconds written and read, corrupt blocks."""
        m = self.meters
        return {
            "host": {"bytes_written": m.host_write.bytes, "write_seconds": m.host_write.busy_seconds,
                     "bytes_read": m.host_read.bytes, "read_seconds": m.host_read.busy_seconds, "corrupt": 0},
            "disk": {"bytes_written": m.disk_write.bytes, "write_seconds": m.disk_write.busy_seconds,
                     "bytes_read": m.disk_read.bytes, "read_seconds": m.disk_read.busy_seconds,
                     "corrupt": self.disk.corrupt if self.disk is not None else 0},
        }

    def close(self) -> None:
        """Finish every copy in flight, make the disk tier durable, free the host buffer."""
        try:
            if self.disk is not None:
                self.disk.drain()
            self.poll()
            if self._watch_q is not None:
                self._watch_q.put(None)
                self._watcher.join(timeout=30)
            self.poll()
            if self.disk is not None:
                self.disk.sync()
        finally:
            if self.disk is not None:
                self.disk.close()
            self.host.close()
