"""Tier transfer bandwidth: GPU <-> pinned host, and the disk tier.

    python3 benchmarks/bench_tiers.py                  # everything this machine has
    python3 benchmarks/bench_tiers.py --skip-gpu --disk-gib 0.5

GPU (when CUDA is there), for batches of 2 MiB and of 32 KiB blocks at
random places in a device pool, 1 GiB per batch:

* ``torch pinned copy_``: the yardstick, one contiguous ``copy_`` of the same
  bytes between device memory and pinned host memory (each way, and both
  ways at once on two streams), measured in the same run;
* ``copier``: ``kvpoold.transfer.cuda.CudaCopier`` (one gather/scatter launch
  into device staging plus one DMA per run of host slots);
* ``engine``: ``TransferEngine.submit`` with demotion / promotion moves, the
  daemon's whole path including the bookkeeping of slots and arrivals;
* ``per-block copy_``: one ``copy_`` per block (what the copier avoids).

Disk (any machine): ``DiskStore`` writes and reads (checksums, O_DIRECT where
the file system allows it, 4 I/O threads) against ``dd`` with
``oflag=direct`` / ``iflag=direct`` of the same bytes and block size on the
same file system, in the same run.

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


def _median_s(fn, repeat: int = 5) -> float:
    fn()  # warm-up
    samples = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


# ---------------------------------------------------------------------------------------------- GPU

def bench_gpu(batch_bytes: int, repeat: int) -> tuple[list, dict]:
    import torch

    from kvpoold.core.tiers import Move, Tier
    from kvpoold.transfer.cuda import CudaCopier
    from kvpoold.transfer.engine import TransferEngine
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
            slots_a = [host.alloc(bb) for _ in range(n)]
            slots_b = [host.alloc(bb) for _ in range(n)]
            cp = CudaCopier(0)
            res["copier_d2h"] = gb / _median_s(lambda: cp.to_host(pool, ids_out, host.tensor, slots_a).synchronize(),
                                               repeat)
            res["copier_h2d"] = gb / _median_s(lambda: cp.to_device(pool, ids_in, host.tensor, slots_b).synchronize(),
                                               repeat)

            def copier_both():
                e1 = cp.to_host(pool, ids_out, host.tensor, slots_a)
                e2 = cp.to_device(pool, ids_in, host.tensor, slots_b)
                e1.synchronize()
                e2.synchronize()

            res["copier_both"] = 2 * gb / _median_s(copier_both, repeat)
            # byte-exact round trip through the copier
            cp.to_host(pool, ids_out[:64], host.tensor, slots_a[:64]).synchronize()
            cp.to_device(pool, ids_in[:64], host.tensor, slots_a[:64]).synchronize()
            ok = bool(torch.equal(pool[ids_out[:64]], pool[ids_in[:64]]))
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
            # -- the engine: demotions then promotions of the whole batch ------------------------------
            eng = TransferEngine(host_bytes=n * bb, cuda_device=0, staging_bytes=0)
            eng.add_class(0, bb, pool)
            counter = [0]

            def demote():
                base = counter[0]
                eng.submit([Move((0, base + i), Tier.DEVICE, Tier.HOST, b, bb) for i, b in enumerate(ids_out)])

            def promote():
                base = counter[0]
                arrivals = eng.submit([Move((0, base + i), Tier.HOST, Tier.DEVICE, b, bb)
                                       for i, b in enumerate(ids_in)])
                assert eng.wait(arrivals) and all(a.ok for a in arrivals)
                counter[0] += n

            def cycle_s():
                t0 = time.perf_counter()
                demote()
                t1 = time.perf_counter()
                promote()
                return t1 - t0, time.perf_counter() - t1

            cycle_s()
            times = [cycle_s() for _ in range(repeat)]
            res["engine_d2h"] = gb / statistics.median(t[0] for t in times)
            res["engine_h2d"] = gb / statistics.median(t[1] for t in times)
            eng.close()
            rows.append([f"engine {label}", "demote / promote", f"{res['engine_d2h']:.1f}",
                         f"{res['engine_h2d']:.1f}", "",
                         f"{res['engine_d2h'] / yard['d2h']:.2f} / {res['engine_h2d'] / yard['h2d']:.2f}"])
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


def bench_disk(directory: str, total: int) -> tuple[list, dict]:
    from kvpoold.transfer.disk import DiskStore
    from kvpoold.transfer.host import aligned_empty

    rows, out = [], {"directory": directory}
    for label, bb in SIZES:
        n = total // bb
        res = {}
        os.makedirs(directory, exist_ok=True)
        work = tempfile.mkdtemp(prefix="kvpool-bench-", dir=directory)
        try:
            raw = os.path.join(work, "dd.bin")
            bs = f"{bb // 1024}K"
            try:
                res["dd_write_gbps"] = total / 1e9 / _dd([f"if=/dev/zero", f"of={raw}", f"bs={bs}", f"count={n}",
                                                          "oflag=direct"])
                res["dd_read_gbps"] = total / 1e9 / _dd([f"if={raw}", "of=/dev/null", f"bs={bs}", "iflag=direct"])
            except (subprocess.CalledProcessError, FileNotFoundError) as exc:
                res["dd_error"] = str(exc)  # e.g. a file system without O_DIRECT
            os.unlink(raw) if os.path.exists(raw) else None
            q: queue.SimpleQueue = queue.SimpleQueue()
            store = DiskStore(os.path.join(work, "tier"), total, post=q.put)
            gid = store.layout_id({"block_bytes": bb, "bench": label})
            store.bind(0, gid)
            out["o_direct"] = store.files[gid].dfd is not None
            src = aligned_empty(min(total, 256 * MiB))
            src[:] = np.random.default_rng(0).integers(0, 256, src.size, dtype=np.uint8)
            per = src.size // bb
            dst = aligned_empty(min(total, 256 * MiB))

            done: list = []

            def run(count: int) -> None:  # run completions until ``count`` blocks reported
                while len(done) < count:
                    q.get()()

            t0 = time.perf_counter()
            for i in range(n):
                store.write((0, i), src[(i % per) * bb:(i % per + 1) * bb], bb, lambda ok, key: done.append(ok))
            store.flush()
            run(n)
            res["writes_ok"] = all(done)
            done.clear()
            res["write_gbps"] = total / 1e9 / (time.perf_counter() - t0)
            t0 = time.perf_counter()
            for i in range(n):
                store.read((0, i), dst[(i % per) * bb:(i % per + 1) * bb], lambda ok, corrupt: done.append(ok))
            store.flush()
            run(n)
            res["read_gbps"] = total / 1e9 / (time.perf_counter() - t0)
            res["all_checksums_ok"] = all(done)
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
    args = ap.parse_args()
    payload: dict = {}
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
    if not args.skip_disk:
        rows, payload["disk"] = bench_disk(args.disk_dir, int(args.disk_gib * GiB))
        print_table(f"disk tier in {args.disk_dir}, GB/s (dd with O_DIRECT as the yardstick)",
                    ["path", "blocks", "write", "read", "dd write / read", "fraction w / r"], rows)
    kind = "gpu" if gpu else "cpu"
    write_json(f"tiers_{kind}_{time.strftime('%Y%m%dT%H%M%S')}", payload)
    return 0


if __name__ == "__main__":
    sys.exit(main())
