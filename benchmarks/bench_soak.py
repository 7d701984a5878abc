"""Soak: hundreds of thousands of RPCs against one daemon; its memory must stay flat.

Several client processes each repeat a round of sequence calls through the raw
stub (every call reaches the daemon; the client's reserve is not used):

  Create 16 prompts (varied lengths, a shared prefix)    1 RPC,  16 sequence ops
  Fork 4 of them                                         1 RPC,   4 ops
  6 x Step: every one of the 20 sequences gets 1 token   6 RPCs, 120 ops
  Step freeing all 20                                    1 RPC,  20 ops

so 9 RPCs carry 160 sequence operations.  The parent samples the daemon's RSS
(psutil) once a second against the RPCs done so far.  Reported: throughput,
p50/p99 latency per call kind and overall, RSS at start, after the warm-up (25%
of the calls: by then the prefix cache has filled the pool, whose hash index is
the one structure allowed to grow, bounded by the pool's size), at 50% and at the end.  At the end the self-check must pass and no block
may be used.

  python3 benchmarks/bench_soak.py                 # 4 clients, >= 200,000 RPCs
  python3 benchmarks/bench_soak.py --rpcs 20000    # a quick run
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from _common import percentiles, print_table, write_json  # noqa: E402

LAYOUT_ARGS = dict(model_id="soak", num_layers=1, num_kv_heads=1, head_dim=16, dtype="float16", block_size=16)
RPCS_PER_ROUND, OPS_PER_ROUND = 9, 160


def worker(socket: str, rounds: int, seed: int, progress, barrier, out_q) -> None:
    import kvpool
    from kvpool.protocol import kvpool_pb2 as pb

    rng = np.random.default_rng(seed)
    layout = kvpool.Layout(**LAYOUT_ARGS)
    lat: dict[str, list[int]] = {"Create": [], "Fork": [], "Step": [], "Free": []}
    shared = np.arange(5000, 5048, dtype="<u4")
    with kvpool.connect(socket, name=f"soak-{seed}", layout=layout) as c:
        stub, tok = c._conn._stub, c._token
        barrier.wait()
        t_start = time.perf_counter()
        for r in range(rounds):
            prompts = []
            for i in range(16):
                n = int(rng.integers(4, 80))
                own = rng.integers(0, 32000, n, dtype=np.uint32).astype("<u4")
                toks = np.concatenate([shared[: int(rng.integers(0, 48))], own]) if i % 2 else own
                prompts.append(pb.Prompt(tokens=toks.tobytes()))
            t0 = time.perf_counter_ns()
            rep = stub.Create(pb.CreateRequest(session=tok, prompts=prompts))
            t1 = time.perf_counter_ns()
            lat["Create"].append(t1 - t0)
            ids = [s.seq_id for s in rep.sequences]
            t0 = time.perf_counter_ns()
            rep = stub.Fork(pb.ForkRequest(session=tok, seq_ids=ids[:4]))
            t1 = time.perf_counter_ns()
            lat["Fork"].append(t1 - t0)
            ids += [s.seq_id for s in rep.sequences]
            packed = np.array(ids, "<i8").tobytes()
            for k in range(6):
                t0 = time.perf_counter_ns()
                stub.Step(pb.StepRequest(session=tok, seq_ids=packed,
                                         tokens=np.full(len(ids), (r + k) % 32000, "<u4").tobytes()))
                lat["Step"].append(time.perf_counter_ns() - t0)
            t0 = time.perf_counter_ns()
            stub.Step(pb.StepRequest(session=tok, free_seq_ids=ids))
            lat["Free"].append(time.perf_counter_ns() - t0)
            with progress.get_lock():
                progress.value += RPCS_PER_ROUND
        wall = time.perf_counter() - t_start
    out_q.put({"lat": {k: np.array(v, np.int64) for k, v in lat.items()}, "wall_s": wall})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--rpcs", type=int, default=200_000, help="at least this many RPCs in all")
    ap.add_argument("--pool-bytes", default="32MiB",
                    help="the prefix cache fills the pool within the warm-up, so the plateau is reached early")
    args = ap.parse_args()
    import psutil

    import kvpool
    from conftest import Daemon

    rounds = -(-args.rpcs // (RPCS_PER_ROUND * args.clients))
    d = Daemon("--pool-bytes", args.pool_bytes, "--chunk-bytes", "2MiB", "--log-level", "warning").start()
    daemon = psutil.Process(d.proc.pid)
    ctx = mp.get_context("spawn")
    progress = ctx.Value("q", 0)
    barrier = ctx.Barrier(args.clients + 1)
    q = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(d.socket, rounds, 17 + i, progress, barrier, q))
             for i in range(args.clients)]
    samples: list[tuple[float, int, int]] = []  # (seconds, rpcs done, daemon rss)
    try:
        for p in procs:
            p.start()
        barrier.wait()
        t0 = time.perf_counter()
        rss_start = daemon.memory_info().rss
        samples.append((0.0, 0, rss_start))
        results = []
        while len(results) < len(procs):
            try:
                results.append(q.get(timeout=1.0))
            except Exception:  # noqa: BLE001 - queue.Empty: sample and wait on
                pass
            samples.append((time.perf_counter() - t0, progress.value, daemon.memory_info().rss))
        wall = time.perf_counter() - t0
        for p in procs:
            p.join()
        rss_end = daemon.memory_info().rss
        with kvpool.Connection(d.socket) as conn:
            ok, detail = conn.check()
            st = conn.stats()
            used = sum(c.used_blocks + c.reserved_blocks for c in st.classes)
            cached = sum(c.cached_blocks for c in st.classes)
            total_blocks = sum(c.total_blocks for c in st.classes)
    finally:
        d.stop()
    total_rpcs = rounds * RPCS_PER_ROUND * args.clients
    total_ops = rounds * OPS_PER_ROUND * args.clients
    lat = {k: np.concatenate([r["lat"][k] for r in results]).tolist() for k in ("Create", "Fork", "Step", "Free")}
    everything = [x for v in lat.values() for x in v]
    warm = next((s for s in samples if s[1] >= total_rpcs // 4), samples[-1])  # the cache is full by then
    half = next((s for s in samples if s[1] >= total_rpcs // 2), samples[-1])
    rows = {k: percentiles(v) for k, v in lat.items()}
    rows["all"] = percentiles(everything)
    res = {
        "clients": args.clients, "rounds_per_client": rounds, "rpcs": total_rpcs, "sequence_ops": total_ops,
        "wall_s": wall, "rpcs_per_s": total_rpcs / wall, "sequence_ops_per_s": total_ops / wall,
        "latency": rows,
        "rss_start_mib": rss_start / 2**20, "rss_after_warmup_mib": warm[2] / 2**20, "rss_at_half_mib": half[2] / 2**20, "rss_end_mib": rss_end / 2**20,
        "rss_max_mib": max(s[2] for s in samples) / 2**20,
        "rss_growth_after_warmup_mib": (rss_end - warm[2]) / 2**20,
        "rss_growth_second_half_mib": (rss_end - half[2]) / 2**20,
        "pool_bytes": args.pool_bytes, "pool_blocks": total_blocks, "cached_blocks_at_end": cached,
        "rss_samples": [(round(s[0], 1), s[1], round(s[2] / 2**20, 1)) for s in samples[:: max(1, len(samples) // 40)]],
        "check_ok": ok, "check_detail": detail, "used_blocks_at_end": used,
    }
    print_table(
        f"soak: {args.clients} clients, {total_rpcs} RPCs carrying {total_ops} sequence operations, {wall:.0f} s",
        ["call", "count", "p50 us", "p99 us", "mean us"],
        [[k, len(lat[k]) if k != "all" else len(everything), f"{v['p50_us']:.0f}", f"{v['p99_us']:.0f}",
          f"{v['mean_us']:.0f}"] for k, v in rows.items()],
    )
    print_table(
        "throughput and daemon memory",
        ["RPCs/s", "seq ops/s", "RSS start MiB", "RSS at 25% MiB", "RSS at 50% MiB", "RSS end MiB",
         "RSS max MiB", "growth after 25% MiB", "check", "used / cached / pool blocks at end"],
        [[f"{res['rpcs_per_s']:.0f}", f"{res['sequence_ops_per_s']:.0f}", f"{res['rss_start_mib']:.1f}",
          f"{res['rss_after_warmup_mib']:.1f}", f"{res['rss_at_half_mib']:.1f}", f"{res['rss_end_mib']:.1f}",
          f"{res['rss_max_mib']:.1f}", f"{res['rss_growth_after_warmup_mib']:+.1f}", "ok" if ok else detail,
          f"{used} / {cached} / {total_blocks}"]],
    )
    write_json("soak", res)
    if not ok or used:
        sys.exit(1)


if __name__ == "__main__":
    main()
