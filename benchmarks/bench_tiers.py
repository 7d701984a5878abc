"""Tier transfer bandwidth: GPU <-> pinned host, and the disk tier.

    python3 benchmarks/bench_tiers.py                  # everything this machine has
    python3 benchmarks/bench_tiers.py --skip-gpu --disk-gib 0.5
    python3 benchmarks/bench_tiers.py --skip-disk --cpu-engine   # the engine's bookkeeping, no GPU

GPU (when CUDA is there), for batches of 2 MiB and of 32 KiB blocks at
random places in a device pool, 1 GiB per batch:

* ``torch pinned copy_``: the yardstick, one contiguous ``copy_`` of the same
  bytes between device memory and pinned host memory (each way, and both
  ways at once on two streams), measured in the same run;
* ``copier``: ``kvpoold.transfer.cuda.CudaCopier`` (one gather/scatter launch
  into device staging plus one DMA per run of host slots);
* ``engine``: ``TransferEngine.submit`` with demotion / promotion plans
  (``MovePlan`` columns, as the core makes them), the daemon's whole path
  including the bookkeeping of slots and arrival batches: one way each, and
  both ways at once (a batch of promotions in flight while the next call's
  demotions run, as in the daemon);
* ``per-block copy_``: one ``copy_`` per block (what the copier avoids).

CPU engine mode (``--cpu-engine``; also run when there is no GPU): the same
engine path with the real engine and host store, and a copier whose device
copies are numpy copies between a host array standing for the device pool
and the host store (it returns an already-fired event, so completions go
through the engine's watcher thread as on a GPU).  It reports microseconds
per block: the whole ``submit`` (+ ``wait``), the copies alone, and the
difference, the engine's bookkeeping.  The core's planning of the same
batches (``KVCacheManager``: evictions that demote, a prefix hit that
promotes) is timed too.  Then the engine runs against ``PacedCopier``, which
moves no bytes and makes each copy take bytes / ``--paced-gbps`` on its
direction's lane, as a DMA does without costing the host anything: the
engine's GB/s against the paced copier's alone shows how much bookkeeping is
left outside the copies at a GPU's rate.  ``--pipeline-blocks`` sets the
engine's piece size in blocks (a value larger than a batch: one piece, the
engine before pipelining).

Disk (any machine): ``DiskStore`` writes and reads (checksums, O_DIRECT where
the file system allows it, 4 I/O threads) against ``dd`` with
``oflag=direct`` / ``iflag=direct`` of the same bytes and block size on the
same file system, in the same run; ``dd`` reads the store's own data file,
the store's buffers are touched before the clock starts, and the rounds
alternate which of the two runs first (``bench_disk``).

Times are wall-clock medians (after a warm-up) around the call and the
synchronization, so host overhead counts.  Prints a table and writes JSON to
``benchmarks/results/tiers_<kind>_<time>.json``.
"""

from __future__ import annotations

import argparse
import os
import queue
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import print_table, write_json  # noqa: E402

GiB = 1 << 30
MiB = 1 << 20
SIZES = [("2 MiB", 2 * MiB), ("32 KiB", 32 * 1024)]
_ENGINE_OPTS: dict = {}  # TransferEngine options from the command line (--pipeline-blocks)


def _median_s(fn, repeat: int = 5) -> float:
    fn()  # warm-up
    samples = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


# ------------------------------------------------------------------------------------------- engine

def _plan(keys: list, src: int, dst: int, blocks, nbytes: int):
    """A ``MovePlan`` of one batch, made as the core makes it (columns appended in a loop)."""
    from kvpoold.core.tiers import MovePlan

    plan = MovePlan()
    for key, b in zip(keys, blocks):
        plan.add(key, src, dst, b, nbytes)
    return plan


