"""How long a model process takes to attach to kvpoold and map the pool.

    python3 benchmarks/bench_attach.py [--backend cpu|cuda] [--clients 8]

Each client is a fresh process (imports done before the clock starts); it
times ``kvpool.connect`` (Attach RPC + keep-alive stream) and ``kv_cache()``
(opening the shared memory or CUDA IPC handle and building the tensor, plus
one write made visible).  An empty Ping on the same socket is the yardstick.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from _common import print_table, write_json  # noqa: E402

CHILD = r"""
import json, sys, time
import torch, kvpool
layout = kvpool.Layout("attach-bench", num_layers=32, num_kv_heads=8, head_dim=128, dtype="bfloat16")
conn = kvpool.Connection(sys.argv[1]); conn.ping()
t0 = time.perf_counter(); conn.ping(); ping = time.perf_counter() - t0
t0 = time.perf_counter()
client = kvpool.connect(sys.argv[1], name="bench", layout=layout)
t1 = time.perf_counter()
kv = client.kv_cache()
t2 = time.perf_counter()
kv[0, 0, 0, 0, 0, 0] = 1.0  # the first write: torch's first kernel on that device, a page fault
if kv.is_cuda:
    torch.cuda.synchronize()
t3 = time.perf_counter()
print(json.dumps({"connect_ms": (t1 - t0) * 1e3, "map_ms": (t2 - t1) * 1e3, "first_write_ms": (t3 - t2) * 1e3,
                  "ping_ms": ping * 1e3,
                  "pool_bytes": kv.numel() * kv.element_size(), "device": str(kv.device)}))
client.close()
"""


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--backend", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--pool-bytes", default="1GiB")
    args = ap.parse_args()
    from conftest import Daemon

    d = Daemon("--backend", args.backend, "--pool-bytes", args.pool_bytes, "--chunk-bytes", "2MiB",
               "--log-level", "warning").start()
    rows = []
    try:
        for _ in range(args.clients):
            out = subprocess.run([sys.executable, "-c", CHILD, d.socket], capture_output=True, text=True, timeout=300)
            if out.returncode:
                raise SystemExit(out.stderr)
            rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    finally:
        d.stop()
    med = {k: statistics.median(r[k] for r in rows) for k in ("connect_ms", "map_ms", "first_write_ms", "ping_ms")}
    first = rows[0]
    print_table(
        f"attach to kvpoold ({args.backend}, pool {rows[0]['pool_bytes'] / 2**30:.1f} GiB on {rows[0]['device']}), "
        f"{len(rows)} fresh processes",
        ["", "connect ms", "map pool ms", "attach total ms", "first write ms", "empty ping ms"],
        [[label, f"{r['connect_ms']:.2f}", f"{r['map_ms']:.2f}", f"{r['connect_ms'] + r['map_ms']:.2f}",
          f"{r['first_write_ms']:.2f}", f"{r['ping_ms']:.2f}"] for label, r in (("first client", first), ("median", med))],
    )
    write_json(f"attach_{args.backend}", {"rows": rows, "median": med})


if __name__ == "__main__":
    main()
