"""How long the largest allowed call holds other sessions: Ping latency beside max-size calls.

    python3 benchmarks/bench_stall.py [--seconds 4]

All state changes run on the daemon's one event loop, so a call that carries
``max_tokens_per_call`` tokens (default 1,048,576) delays every other
session's calls while it runs.  One client process Pings the daemon
continuously for the whole run; the main process first leaves it alone
(the yardstick), then repeats, for ``--seconds`` each, the largest allowed
``Create`` (one prompt of max tokens, freed by the next call), ``Lookup``
(max tokens) and ``Step`` (one sequence extended by max tokens and freed in the
same call).  Reports the Ping p50/p99/max in each window and the big call's
own median time.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from _common import percentiles, print_table, write_json  # noqa: E402

LAYOUT_ARGS = dict(model_id="stall", num_layers=1, num_kv_heads=1, head_dim=16, dtype="float16", block_size=16)
MAX_TOKENS = 1 << 20  # the daemon's default max_tokens_per_call


def pinger(socket: str, stop, ready, out_q) -> None:
    import kvpool
    from kvpool.protocol import kvpool_pb2 as pb

    samples = []
    with kvpool.Connection(socket) as conn:
        stub, req = conn._stub, pb.PingRequest()
        stub.Ping(req)
        ready.set()
        while not stop.is_set():
            t0 = time.monotonic_ns()
            stub.Ping(req)
            samples.append((t0, time.monotonic_ns() - t0))
    out_q.put(samples)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=4.0, help="per window")
    args = ap.parse_args()

    import kvpool
    from conftest import Daemon
    from kvpool.protocol import kvpool_pb2 as pb

    d = Daemon("--pool-bytes", "1GiB", "--chunk-bytes", "2MiB", "--log-level", "warning").start()
    ctx = mp.get_context("spawn")
    stop, ready, q = ctx.Event(), ctx.Event(), ctx.Queue()
    p = ctx.Process(target=pinger, args=(d.socket, stop, ready, q))
    try:
        c = kvpool.connect(d.socket, name="stall-big", layout=kvpool.Layout(**LAYOUT_ARGS))
        stub, token = c._conn._stub, c._token
        big = np.arange(MAX_TOKENS, dtype="<u4").tobytes()
        small = np.array([7], "<u4").tobytes()
        last: list[int] = []

        def create():
            free = last[:]
            last.clear()
            if free:
                stub.Step(pb.StepRequest(session=token, free_seq_ids=free))
            r = stub.Create(pb.CreateRequest(session=token, prompts=[pb.Prompt(tokens=big, extra_key="c")]))
            last.append(r.sequences[0].seq_id)

        def lookup():
            stub.Lookup(pb.LookupRequest(session=token, prompt=pb.Prompt(tokens=big)))

        def step():
            r = stub.Create(pb.CreateRequest(session=token, prompts=[pb.Prompt(tokens=small)]))
            sid = r.sequences[0].seq_id
            stub.Step(pb.StepRequest(session=token, seq_ids=np.array([sid], "<i8").tobytes(),
                                     token_counts=np.array([MAX_TOKENS], "<i4").tobytes(), tokens=big,
                                     free_seq_ids=[sid]))

        p.start()
        ready.wait(60)
        windows = [("Ping alone", None)]
        bounds = []
        t = time.monotonic_ns()
        time.sleep(args.seconds)
        bounds.append(("Ping alone", t, time.monotonic_ns(), []))
        for name, fn in (("create", create), ("lookup", lookup), ("step", step)):
            fn()  # warm-up (first touch of the arena's pages)
            took, t = [], time.monotonic_ns()
            while time.monotonic_ns() - t < args.seconds * 1e9:
                t0 = time.perf_counter_ns()
                fn()
                took.append(time.perf_counter_ns() - t0)
            bounds.append((f"during {name} of {MAX_TOKENS} tokens", t, time.monotonic_ns(), took))
        stop.set()
        samples = q.get(timeout=60)
        p.join(30)
        c.close()
    finally:
        if p.is_alive():
            p.kill()
        d.stop()

    rows, out = [], []
    for name, t0, t1, took in bounds:
        lat = [ns for (s, ns) in samples if t0 <= s < t1]
        pc = percentiles(lat)
        row = {"window": name, "pings": len(lat), "p50_us": pc["p50_us"], "p99_us": pc["p99_us"],
               "max_ms": max(lat) / 1e6, "big_calls": len(took),
               "big_call_median_ms": statistics.median(took) / 1e6 if took else None}
        out.append(row)
        rows.append([name, len(lat), f"{row['p50_us']:.0f}", f"{row['p99_us']:.0f}", f"{row['max_ms']:.1f}",
                     len(took) or "-", f"{row['big_call_median_ms']:.1f}" if took else "-"])
    print_table("Ping latency while one client makes the largest allowed call (max_tokens_per_call)",
                ["window", "pings", "Ping p50 µs", "Ping p99 µs", "Ping max ms", "big calls", "big call p50 ms"],
                rows)
    write_json("stall", {"max_tokens_per_call": MAX_TOKENS, "seconds_per_window": args.seconds, "rows": out})


if __name__ == "__main__":
    main()