def engine_times(eng, ids_out, ids_in, bb: int, repeat: int, copy_clock=None) -> dict:
    """Median seconds of the engine's path for one batch: demote (d2h), promote (h2d), both at once.

    Plans are made before the clock starts (the core's share is timed in ``bench_core_plans``); the
    clock runs from ``submit`` to the end of ``wait``.  ``copy_clock()`` (CPU mode) gives the seconds
    the copier spent copying so far, so that the bookkeeping can be told apart.
    """
    from kvpoold.core.tiers import DROP, Tier

    n = len(ids_out)
    D, H = int(Tier.DEVICE), int(Tier.HOST)
    serial = [0]

    def keys():
        base = serial[0]
        serial[0] += n
        return [(0, base + i) for i in range(n)]

    clock = copy_clock or (lambda: 0.0)
    samples = {"d2h": [], "h2d": [], "both": [], "d2h_copy": [], "h2d_copy": [], "both_copy": []}

    def timed(name, fn):
        c0 = clock()
        t0 = time.perf_counter()
        fn()
        samples[name].append(time.perf_counter() - t0)
        samples[name + "_copy"].append(clock() - c0)

    def one_way():
        k = keys()
        out = _plan(k, D, H, ids_out, bb)
        back = _plan(k, H, D, ids_in, bb)
        timed("d2h", lambda: eng.submit(out))

        def promote():
            arrivals = eng.submit(back)
            assert eng.wait(arrivals) and all(a.ok for a in arrivals)

        timed("h2d", promote)

    def both_ways():
        k0 = keys()
        eng.submit(_plan(k0, D, H, ids_out, bb))  # on the host: the batch that comes back
        k1 = keys()
        back = _plan(k0, H, D, ids_in, bb)
        out = _plan(k1, D, H, ids_out, bb)

        def both():
            arrivals = eng.submit(back)  # in flight while the next call's demotions run
            eng.submit(out)
            assert eng.wait(arrivals) and all(a.ok for a in arrivals)

        timed("both", both)
        eng.submit(_plan(k1, H, DROP, [-1] * n, bb))  # drop them: room for the next round

    for _ in range(repeat + 1):
        one_way()
        both_ways()
    return {k: statistics.median(v[1:]) for k, v in samples.items()}  # the first round warms up


class _Fired:
    """The event of a copy that is already done."""

    @staticmethod
    def synchronize() -> None:
        return None


