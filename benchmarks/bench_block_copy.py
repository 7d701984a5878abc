"""Block-copy bandwidth and pool attach time, against a plain copy of the same bytes.

GPU (when CUDA + CuPy are there): ``copy_blocks`` on random (src, dst) pairs of
2 MiB and 32 KiB blocks, bandwidth = (bytes read + bytes written) / time
(CUDA events, median after warm-up), as a fraction of ``torch`` copying the
same total bytes device-to-device in the same run (target: >= 0.85 for 2 MiB
blocks).  Then a client's attach time measured in a second process: open the
IPC handle + make the tensor.

CPU (always runnable, e.g. in CI): the same on a shared-memory pool, with
``numpy.copyto`` of the same bytes as the yardstick, and the attach time of a
shared-memory mapping.

    python benchmarks/bench_block_copy.py            # auto: GPU if there, else CPU
    python benchmarks/bench_block_copy.py --device cpu --quick
    python benchmarks/bench_block_copy.py --sweep    # GPU: also try kernel variants

Prints a table; writes JSON to benchmarks/results/.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import statistics
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from kvpool.kernels.block_copy import copy_blocks, gather_blocks  # noqa: E402

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30


def pairs_for(num_blocks: int, p: int, seed: int = 0) -> torch.Tensor:
    perm = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed))
    return torch.stack([perm[p:2 * p], perm[:p]], 1)  # src and dst disjoint


# ----------------------------------------------------------------------------- GPU

def gpu_time(fn, reps: int = 20, inner: int = 5, warmup: int = 3) -> float:
    """Median seconds per call; ``inner`` calls back to back keep the GPU busy."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(inner):
            fn()
        b.record()
        times.append((a, b))
    torch.cuda.synchronize()
    return statistics.median(a.elapsed_time(b) / 1e3 / inner for a, b in times)


