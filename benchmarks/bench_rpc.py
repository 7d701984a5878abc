"""The daemon's hot path over its Unix socket, beside an empty round trip on the same socket.

    python3 benchmarks/bench_rpc.py [--iters 2000]

For 1 and 4 concurrent client processes, each with 256 sequences, it times
(interleaved, so that noise hits both alike):
* ``Ping``: an empty gRPC round trip to kvpoold (the yardstick);
* ``Step``: one call extending all 256 sequences by one token (every step
  through the daemon, the client's reserve bypassed: the worst case);
and then runs a steady decode through ``Client.extend`` (reserves on) and
counts decode steps per RPC.

Targets: Step p50 <= 1.3x Ping p50, p99 <= 3x Ping p99... measured
as p99 <= 3x Ping p50; at least 8 decode steps per RPC.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from _common import percentiles, print_table, write_json  # noqa: E402

# the bookkeeping cost does not depend on the block's bytes: small blocks keep the
# benchmark's shared memory small while it grows 256 sequences by thousands of tokens
LAYOUT_ARGS = dict(model_id="bench", num_layers=1, num_kv_heads=1, head_dim=16, dtype="float16", block_size=16)
BATCH = 256


def worker(socket: str, iters: int, decode_steps: int, barrier, out_q) -> None:
    import kvpool
    from kvpool.protocol import kvpool_pb2 as pb

    layout = kvpool.Layout(**LAYOUT_ARGS)
    with kvpool.connect(socket, name=f"bench-{os.getpid()}", layout=layout) as c:
        # varied prompt lengths, as in a real batch: about 1/16 of the sequences cross a
        # block boundary at each step (all of them every 16th step would be an artefact)
        seqs = c.create_sequences([[os.getpid() % 1000] * (20 + (i * 7) % 64) for i in range(BATCH)])
        ids = np.array([s.id for s in seqs], "<i8").tobytes()
        ping = pb.PingRequest()
        stub = c._conn._stub
        barrier.wait()
        pings, steps = [], []
        for i in range(iters):
            t0 = time.perf_counter_ns()
            stub.Ping(ping)
            t1 = time.perf_counter_ns()
            # no token_counts: one token each, the decode step's wire form
            stub.Step(pb.StepRequest(session=c._token, seq_ids=ids,
                                     tokens=np.full(BATCH, i % 30000, "<u4").tobytes()))
            t2 = time.perf_counter_ns()
            if i >= iters // 10:  # warm-up excluded
                pings.append(t1 - t0)
                steps.append(t2 - t1)
        # the same sequences continue as a steady decode through the client library
        c.free(seqs)
        seqs = c.create_sequences([[i, i + 1, i + 2] for i in range(BATCH)])
        c.flush()
        before = c.rpcs
        t0 = time.perf_counter()
        for step in range(decode_steps):
            c.extend({s: [step] for s in seqs})
        decode_s = time.perf_counter() - t0
        out_q.put({"pings": pings, "steps": steps, "decode_rpcs": c.rpcs - before,
                   "decode_steps": decode_steps, "decode_s": decode_s})


def run(socket: str, clients: int, iters: int, decode_steps: int) -> dict:
    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(clients)
    q = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(socket, iters, decode_steps, barrier, q)) for _ in range(clients)]
    t0 = time.perf_counter()
    for p in procs:
        p.start()
    results = [q.get(timeout=600) for _ in procs]
    wall = time.perf_counter() - t0
    for p in procs:
        p.join()
    pings = [x for r in results for x in r["pings"]]
    steps = [x for r in results for x in r["steps"]]
    ping_p, step_p = percentiles(pings), percentiles(steps)
    rpcs = sum(r["decode_rpcs"] for r in results)
    total_steps = sum(r["decode_steps"] for r in results)
    step_rate = len(steps) / sum(steps) * 1e9 * clients  # calls/s while stepping, all clients
    return {
        "clients": clients,
        "ping": ping_p,
        "step": step_p,
        "step_p50_over_ping_p50": step_p["p50_us"] / ping_p["p50_us"],
        "step_p99_over_ping_p50": step_p["p99_us"] / ping_p["p50_us"],
        "step_p99_over_ping_p99": step_p["p99_us"] / ping_p["p99_us"],
        "step_calls_per_s": step_rate,
        "sequence_ops_per_s": step_rate * BATCH,
        "decode_steps_per_rpc": total_steps / max(rpcs, 1),
        "decode_step_us": statistics.median(r["decode_s"] / r["decode_steps"] for r in results) * 1e6,
        "wall_s": wall,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=2000)
    ap.add_argument("--decode-steps", type=int, default=512)
    args = ap.parse_args()
    from conftest import Daemon

    d = Daemon("--pool-bytes", "1GiB", "--chunk-bytes", "2MiB", "--log-level", "warning").start()
    rows = []
    try:
        for clients in (1, 4):
            rows.append(run(d.socket, clients, args.iters, args.decode_steps))
    finally:
        d.stop()
    print_table(
        f"Step (256 sequences x 1 token) vs empty Ping on the same Unix socket, {args.iters} calls each",
        ["clients", "ping p50 us", "ping p99 us", "step p50 us", "step p99 us", "p50 ratio", "p99/ping p50",
         "target", "step calls/s", "seq ops/s"],
        [[r["clients"], f"{r['ping']['p50_us']:.0f}", f"{r['ping']['p99_us']:.0f}", f"{r['step']['p50_us']:.0f}",
          f"{r['step']['p99_us']:.0f}", f"{r['step_p50_over_ping_p50']:.2f}", f"{r['step_p99_over_ping_p50']:.2f}",
          "<=1.3 / <=3", f"{r['step_calls_per_s']:.0f}", f"{r['sequence_ops_per_s']:.0f}"] for r in rows],
    )
    print_table(
        "steady decode through Client.extend (256 sequences, block size 16, reserves on)",
        ["clients", "decode steps per RPC", "target", "median step us"],
        [[r["clients"], f"{r['decode_steps_per_rpc']:.1f}", ">= 8", f"{r['decode_step_us']:.0f}"] for r in rows],
    )
    write_json("rpc", {"iters": args.iters, "batch": BATCH, "rows": rows})


if __name__ == "__main__":
    main()