def bench_cpu_engine(repeat: int, sizes: list[tuple[str, int, int]]) -> tuple[list, dict]:
    """The engine's path on the CPU: real engine and host store, numpy copies for the device's."""
    from kvpoold.transfer import CpuCopier, TransferEngine

    class TimedCopier(CpuCopier):
        """Numpy copies between a host array (the "device" pool) and the host store, timed; returns an
        event, so completions take the GPU's route (the watcher thread)."""

        def __init__(self):
            self.seconds = 0.0

        def to_host(self, rows, ids, host, offsets):
            t0 = time.perf_counter()
            super().to_host(rows, ids, host, offsets)
            self.seconds += time.perf_counter() - t0
            return _Fired()

        def to_device(self, rows, ids, host, offsets):
            t0 = time.perf_counter()
            super().to_device(rows, ids, host, offsets)
            self.seconds += time.perf_counter() - t0
            return _Fired()

    rows_out, out = [], {}
    for label, bb, n in sizes:
        dev = np.zeros((2 * n, bb), np.uint8)
        dev[:, ::4096] = np.random.default_rng(0).integers(0, 256, (2 * n, -(-bb // 4096)), dtype=np.uint8)
        perm = np.random.default_rng(1).permutation(2 * n)
        ids_out, ids_in = perm[:n].tolist(), perm[n:].tolist()
        cp = TimedCopier()
        eng = TransferEngine(host_bytes=2 * n * bb, staging_bytes=0, copier=cp, **_ENGINE_OPTS)
        eng.add_class(0, bb, dev)
        t = engine_times(eng, ids_out, ids_in, bb, repeat, copy_clock=lambda: cp.seconds)
        eng.close()
        res = {}
        for way in ("d2h", "h2d", "both"):
            blocks = n * (2 if way == "both" else 1)
            res[way] = {"us_per_block": t[way] / blocks * 1e6, "copy_us_per_block": t[way + "_copy"] / blocks * 1e6,
                        "bookkeeping_us_per_block": (t[way] - t[way + "_copy"]) / blocks * 1e6,
                        "gbps": blocks * bb / t[way] / 1e9}
            r = res[way]
            rows_out.append([f"engine {label}", f"{n}", way, f"{r['us_per_block']:.3f}", f"{r['copy_us_per_block']:.3f}",
                             f"{r['bookkeeping_us_per_block']:.3f}", f"{r['gbps']:.1f}"])
        res.update(bench_core_plans(bb, n))
        for way in ("demote", "promote", "promote_hash", "swap_out", "swap_in", "holds"):
            rows_out.append([f"core plan {label}", f"{n}", way, f"{res[f'core_{way}_us_per_block']:.3f}", "", "", ""])
        # the daemon's full path per block: the core's plan plus the engine's submit (+ wait), copies included
        for way, core in (("d2h", "demote"), ("h2d", "promote")):
            full = res[f"core_{core}_us_per_block"] + res[way]["us_per_block"]
            book = res[f"core_{core}_us_per_block"] + res[way]["bookkeeping_us_per_block"]
            res[f"full_{way}"] = {"us_per_block": full, "bookkeeping_us_per_block": book}
            rows_out.append([f"core + engine {label}", f"{n}", way, f"{full:.3f}", f"{res[way]['copy_us_per_block']:.3f}",
                             f"{book:.3f}", f"{bb / full / 1e3:.1f}"])
        out[f"{label} x {n}"] = res
        del dev, eng
    return rows_out, out


class _Deadline:
    """The event of a paced copy: done at ``at`` (``perf_counter`` seconds)."""

    __slots__ = ("at",)

    def __init__(self, at: float) -> None:
        self.at = at

    def synchronize(self) -> None:
        left = self.at - time.perf_counter()
        if left > 0:
            time.sleep(left)


class PacedCopier:
    """A stand-in for ``CudaCopier`` that moves no bytes: each call's copy takes ``bytes / rate`` seconds
    on its direction's lane, after the copies queued on that lane before it (a stream per direction, two
    copy engines).  It costs the host nothing, as a DMA does, so an engine run with it shows how much of
    the engine's bookkeeping is *not* hidden behind the copies at a GPU's rate, on a CPU."""

    def __init__(self, gbps: float) -> None:
        self.rate = gbps * 1e9
        self.free_at = {"out": 0.0, "in": 0.0}

    def _push(self, lane: str, nbytes: int) -> _Deadline:
        at = max(time.perf_counter(), self.free_at[lane]) + nbytes / self.rate
        self.free_at[lane] = at
        return _Deadline(at)

    def to_host(self, rows, ids, host, offsets):
        return self._push("out", len(ids) * rows.shape[1])

    def to_device(self, rows, ids, host, offsets):
        return self._push("in", len(ids) * rows.shape[1])


def bench_paced_engine(repeat: int, sizes: list[tuple[str, int, int]], gbps: float) -> tuple[list, dict]:
    """The engine against ``PacedCopier`` (no bytes move): GB/s of the engine and of the copier alone
    (one call per batch), and the engine's exposed bookkeeping in microseconds per block."""
    from kvpoold.transfer import TransferEngine

    rows_out, out = [], {}
    for label, bb, n in sizes:
        dev = np.zeros((2 * n, bb), np.uint8)  # never touched: no memory is committed
        perm = np.random.default_rng(1).permutation(2 * n)
        ids_out, ids_in = perm[:n].tolist(), perm[n:].tolist()
        cp = PacedCopier(gbps)
        ids_o, ids_i = np.asarray(ids_out, np.int64), np.asarray(ids_in, np.int64)
        offs = np.arange(n, dtype=np.int64) * bb
        buf = np.zeros(0, np.uint8)

        def both():
            a, b = cp.to_host(dev, ids_o, buf, offs), cp.to_device(dev, ids_i, buf, offs)
            a.synchronize()
            b.synchronize()

        alone = {"d2h": _median_s(lambda: cp.to_host(dev, ids_o, buf, offs).synchronize(), repeat),
                 "h2d": _median_s(lambda: cp.to_device(dev, ids_i, buf, offs).synchronize(), repeat),
                 "both": _median_s(both, repeat)}
        eng = TransferEngine(host_bytes=2 * n * bb, staging_bytes=0, copier=cp, **_ENGINE_OPTS)
        eng.add_class(0, bb, dev)
        t = engine_times(eng, ids_out, ids_in, bb, repeat)
        eng.close()
        res = {}
        for way in ("d2h", "h2d", "both"):
            blocks = n * (2 if way == "both" else 1)
            res[way] = {"copier_gbps": blocks * bb / alone[way] / 1e9, "engine_gbps": blocks * bb / t[way] / 1e9,
                        "exposed_us_per_block": (t[way] - alone[way]) / blocks * 1e6}
            r = res[way]
            rows_out.append([f"paced {label}", f"{n}", way, f"{r['copier_gbps']:.1f}", f"{r['engine_gbps']:.1f}",
                             f"{r['engine_gbps'] / r['copier_gbps']:.2f}", f"{r['exposed_us_per_block']:.3f}"])
        out[f"{label} x {n}"] = res
    return rows_out, {"gbps_per_lane": gbps, **out}


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def bench_core_plans(bb: int, n: int, repeat: int = 3) -> dict:
    """The core's planning per block (``KVCacheManager``, no bytes moved), medians of ``repeat`` fresh runs:

    * ``demote``: an eviction pass (``evict_cached``) that demotes ``n`` cached blocks to the host tier;
    * ``promote``: a prefix hit (``create``) promoting those ``n`` blocks from the host tier, hashing the
      prompt included (``promote_hash`` is the hashing alone, ``chain_hashes`` of the same prompt);
    * ``swap_out`` / ``swap_in``: whole sequences (64 of ``n / 64`` blocks) to the host tier and back, with
      their device copies evicted in between (so that every block is copied back);
    * ``holds``: ``hold_blocks`` + ``release_holds`` of ``n`` blocks (the daemon's per-batch holds).
    """
    from kvpoold.core import Geometry, KVCacheManager
    from kvpoold.core.hashing import chain_hashes, pack_tokens, root_hash

    g = Geometry(1, 1, bb // 4, "float16", 1)  # one token per block: block_bytes = 2 * 1 * bb/4 * 2 = bb
    assert g.block_bytes == bb
    samples: dict[str, list] = {}

    def one() -> None:
        m = KVCacheManager(2 * n * bb, chunk_bytes=bb * min(n, 64), host_bytes=2 * n * bb)
        c = m.register_class(g)
        tokens = list(range(n))
        s = m.create(1, c, "m", tokens)
        m.free(1, [s.seq_id])
        m.drain_moves()
        t = {"demote": _timed(lambda: m.evict_cached(c))}
        assert len(m.drain_moves()) == n
        out = []
        t["promote"] = _timed(lambda: out.append(m.create(1, c, "m", tokens)))
        assert out[0].num_cached_tokens == n and len(m.drain_moves()) == n
        t["promote_hash"] = _timed(lambda: chain_hashes(root_hash("m"), pack_tokens(tokens), 1))
        blocks = list(out[0].block_table)
        t["holds"] = _timed(lambda: (m.hold_blocks(c, blocks), m.release_holds(c, blocks)))
        m.free(1, [out[0].seq_id])
        m.evict_cached(c)
        m.drain_moves()
        per = max(1, n // 64)
        ids = [m.create(1, c, "s", [i] * per, extra_key=str(i)).seq_id for i in range(n // per)]
        t["swap_out"] = _timed(lambda: m.swap_out(1, ids))
        assert len(m.drain_moves()) == per * len(ids)
        m.evict_cached(c)  # the device copies go (demoted too): the swap-in copies every block back
        m.drain_moves()
        t["swap_in"] = _timed(lambda: m.swap_in(1, ids))
        assert len(m.drain_moves()) == per * len(ids)
        m.check_invariants() if n <= 4096 else None
        for k, v in t.items():
            samples.setdefault(k, []).append(v)

    for _ in range(repeat):
        one()
    return {f"core_{k}_us_per_block": statistics.median(v) / n * 1e6 for k, v in samples.items()}


# ---------------------------------------------------------------------------------------------- GPU

def bench_gpu(batch_bytes: int, repeat: int) -> tuple[list, dict]:
    import torch

    from kvpoold.transfer.cuda import CudaCopier
    from kvpoold.transfer import TransferEngine
    from kvpoold.transfer.host import HostStore

    dev = torch.device("cuda", 0)
    rows, out = [], {"device": torch.cuda.get_device_name(0), "torch": torch.__version__}
    gb = batch_bytes / 1e9
    # the yardstick: contiguous pinned copies of the same bytes
    d_src = torch.empty(batch_bytes, dtype=torch.uint8, device=dev)
    d_dst = torch.empty(batch_bytes, dtype=torch.uint8, device=dev)
    h_a = torch.empty(batch_bytes, dtype=torch.uint8, pin_memory=True)
    h_b = torch.empty(batch_bytes, dtype=torch.uint8, pin_memory=True)
    s1, s2 = torch.cuda.Stream(dev), torch.cuda.Stream(dev)

    def d2h():
        with torch.cuda.stream(s1):
            h_a.copy_(d_src, non_blocking=True)
        s1.synchronize()

    def h2d():
        with torch.cuda.stream(s2):
            d_dst.copy_(h_b, non_blocking=True)
        s2.synchronize()

    def both():
        with torch.cuda.stream(s1):
            h_a.copy_(d_src, non_blocking=True)
        with torch.cuda.stream(s2):
            d_dst.copy_(h_b, non_blocking=True)
        s1.synchronize()
        s2.synchronize()

    yard = {"d2h": gb / _median_s(d2h, repeat), "h2d": gb / _median_s(h2d, repeat),
            "both": 2 * gb / _median_s(both, repeat)}
    out["pinned_copy_gbps"] = yard
    rows.append(["torch pinned copy_", "contiguous", f"{yard['d2h']:.1f}", f"{yard['h2d']:.1f}",
                 f"{yard['both']:.1f}", "1.00 / 1.00 / 1.00"])
    del d_dst, h_a, h_b
    torch.cuda.empty_cache()

    for label, bb in SIZES:
        n = batch_bytes // bb
        pool = torch.empty(2 * n * bb, dtype=torch.uint8, device=dev).view(2 * n, bb)
        pool.random_(0, 255)
        rng = np.random.default_rng(1)
        perm = rng.permutation(2 * n)
        ids_out, ids_in = perm[:n].tolist(), perm[n:].tolist()
        res = {}
        try:
            # -- the copier on its own ------------------------------------------------------------
            host = HostStore(2 * n * bb, 0, cuda_device=0)
            slots_a = np.asarray(host.alloc_many(bb, n), np.int64)
            slots_b = np.asarray(host.alloc_many(bb, n), np.int64)
            cp = CudaCopier(0)
            ids_o, ids_i = np.asarray(ids_out, np.int64), np.asarray(ids_in, np.int64)
            res["copier_d2h"] = gb / _median_s(lambda: cp.to_host(pool, ids_o, host.buf, slots_a).synchronize(),
                                               repeat)
            res["copier_h2d"] = gb / _median_s(lambda: cp.to_device(pool, ids_i, host.buf, slots_b).synchronize(),
                                               repeat)

            def copier_both():
                e1 = cp.to_host(pool, ids_o, host.buf, slots_a)
                e2 = cp.to_device(pool, ids_i, host.buf, slots_b)
                e1.synchronize()
                e2.synchronize()

            res["copier_both"] = 2 * gb / _median_s(copier_both, repeat)
            # byte-exact round trip through the copier
            cp.to_host(pool, ids_o[:64], host.buf, slots_a[:64]).synchronize()
            cp.to_device(pool, ids_i[:64], host.buf, slots_a[:64]).synchronize()
            ok = bool(torch.equal(pool[ids_o[:64]], pool[ids_i[:64]]))
            res["round_trip_exact"] = ok
            host.close()
            del host, slots_a, slots_b
            rows.append([f"copier {label}", f"{n} blocks", f"{res['copier_d2h']:.1f}", f"{res['copier_h2d']:.1f}",
                         f"{res['copier_both']:.1f}",
                         f"{res['copier_d2h'] / yard['d2h']:.2f} / {res['copier_h2d'] / yard['h2d']:.2f} / "
                         f"{res['copier_both'] / yard['both']:.2f}"])
        except Exception:  # noqa: BLE001 - report and go on with the other measurements
            traceback.print_exc()
            res["copier_error"] = traceback.format_exc(limit=3)
        try:
            eng = TransferEngine(host_bytes=2 * n * bb, cuda_device=0, staging_bytes=0, **_ENGINE_OPTS)
            eng.add_class(0, bb, pool)
            t = engine_times(eng, ids_out, ids_in, bb, repeat)
            res["engine_d2h"], res["engine_h2d"], res["engine_both"] = gb / t["d2h"], gb / t["h2d"], 2 * gb / t["both"]
            eng.close()
            rows.append([f"engine {label}", "demote / promote", f"{res['engine_d2h']:.1f}",
                         f"{res['engine_h2d']:.1f}", f"{res['engine_both']:.1f}",
                         f"{res['engine_d2h'] / yard['d2h']:.2f} / {res['engine_h2d'] / yard['h2d']:.2f} / "
                         f"{res['engine_both'] / yard['both']:.2f}"])
        except Exception:  # noqa: BLE001
            traceback.print_exc()
            res["engine_error"] = traceback.format_exc(limit=3)
        if bb < MiB:
            # -- one copy_ per block (what the staging avoids), on 4096 blocks ---------------------
            k = min(n, 4096)
            hp = torch.empty(k * bb, dtype=torch.uint8, pin_memory=True).view(k, bb)
            s = torch.cuda.Stream(dev)

            def per_block():
                with torch.cuda.stream(s):
                    for i in range(k):
                        hp[i].copy_(pool[ids_out[i]], non_blocking=True)
                s.synchronize()

            res["per_block_d2h"] = k * bb / 1e9 / _median_s(per_block, repeat)
            rows.append([f"per-block copy_ {label}", f"{k} blocks", f"{res['per_block_d2h']:.1f}", "", "",
                         f"{res['per_block_d2h'] / yard['d2h']:.2f}"])
            del hp
        out[label] = res
        del pool
        torch.cuda.empty_cache()
    return rows, out


# --------------------------------------------------------------------------------------------- disk

def _dd(args: list[str]) -> float:
    t0 = time.perf_counter()
    subprocess.run(["dd", *args], check=True, capture_output=True)
    return time.perf_counter() - t0


def bench_disk(directory: str, total: int, repeat: int = 3) -> tuple[list, dict]:
    """``DiskStore`` against ``dd`` on the same file system, made fair:

    * the same bytes and block size: ``dd`` writes ``total`` bytes in blocks of the store's size, and
      reads back, with ``iflag=direct`` and the same block size, the store's own data file, i.e. exactly
      the bytes the store reads;
    * O_DIRECT on both sides (the store's descriptor, ``oflag``/``iflag=direct``), so the page cache is
      out of both (the JSON says whether the store could open its file with O_DIRECT), and the data
      file's cached pages are dropped (``posix_fadvise(DONTNEED)``) before every read all the same;
    * the store's buffers are touched before the clock starts (``dd`` reuses one buffer; a first touch
      of fresh memory is not disk time);
    * one warm-up round, then ``repeat`` rounds, each running dd and the store back to back, the order
      alternating between rounds; each figure is the median of its rounds.
    """
    from kvpoold.transfer.disk import DiskStore
    from kvpoold.transfer.host import aligned_empty

    rows, out = [], {"directory": directory, "repeat": repeat}
    for label, bb in SIZES:
        n = total // bb
        res: dict = {}
        samples: dict[str, list] = {"dd_write": [], "dd_read": [], "write": [], "read": []}
        ok = {"writes_ok": True, "all_checksums_ok": True}
        os.makedirs(directory, exist_ok=True)
        work = tempfile.mkdtemp(prefix="kvpool-bench-", dir=directory)
        try:
            raw = os.path.join(work, "dd.bin")
            bs = f"{bb // 1024}K"
            q: queue.SimpleQueue = queue.SimpleQueue()
            store = DiskStore(os.path.join(work, "tier"), total, post=q.put)
            gid = store.layout_id({"block_bytes": bb, "bench": label})
            store.bind(0, gid)
            f = store.files[gid]
            out["o_direct"] = f.dfd is not None
            src = aligned_empty(min(total, 256 * MiB))
            src[:] = np.random.default_rng(0).integers(0, 256, src.size, dtype=np.uint8)
            per = src.size // bb
            dst = aligned_empty(min(total, 256 * MiB))
            dst[:] = 1  # committed before the clock starts
            done: list = []

            def run(count: int) -> None:  # run completions until ``count`` blocks reported
                while len(done) < count:
                    q.get()()

            def store_write(base: int) -> float:
                done.clear()
                t0 = time.perf_counter()
                for i in range(n):
                    store.write((0, base + i), src[(i % per) * bb:(i % per + 1) * bb], bb,
                                lambda good, key: done.append(good))
                store.flush()
                run(n)
                t = time.perf_counter() - t0
                ok["writes_ok"] &= all(done)
                return t

            def drop_cache() -> None:  # no-op under O_DIRECT; without it, reads come from the disk all the same
                os.fdatasync(f.fd)
                os.posix_fadvise(f.fd, 0, 0, os.POSIX_FADV_DONTNEED)

            def store_read(base: int) -> float:
                drop_cache()
                done.clear()
                t0 = time.perf_counter()
                for i in range(n):
                    store.read((0, base + i), dst[(i % per) * bb:(i % per + 1) * bb],
                               lambda good, corrupt: done.append(good))
                store.flush()
                run(n)
                t = time.perf_counter() - t0
                ok["all_checksums_ok"] &= all(done)
                return t

            def dd_write() -> float:
                return _dd(["if=/dev/zero", f"of={raw}", f"bs={bs}", f"count={n}", "oflag=direct", "conv=notrunc"])

            def dd_read() -> float:  # the store's data file: the blocks just written, slot after slot
                drop_cache()
                return _dd([f"if={f.path}", "of=/dev/null", f"bs={bs}", f"count={n}", "iflag=direct"])

            for r in range(repeat + 1):
                base = r * n
                try:
                    if r % 2:
                        w = [("write", lambda: store_write(base)), ("dd_write", dd_write)]
                        rd = [("read", lambda: store_read(base)), ("dd_read", dd_read)]
                    else:
                        w = [("dd_write", dd_write), ("write", lambda: store_write(base))]
                        rd = [("dd_read", dd_read), ("read", lambda: store_read(base))]
                    for name, fn in w + rd:  # the store's blocks are written before anything reads them
                        t = fn()
                        if r:  # round 0 warms up
                            samples[name].append(t)
                except (subprocess.CalledProcessError, FileNotFoundError) as exc:
                    res["dd_error"] = str(exc)  # e.g. a file system without O_DIRECT
                    break
            for name, v in samples.items():
                if v:
                    res[f"{name}_gbps"] = total / 1e9 / statistics.median(v)
                    res[f"{name}_gbps_all"] = [total / 1e9 / x for x in v]
            res.update(ok)
            store.drain()
            store.close()
        except Exception:  # noqa: BLE001
            traceback.print_exc()
            res["error"] = traceback.format_exc(limit=3)
        finally:
            shutil.rmtree(work, ignore_errors=True)
        out[label] = res
        fw = res.get("write_gbps", 0) / res["dd_write_gbps"] if res.get("dd_write_gbps") else float("nan")
        fr = res.get("read_gbps", 0) / res["dd_read_gbps"] if res.get("dd_read_gbps") else float("nan")
        rows.append([f"disk {label}", f"{n} blocks", f"{res.get('write_gbps', 0):.2f}", f"{res.get('read_gbps', 0):.2f}",
                     f"{res.get('dd_write_gbps', 0):.2f} / {res.get('dd_read_gbps', 0):.2f}", f"{fw:.2f} / {fr:.2f}"])
    return rows, out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch-gib", type=float, default=1.0, help="bytes per GPU batch (default 1 GiB)")
    ap.add_argument("--disk-gib", type=float, default=1.0, help="bytes per disk run (default 1 GiB)")
    ap.add_argument("--disk-dir", default=str(Path(__file__).resolve().parent / ".scratch"),
                    help="where to measure the disk (default benchmarks/.scratch, git-ignored: the repository's "
                         "file system); the files are removed afterwards")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--skip-gpu", action="store_true")
    ap.add_argument("--skip-disk", action="store_true")
    ap.add_argument("--cpu-engine", action="store_true",
                    help="measure the engine's bookkeeping per block on the CPU (numpy copies for the device's); "
                         "runs anyway when there is no GPU")
    ap.add_argument("--pipeline-blocks", type=int, default=0,
                    help="the engine's pipeline_blocks (the pieces, in blocks, a host <-> device batch is copied "
                         "in; default: the engine's); a value larger than a batch copies each batch in one piece")
    ap.add_argument("--paced-gbps", type=float, default=52.0,
                    help="CPU engine mode: the rate per direction of the paced copier that stands for a GPU's "
                         "DMA (default 52, the H200's copier)")
    ap.add_argument("--cpu-blocks", default="2 MiB:512,32 KiB:32768",
                    help="the CPU engine mode's batches, 'size:blocks,...' (default: 2 MiB x 512, 32 KiB x 32768)")
    args = ap.parse_args()
    if args.pipeline_blocks:
        _ENGINE_OPTS["pipeline_blocks"] = args.pipeline_blocks
    payload: dict = {"engine_options": dict(_ENGINE_OPTS)}
    gpu = False
    if not args.skip_gpu:
        try:
            import torch

            gpu = torch.cuda.is_available()
        except ImportError:
            gpu = False
    if gpu:
        try:
            rows, payload["gpu"] = bench_gpu(int(args.batch_gib * GiB), args.repeat)
            print_table("GPU <-> pinned host, GB/s (fraction of torch pinned copy_: d2h / h2d / both)",
                        ["path", "batch", "GPU->host", "host->GPU", "both ways", "fraction"], rows)
        except Exception:  # noqa: BLE001
            traceback.print_exc()
            payload["gpu_error"] = traceback.format_exc(limit=5)
    if args.cpu_engine or not gpu:
        sizes = []
        for item in args.cpu_blocks.split(","):
            label, blocks = item.rsplit(":", 1)
            num, unit = label.split()
            sizes.append((label, int(num) * {"KiB": 1024, "MiB": MiB}[unit], int(blocks)))
        rows, payload["cpu_engine"] = bench_cpu_engine(args.repeat, sizes)
        print_table("engine path on the CPU (numpy copies for the device's), microseconds per block",
                    ["path", "blocks", "way", "total", "copies", "bookkeeping", "GB/s"], rows)
        rows, payload["paced_engine"] = bench_paced_engine(args.repeat, sizes, args.paced_gbps)
        print_table(f"engine against a paced copier ({args.paced_gbps:g} GB/s per direction, no bytes move)",
                    ["path", "blocks", "way", "copier GB/s", "engine GB/s", "engine / copier",
                     "exposed us/block"], rows)
    if not args.skip_disk:
        rows, payload["disk"] = bench_disk(args.disk_dir, int(args.disk_gib * GiB), args.repeat)
        print_table(f"disk tier in {args.disk_dir}, GB/s (dd with O_DIRECT as the yardstick)",
                    ["path", "blocks", "write", "read", "dd write / read", "fraction w / r"], rows)
    kind = "gpu" if gpu else "cpu"
    write_json(f"tiers_{kind}_{time.strftime('%Y%m%dT%H%M%S')}", payload)
    return 0


if __name__ == "__main__":
    sys.exit(main())