def gpu_case(block: int, pool_bytes: int, copy_bytes: int, **tune) -> dict:
    n, p = pool_bytes // block, copy_bytes // block
    pool = torch.empty(n, block, dtype=torch.uint8, device="cuda")
    pool.random_(0, 256)
    pairs = pairs_for(n, p).cuda()
    t_k = gpu_time(lambda: copy_blocks(pool, pairs, check=False, **tune))
    src = torch.empty(p * block, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    t_ref = gpu_time(lambda: dst.copy_(src))
    out = torch.empty(p, block, dtype=torch.uint8, device="cuda")
    ids = pairs[:, 0].contiguous()
    t_g = gpu_time(lambda: gather_blocks(pool, ids, out, check=False, **tune))
    moved = 2 * p * block
    return {
        "block_bytes": block, "pairs": p, "bytes_moved": moved,
        "copy_blocks_s": t_k, "copy_blocks_GBps": moved / t_k / 1e9,
        "gather_blocks_GBps": moved / t_g / 1e9,
        "torch_copy_s": t_ref, "torch_copy_GBps": moved / t_ref / 1e9,
        "fraction_of_torch_copy": t_ref / t_k,
    }


def gpu_small_batch(block: int, p: int) -> dict:
    """One small (copy-on-write sized) batch: host cost of the call, and call + sync.

    ``host_list``: pairs as a Python list (as an RPC reply gives them), checked;
    ``device``: pairs already an int64 CUDA tensor, ``check=False``.
    """
    n = 4 * p
    pool = torch.zeros(n, block, dtype=torch.uint8, device="cuda")
    as_list = pairs_for(n, p).tolist()
    on_dev = pairs_for(n, p).cuda()
    row = {"block_bytes": block, "pairs": p}
    for name, fn in (("host_list", lambda: copy_blocks(pool, as_list)),
                     ("device", lambda: copy_blocks(pool, on_dev, check=False))):
        for _ in range(5):
            fn()
        torch.cuda.synchronize()
        call, total = [], []
        for _ in range(50):
            t0 = time.perf_counter()
            fn()
            t1 = time.perf_counter()
            torch.cuda.synchronize()
            call.append(t1 - t0)
            total.append(time.perf_counter() - t0)
        row[f"{name}_call_us"] = statistics.median(call) * 1e6
        row[f"{name}_call_plus_sync_us"] = statistics.median(total) * 1e6
    return row


def profile_small_batch(block: int = 2 * MiB, p: int = 16, calls: int = 300) -> dict:
    """Where the host time of a small batch goes (cProfile, top functions by own time)."""
    import cProfile
    import io
    import pstats

    n = 4 * p
    pool = torch.zeros(n, block, dtype=torch.uint8, device="cuda")
    as_list = pairs_for(n, p).tolist()
    on_dev = pairs_for(n, p).cuda()
    out = {}
    for name, fn in (("host_list", lambda: copy_blocks(pool, as_list)),
                     ("device", lambda: copy_blocks(pool, on_dev, check=False))):
        fn()
        torch.cuda.synchronize()
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(calls):
            fn()
        prof.disable()
        torch.cuda.synchronize()
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(14)
        out[name] = buf.getvalue()
    return out


def sweep(block: int, pool_bytes: int, copy_bytes: int) -> list[dict]:
    rows = []
    n, p = pool_bytes // block, copy_bytes // block
    pool = torch.empty(n, block, dtype=torch.uint8, device="cuda")
    pairs = pairs_for(n, p).cuda()
    src = torch.empty(p * block, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    t_ref = gpu_time(lambda: dst.copy_(src))
    for kernel in ["kvpool_copy_v16_u4", "kvpool_copy_v16_u4_cg", "kvpool_copy_v16_u8_cg",
                   "kvpool_copy_v16_u4_cs", "kvpool_copy_v16_u8_cs"]:
        for threads in (256, 512):
            for chunk in (32 * KiB, 64 * KiB, 128 * KiB):
                for ctas in (4, 8):
                    if chunk > block and chunk != 32 * KiB:
                        continue
                    tune = dict(kernel=kernel, threads=threads, chunk=chunk, ctas_per_sm=ctas)
                    t = gpu_time(lambda: copy_blocks(pool, pairs, check=False, **tune), reps=10, inner=3)
                    rows.append({**tune, "block_bytes": block, "fraction_of_torch_copy": t_ref / t,
                                 "GBps": 2 * p * block / t / 1e9})
    rows.sort(key=lambda r: -r["fraction_of_torch_copy"])
    return rows


_ATTACH_CHILD = """
import json, os, statistics, sys, time
t0 = time.perf_counter()
import torch
from kvpool.ipc import open_arena
from kvpool.protocol import ArenaDescriptor
d = {k: bytes.fromhex(v[4:]) if isinstance(v, str) and v.startswith("hex:") else v
     for k, v in json.loads(sys.argv[1]).items()}
desc = ArenaDescriptor(**d)
gpu = desc.kind == "cuda"
if gpu:
    import cupy
    torch.cuda.init(); torch.zeros(1, device="cuda"); cupy.cuda.Device(0).use()
t1 = time.perf_counter()
shape = (desc.nbytes // (2 << 20), 32, 2, 8, 16, 128)
times = []
for i in range(20):
    s = time.perf_counter()
    m = open_arena(desc, fd=os.dup(int(sys.argv[2])) if desc.kind == "memfd" else None)
    x = m.as_tensor("bfloat16", shape)
    x[0, 0, 0, 0, 0, 0] = 1
    if gpu:
        torch.cuda.synchronize()
    times.append(time.perf_counter() - s)
    del x
    m.close()
print(json.dumps({"process_start_and_runtime_init_s": t1 - t0, "first_attach_ms": times[0] * 1e3,
                  "attach_median_ms": statistics.median(times[1:]) * 1e3}))
"""


def attach_time(descriptor, fd: int = -1) -> dict:
    """A child maps the arena 20 times (``fd``: a CPU arena's memfd, inherited; each mapping its own copy)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    d = {k: "hex:" + v.hex() if isinstance(v, bytes) else v for k, v in descriptor.to_dict().items()}
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(_ATTACH_CHILD), json.dumps(d), str(fd)],
                         env=env, capture_output=True, text=True, timeout=300, pass_fds=(fd,) if fd >= 0 else ())
    if out.returncode:
        return {"error": out.stderr[-2000:]}
    return json.loads(out.stdout.strip().splitlines()[-1])


def run_gpu(args) -> dict:
    from kvpoold.memory.cuda_ipc import CudaBackend

    pool = 4 * GiB if not args.quick else 512 * MiB
    copy = 1 * GiB if not args.quick else 128 * MiB
    res = {"device": torch.cuda.get_device_name(0), "cases": [], "small_batches": []}
    for block in (2 * MiB, 32 * KiB):
        res["cases"].append(gpu_case(block, pool, copy))
        torch.cuda.empty_cache()
    for block, p in ((2 * MiB, 16), (32 * KiB, 64)):
        res["small_batches"].append(gpu_small_batch(block, p))
    if args.profile:
        res["profile"] = profile_small_batch()
    if args.sweep:
        res["sweep"] = {}
        for b in (2 * MiB, 32 * KiB):
            res["sweep"][str(b)] = sweep(b, pool, copy)
            torch.cuda.empty_cache()
    backend = CudaBackend(0)
    arena = backend.create_arena("bench", 1 * GiB)
    res["attach"] = attach_time(arena.descriptor)
    backend.close()
    return res


# ----------------------------------------------------------------------------- CPU

def cpu_time(fn, reps: int = 10, warmup: int = 2) -> float:
    for _ in range(warmup):
        fn()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def run_cpu(args) -> dict:
    from kvpoold.memory.cpu_shm import CpuShmBackend

    inst = f"bench{os.getpid()}"
    backend = CpuShmBackend(inst)
    pool_bytes = 256 * MiB if args.quick else 1 * GiB
    copy = 32 * MiB if args.quick else 128 * MiB
    res = {"device": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
           "cases": []}
    try:
        arena = backend.create_arena("bench", pool_bytes)
        arena.commit(0, pool_bytes)
        for block in (2 * MiB, 32 * KiB):
            n, p = pool_bytes // block, copy // block
            pool = arena.as_tensor("uint8", (n, block))
            pool.fill_(3)
            pairs = pairs_for(n, p)
            t_k = cpu_time(lambda: copy_blocks(pool, pairs, check=False))
            staging = torch.empty(p, block, dtype=torch.uint8)
            t_g = cpu_time(lambda: gather_blocks(pool, pairs[:, 0], staging, check=False))
            a = np.ones(p * block, np.uint8)
            b = np.empty_like(a)
            t_ref = cpu_time(lambda: np.copyto(b, a))
            moved = 2 * p * block
            res["cases"].append({
                "block_bytes": block, "pairs": p, "bytes_moved": moved,
                "copy_blocks_s": t_k, "copy_blocks_GBps": moved / t_k / 1e9,
                "gather_blocks_GBps": moved / t_g / 1e9,
                "numpy_copy_s": t_ref, "numpy_copy_GBps": moved / t_ref / 1e9,
                "fraction_of_numpy_copy": t_ref / t_k,
            })
        res["attach"] = attach_time(arena.descriptor, arena.fileno())
    finally:
        backend.close()
    return res


# ----------------------------------------------------------------------------- main

def _gpu_ok() -> bool:
    try:
        import cupy  # noqa: F401
    except ImportError:
        return False
    return torch.cuda.is_available()


def print_table(res: dict) -> None:
    ref = "torch_copy" if res["kind"] == "gpu" else "numpy_copy"
    print(f"\nblock copy on {res['device']} ({res['kind']}, {res['date']})")
    print(f"{'block':>8} {'pairs':>7} {'copy_blocks GB/s':>17} {'gather GB/s':>12} {ref + ' GB/s':>17} {'fraction':>9}")
    for c in res["cases"]:
        print(f"{c['block_bytes'] // KiB:>6}Ki {c['pairs']:>7} {c['copy_blocks_GBps']:>17.1f} "
              f"{c.get('gather_blocks_GBps', float('nan')):>12.1f} {c[ref + '_GBps']:>17.1f} "
              f"{c['fraction_of_' + ref]:>9.3f}")
    for s in res.get("small_batches", []):
        print(f"small batch {s['pairs']} x {s['block_bytes'] // KiB} KiB: host call {s['host_list_call_us']:.0f} us "
              f"(+sync {s['host_list_call_plus_sync_us']:.0f}) from a checked list, "
              f"{s['device_call_us']:.0f} us (+sync {s['device_call_plus_sync_us']:.0f}) from device ids")
    a = res.get("attach", {})
    if "error" in a:
        print("attach: FAILED\n" + a["error"])
    elif a:
        print(f"attach (other process): first {a['first_attach_ms']:.2f} ms, then median "
              f"{a['attach_median_ms']:.3f} ms; process start + runtime init {a['process_start_and_runtime_init_s']:.2f} s")
    for name, text in res.get("profile", {}).items():
        print(f"host profile, 300 calls, pairs from {name}:")
        print("\n".join(line for line in text.splitlines() if line.strip())[:3000])
    for b, rows in res.get("sweep", {}).items():
        print(f"sweep, {int(b) // KiB} KiB blocks, best 5:")
        for r in rows[:5]:
            print(f"  {r['kernel']:<24} threads={r['threads']:<4} chunk={r['chunk'] // KiB:>4}Ki "
                  f"ctas/SM={r['ctas_per_sm']}  {r['GBps']:.0f} GB/s  {r['fraction_of_torch_copy']:.3f}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=["auto", "cpu", "gpu"], default="auto")
    ap.add_argument("--quick", action="store_true", help="smaller sizes (CI)")
    ap.add_argument("--sweep", action="store_true", help="GPU: also time kernel variants")
    ap.add_argument("--profile", action="store_true", help="GPU: cProfile the host side of small batches")
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results"))
    args = ap.parse_args(argv)
    kind = args.device if args.device != "auto" else ("gpu" if _gpu_ok() else "cpu")
    res = run_gpu(args) if kind == "gpu" else run_cpu(args)
    now = dt.datetime.now(dt.timezone.utc)
    res.update(kind=kind, date=now.isoformat(timespec="seconds"), torch=torch.__version__,
               python=platform.python_version(), quick=args.quick)
    if kind == "gpu":
        import cupy

        res["cupy"] = cupy.__version__
    print_table(res)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    path = Path(args.out) / f"block_copy_{kind}_{now.strftime('%Y%m%dT%H%M%S')}.json"
    path.write_text(json.dumps(res, indent=1))
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
