"""Tier 2: block copies in files, with checksums and an index that survives restarts.

Layout of the disk directory (``--disk-dir``; the systemd unit's state
directory /var/lib/kvpoold by default)::

    tiers.lock        flock()ed by the daemon that uses the directory
    geometries.json   layout id -> block geometry (rewritten atomically)
    blocks-<id>.dat   the blocks of one geometry, one slot each (slot size =
                      block bytes rounded up to 4 KiB, so O_DIRECT works)
    index.log         an append-only log of ADD/DEL records

**Whose directory.** The tier holds every tenant's KV, so its directory must
be the daemon's alone: one owned by another user, or one that group or others
may write to (where anyone could plant a symbolic link to a file the daemon
would then overwrite), is refused at start (``open_private_dir``).  Every file
is opened relative to that directory's descriptor, never through a symbolic
link, only if it is a regular file of the daemon's user with one link, and
files the tier creates are made mode 0600 (``open_in``; temporary files
with ``O_EXCL`` after removing whatever was left there).

**Checksums.** Every block is written with the xxh3-64 of its bytes, kept in
memory and in its ADD record; a read recomputes it, and a block that does not
match is dropped and counted, never served (the read reports failure and the
caller's block is invalidated).

**The index.** An ADD record (layout id, block hash, slot, size, checksum) is
appended once the block's bytes were written; a DEL record when it is
promoted, dropped or overwritten.  Each record carries its own xxh32, so a
torn tail (a crash in the middle of an append) is recognised and ignored.  At
start the log is replayed (a later ADD for a slot supersedes an earlier one),
rewritten compactly (written to a temporary file, fsynced, renamed, directory
fsynced), and the blocks are offered to the core, oldest first, as far as
``--disk-bytes`` allows.  Hashes are deterministic (model id, extra key and
tokens), so a restarted daemon's clients find their blocks again.  Only
prefix-cache blocks are indexed: a swapped-out sequence's copy belongs to a
session, which a restart ends.

**Durability.** Data files are fdatasync'ed and the log fsync'ed at a clean
shutdown and whenever the log is compacted; between those a crash can lose
recent records or leave records whose bytes did not reach the disk.  The
checksum turns the second case into a dropped block, never a wrong one.

**I/O.** Writes and reads run in two thread pools (separate, so that a read
waiting for the write of the same block can never starve it).  A batch whose
slots are consecutive in one file is one ``pwritev``/``preadv``; buffers
aligned to 4 KiB go through an ``O_DIRECT`` descriptor where the file system
allows it (large aligned writes, no page-cache copy), others through a
buffered one.  The bookkeeping (entries, slots, the log) is touched only by
the event loop's thread: workers report through ``post``.

**Faults.** A write that fails (EIO, ENOSPC: a file system fuller than
``--disk-bytes`` assumed, EFBIG) loses only that copy: the entry is forgotten,
its slot freed, and ``failed_writes`` counts the blocks; the caller learns it
through ``on_done(False)`` (a demoted cached block is then simply not cached;
a block a sequence holds on the device is never touched by the disk tier).  A
read that fails counts in ``failed_reads`` and reports failure like a bad
checksum: the promoted or swapped-in block is recomputed by its owner.  The
write and read calls pass through the failpoints ``disk.write`` and
``disk.read`` (``kvpoold/faults.py``), off unless ``KVPOOLD_FAILPOINTS`` arms
them.

Parts: ``disk_files`` opens the directory and its files safely and does the
vectored I/O; ``disk_index`` writes and replays the index's records;
``DiskStore`` here keeps the entries and runs the I/O threads.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import xxhash

from kvpool.protocol.sizes import cdiv

from kvpoold import faults

from .disk_files import (
    ALIGN, DataFile, DiskTierError, open_in, open_private_dir, preadv_all, pwritev_all, vectored, write_atomic,
)
from .disk_index import ADD, DEL, MAGIC, record, replay
from .meter import Meters

log = logging.getLogger("kvpoold")

INDEX, GEOMETRIES = "index.log", "geometries.json"
# One I/O job (one pwritev/preadv) is at most this large: big enough for large requests, small enough
# that a batch of a few hundred MiB is several jobs per I/O thread, so every thread has work until the
# end of the batch and the checksums of one job run while other jobs' I/O is in flight.
MAX_BATCH_BYTES = 16 << 20
MAX_BATCH_ITEMS = 256
_FAIL_WRITE = faults.point("disk.write")  # None unless KVPOOLD_FAILPOINTS arms it
_FAIL_READ = faults.point("disk.read")


def checksum(view) -> int:
    return xxhash.xxh3_64_intdigest(view)


class DiskEntry:
    __slots__ = ("gid", "offset", "nbytes", "checksum", "ready", "ok", "logged", "persist", "pins", "forgotten",
                 "freed")

    def __init__(self, gid: int, offset: int, nbytes: int, persist: bool) -> None:
        self.gid = gid
        self.offset = offset
        self.nbytes = nbytes
        self.checksum = 0
        self.ready = threading.Event()  # set by the writer when the bytes are on disk (or the write failed)
        self.ok = False
        self.logged = False  # an ADD record exists
        self.persist = persist  # a prefix block (indexed) rather than a swap copy
        # loop-side: copies in flight on the slot, whether the key let go of it, whether it was freed
        self.pins = 0
        self.forgotten = False
        self.freed = False


class DiskStore:
    def __init__(self, directory: str, capacity: int, *, post, meters: Meters | None = None,
                 io_threads: int = 4, direct: bool = True) -> None:
        self.directory = os.path.abspath(directory)
        self.capacity = capacity
        self.post = post  # queue a callback for the event loop's thread
        self.meters = meters or Meters()
        self.direct = direct
        self.corrupt = 0  # blocks whose checksum failed on read
        self.lost = 0  # blocks whose write or read failed
        self.failed_writes = 0  # blocks whose write raised (EIO, ENOSPC, EFBIG, ...): the copy was dropped
        self.failed_reads = 0  # blocks whose read raised: not served, the owner recomputes
        self.index_errors = 0  # appends to index.log that failed (rewritten whole at the next sync)
        self._index_stale = False
        faults.announce()
        self._lock_fd = self._log_fd = None
        self._dir_fd = open_private_dir(self.directory)  # every file below is opened relative to it
        self.files: dict[int, DataFile] = {}
        self.geoms: dict[int, dict] = {}
        self.gid_of: dict[int, int] = {}  # class id -> layout id
        self.entries: dict[tuple, DiskEntry] = {}  # (class id, digest or swap number) -> entry
        #: blocks found at start, before their class exists: layout id -> {digest: entry}, oldest first
        self.found: dict[int, dict[bytes, DiskEntry]] = {}
        self._pending: list[tuple] = []  # writes not submitted yet: (key, entry, view, on_done)
        self._pending_reads: list[tuple] = []  # reads not submitted yet
        self._logbuf = bytearray()
        self._log_records = 0
        self._writers = ThreadPoolExecutor(io_threads, thread_name_prefix="kvpool-disk-w")
        self._readers = ThreadPoolExecutor(io_threads, thread_name_prefix="kvpool-disk-r")
        try:
            self._lock()
            self._load()
        except BaseException:
            self.close()
            raise

    def _lock(self) -> None:
        self._lock_fd = self._open("tiers.lock", os.O_RDWR, create=True)
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise DiskTierError(f"another kvpoold uses the disk tier in {self.directory}: give each daemon its own "
                                "--disk-dir") from None

    # -- start: geometries, replay, compaction ----------------------------------------------------
    @property
    def _index_path(self) -> str:
        return os.path.join(self.directory, INDEX)

    @property
    def _geoms_path(self) -> str:
        return os.path.join(self.directory, GEOMETRIES)

    def _open(self, name: str, flags: int, *, create: bool = False) -> int:
        return open_in(self._dir_fd, self.directory, name, flags, create=create)

    def _read(self, name: str) -> bytes:
        """The whole file ``name`` of the directory; FileNotFoundError when there is none."""
        with os.fdopen(self._open(name, os.O_RDONLY), "rb") as f:
            return f.read()

    def _load(self) -> None:
        try:
            self.geoms = {int(k): v for k, v in json.loads(self._read(GEOMETRIES)).items()}
        except FileNotFoundError:
            self.geoms = {}
        except (OSError, ValueError) as exc:
            log.warning("disk tier: %s is unreadable (%s): starting with an empty disk tier", self._geoms_path, exc)
            self.geoms = {}
        try:
            data = self._read(INDEX)
        except FileNotFoundError:
            data = b""
        if data and not data.startswith(MAGIC):
            log.warning("disk tier: %s is not a kvpool index: ignoring it", self._index_path)
            data = b""
        live, torn = replay(data)
        if torn:
            log.warning("disk tier: ignored a torn or damaged tail of %d bytes in %s", torn, self._index_path)
        for gid, geom in self.geoms.items():
            self._open_file(gid, geom["block_bytes"])
        kept = 0
        for (gid, digest), (offset, nbytes, csum) in live.items():
            f = self.files.get(gid)
            if f is None or nbytes != self.geoms[gid]["block_bytes"] or offset % f.stride:
                continue
            if offset + f.stride > os.fstat(f.fd).st_size:
                continue  # the data never reached the file
            f.slots.reserve(offset, f.stride)
            e = DiskEntry(gid, offset, nbytes, persist=True)
            e.checksum, e.ok, e.logged = csum, True, True
            e.ready.set()
            self.found.setdefault(gid, {})[digest] = e
            kept += 1
        for f in self.files.values():
            f.slots.seal(f.stride)
        self._compact()
        if kept:
            log.info("disk tier: found %d blocks in %s", kept, self.directory)

    def _open_file(self, gid: int, block_bytes: int) -> DataFile:
        f = self.files.get(gid)
        if f is None:
            stride = cdiv(block_bytes, ALIGN) * ALIGN
            f = self.files[gid] = DataFile(self._dir_fd, self.directory, f"blocks-{gid}.dat", stride, self.direct)
        return f

    def _compact(self) -> None:
        """Rewrite the index with one ADD per indexed block (atomically, fsynced)."""
        recs = [MAGIC]
        n = 0
        for gid, found in self.found.items():
            for digest, e in found.items():
                recs.append(record(ADD, gid, digest, e.offset, e.nbytes, e.checksum))
                n += 1
        for (cid, digest), e in self.entries.items():
            if e.logged:
                recs.append(record(ADD, e.gid, digest, e.offset, e.nbytes, e.checksum))
                n += 1
        for f in self.files.values():
            os.fdatasync(f.fd)  # the bytes the records name are on disk first
        write_atomic(self._dir_fd, INDEX, b"".join(recs))
        if self._log_fd is not None:
            os.close(self._log_fd)
        self._log_fd = self._open(INDEX, os.O_WRONLY | os.O_APPEND)
        self._logbuf.clear()
        self._log_records = n

    # -- classes -----------------------------------------------------------------------------------
    def layout_id(self, geometry: dict) -> int:
        """The layout id of a geometry (``block_bytes`` included), creating it on first use."""
        for gid, g in self.geoms.items():
            if g == geometry:
                return gid
        gid = max(self.geoms, default=0) + 1
        self.geoms[gid] = dict(geometry)
        table = json.dumps({str(k): v for k, v in self.geoms.items()}, indent=1).encode()
        write_atomic(self._dir_fd, GEOMETRIES, table)
        self._open_file(gid, geometry["block_bytes"])
        return gid

    def bind(self, class_id: int, gid: int) -> None:
        self.gid_of[class_id] = gid

    def _release(self, e: DiskEntry) -> None:
        """Free the entry's slot once its key let go of it and no copy uses it."""
        if e.forgotten and e.pins == 0 and not e.freed:
            e.freed = True
            self.files[e.gid].slots.free(e.offset)

    def adopt(self, class_id: int, digest: bytes) -> None:
        """A found block that the core took: it is the class's entry from now on."""
        gid = self.gid_of[class_id]
        self.entries[(class_id, digest)] = self.found[gid].pop(digest)

    def reject_found(self) -> int:
        """Drop every found block the core did not take (no room, unknown layout); returns how many."""
        n = 0
        for gid, found in self.found.items():
            for digest, e in found.items():
                self._log(DEL, gid, digest, e)
                e.forgotten = True
                self._release(e)
                n += 1
        self.found.clear()
        self._flush_log()
        return n

    # -- the loop's calls ----------------------------------------------------------------------------
    def __contains__(self, key: tuple) -> bool:
        return key in self.entries

    def write(self, key: tuple, view: np.ndarray, nbytes: int, on_done) -> None:
        """Write the first ``nbytes`` of ``view`` as ``key``'s block (queued until ``flush``).

        ``view`` must stay untouched until ``on_done(ok)`` runs (on the loop).
        """
        gid = self.gid_of[key[0]]
        f = self.files[gid]
        if key in self.entries:
            self.drop(key)
        off = f.slots.alloc(f.stride)
        e = DiskEntry(gid, off, nbytes, persist=isinstance(key[1], bytes))
        e.pins = 1  # the write
        self.entries[key] = e
        self._pending.append((key, e, view, on_done))

    def flush(self) -> None:
        """Submit the queued writes and reads (a run of consecutive slots of one file per job)."""
        self._submit_writes()
        self._submit_reads()

    def _submit_writes(self) -> None:
        pending, self._pending = self._pending, []
        pending.sort(key=lambda p: (p[1].gid, p[1].offset))
        job: list = []
        size = 0  # bytes of the views in ``job``
        for item in pending:
            key, e, view, _ = item
            if job:
                last = job[-1][1]
                f = self.files[e.gid]
                contiguous = e.gid == last.gid and e.offset == last.offset + f.stride
                if not contiguous or len(job) >= MAX_BATCH_ITEMS or size >= MAX_BATCH_BYTES:
                    self._writers.submit(self._write_job, job)
                    job, size = [], 0
            job.append(item)
            size += view.nbytes
        if job:
            self._writers.submit(self._write_job, job)

    def _write_job(self, job: list) -> None:
        self.meters.disk_write.start()
        error = None
        f = self.files[job[0][1].gid]
        try:
            for key, e, view, _ in job:
                e.checksum = checksum(view[:e.nbytes])
            bufs = [view[:f.stride] if view.nbytes >= f.stride else view for _, _, view, _ in job]
            if _FAIL_WRITE is not None:
                _FAIL_WRITE()
            vectored(pwritev_all, f, bufs, job[0][1].offset)
        except Exception as exc:  # noqa: BLE001 - reported through the completion
            error = exc
        for _, e, _, _ in job:
            e.ok = error is None
            e.ready.set()
        self.meters.disk_write.stop(sum(e.nbytes for _, e, _, _ in job) if error is None else 0, len(job))
        self.post(lambda: self._written(job, error))

    def _written(self, job: list, error) -> None:
        if error is not None:
            self.failed_writes += len(job)
            log.error("disk tier: writing %d blocks failed (their copies are dropped): %s", len(job), error)
        for key, e, _, on_done in job:
            e.pins -= 1
            current = self.entries.get(key) is e
            if e.ok and current:
                if e.persist:
                    self._log(ADD, e.gid, key[1], e)
            elif current:  # the write failed: the block is lost
                del self.entries[key]
                e.forgotten = True
                self.lost += 1
            self._release(e)
            on_done(e.ok, key)
        self._flush_log()

    def read(self, key: tuple, view: np.ndarray, on_done) -> None:
        """Read ``key``'s block into ``view`` and forget it (a promotion or swap-in).

        ``on_done(ok, corrupt)`` runs on the loop; a missing key fails at once.
        """
        e = self.entries.pop(key, None)
        if e is None:
            self.post(lambda: on_done(False, False))
            return
        if e.logged:
            self._log(DEL, e.gid, key[1], e)
            e.logged = False
        e.forgotten = True
        e.pins += 1  # the read
        self._pending_reads.append((key, e, view, on_done))

    def _submit_reads(self) -> None:
        """A run of consecutive slots of one file, whose blocks fill their slots, is one job."""
        reads, self._pending_reads = self._pending_reads, []
        reads.sort(key=lambda r: (r[1].gid, r[1].offset))
        job: list = []
        for item in reads:
            e = item[1]
            if job:
                last = job[-1][1]
                stride = self.files[e.gid].stride
                contiguous = (e.gid == last.gid and e.offset == last.offset + stride and e.nbytes == stride
                              and last.nbytes == stride)
                if not contiguous or len(job) >= MAX_BATCH_ITEMS or len(job) * stride >= MAX_BATCH_BYTES:
                    self._readers.submit(self._read_job, job)
                    job = []
            job.append(item)
        if job:
            self._readers.submit(self._read_job, job)

    def _read_job(self, job: list) -> None:
        for _, e, _, _ in job:
            e.ready.wait()  # a block whose write is still running
        f = self.files[job[0][1].gid]
        bufs = [view[:e.nbytes] for _, e, view, _ in job]
        results = [(False, False)] * len(job)
        read_error = False
        if all(e.ok for _, e, _, _ in job):
            self.meters.disk_read.start()
            nbytes = 0
            try:
                if _FAIL_READ is not None:
                    _FAIL_READ()
                vectored(preadv_all, f, bufs, job[0][1].offset)
                results = []
                for (_, e, _, _), buf in zip(job, bufs):
                    ok = checksum(buf) == e.checksum
                    results.append((ok, not ok))
                    nbytes += e.nbytes if ok else 0
            except Exception as exc:  # noqa: BLE001 - reported through the completion
                log.error("disk tier: reading %d blocks failed: %s", len(job), exc)
                results = [(False, False)] * len(job)
                read_error = True
            self.meters.disk_read.stop(nbytes, len(job))
        elif len(job) > 1:  # a write failed: the others one by one
            for item in job:
                self._read_job([item])
            return
        self.post(lambda: self._read_done(job, results, read_error))

    def _read_done(self, job: list, results: list, read_error: bool = False) -> None:
        if read_error:
            self.failed_reads += len(job)
        for (key, e, _, on_done), (ok, corrupt) in zip(job, results):
            if corrupt:
                self.corrupt += 1
                log.warning("disk tier: block %s failed its checksum: dropped, not served", key)
            elif not ok:
                self.lost += 1
            e.pins -= 1
            self._release(e)
            on_done(ok, corrupt)
        self._flush_log()

    def drop(self, key: tuple) -> bool:
        """Forget ``key``'s block; its slot is reused once a write in flight is done."""
        e = self.entries.pop(key, None)
        if e is None:
            return False
        if e.logged:
            self._log(DEL, e.gid, key[1], e)
            e.logged = False
        e.forgotten = True
        self._release(e)  # or later, when a copy in flight ends
        return True

    # -- the log ---------------------------------------------------------------------------------------
    def _log(self, op: int, gid: int, digest, e: DiskEntry) -> None:
        if not isinstance(digest, bytes):
            return  # swap copies are not indexed
        self._logbuf += record(op, gid, digest, e.offset, e.nbytes, e.checksum)
        self._log_records += 1
        if op == ADD:
            e.logged = True

    def _flush_log(self) -> None:
        """Append the queued records; an index that cannot be written is rewritten at the next sync.

        A lost or torn record costs at most blocks after a restart (a torn tail
        is ignored; a stale ADD fails its checksum), never a wrong block, so a
        full or failing disk must not stop the completions that call this.
        """
        if self._logbuf:
            data, self._logbuf = bytes(self._logbuf), bytearray()
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(self._log_fd, view):]
                live = sum(1 for e in self.entries.values() if e.logged)
                if self._log_records > 4 * live + 4096 or self._index_stale:
                    self._compact()
                    self._index_stale = False
            except OSError as exc:
                self.index_errors += 1
                self._index_stale = True
                log.error("disk tier: writing the index %s failed (%s): it is rewritten at the next sync",
                          self._index_path, exc)

    # -- shutdown ----------------------------------------------------------------------------------------
    def drain(self) -> None:
        """Submit queued writes and wait for every job (callers then run the posted completions)."""
        self.flush()
        self._writers.shutdown(wait=True)
        self._readers.shutdown(wait=True)

    def sync(self) -> None:
        """Make everything written so far durable: data first, then the index."""
        self._flush_log()
        if self._index_stale:
            self._compact()  # may raise again: the caller logs it; the next start replays what is there
            self._index_stale = False
        for f in self.files.values():
            if f.fd is not None:
                os.fdatasync(f.fd)
        if self._log_fd is not None:
            os.fsync(self._log_fd)

    def close(self) -> None:
        for f in self.files.values():
            f.close()
        if self._log_fd is not None:
            os.close(self._log_fd)
            self._log_fd = None
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # releases the flock
            self._lock_fd = None
        if self._dir_fd is not None:
            os.close(self._dir_fd)
            self._dir_fd = None
