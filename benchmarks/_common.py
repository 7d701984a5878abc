"""Helpers shared by the benchmark scripts: timing, yardsticks, table + JSON output."""

from __future__ import annotations

import ctypes
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# KVPOOL_BENCH_RESULTS: another folder (the device scripts write straight into their $OUT, so a run cut short
# by a time limit still hands back what it wrote)
RESULTS = Path(os.environ.get("KVPOOL_BENCH_RESULTS") or Path(__file__).resolve().parent / "results")


_PRCTL = ctypes.CDLL(None).prctl if sys.platform.startswith("linux") else None  # looked up before any fork


def die_with_parent() -> None:
    """``preexec_fn`` for a child the benchmark starts from its main thread (a daemon, a server): SIGTERM when the
    benchmark dies, even by SIGKILL or abort, so no orphan keeps the GPU or the output pipe of a device script."""
    if _PRCTL is not None:
        _PRCTL(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def median_ns(fn, *, repeat: int = 15, number: int = 1000) -> float:
    """Median over ``repeat`` runs of the mean time of ``number`` calls, in ns."""
    samples = []
    for _ in range(repeat):
        t0 = time.perf_counter_ns()
        for _ in range(number):
            fn()
        samples.append((time.perf_counter_ns() - t0) / number)
    return statistics.median(samples)


def percentiles(samples_ns: list[float]) -> dict[str, float]:
    s = sorted(samples_ns)
    return {
        "p50_us": s[len(s) // 2] / 1e3,
        "p99_us": s[min(len(s) - 1, int(len(s) * 0.99))] / 1e3,
        "mean_us": sum(s) / len(s) / 1e3,
    }


_ECHO_SERVER = r"""
import sys, grpc
from concurrent import futures
server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
handler = grpc.method_handlers_generic_handler(
    "bench.Echo", {"Ping": grpc.unary_unary_rpc_method_handler(lambda req, ctx: b"")})
server.add_generic_rpc_handlers((handler,))
server.add_insecure_port("unix://" + sys.argv[1])
server.start()
print("ready", flush=True)
server.wait_for_termination()
"""


class EmptyRpcYardstick:
    """An empty unary gRPC call over a Unix socket to a server in another process."""

    def __enter__(self):
        import grpc

        self._dir = tempfile.TemporaryDirectory()
        path = os.path.join(self._dir.name, "echo.sock")
        self._proc = subprocess.Popen([sys.executable, "-c", _ECHO_SERVER, path], stdout=subprocess.PIPE)
        assert self._proc.stdout.readline().strip() == b"ready"
        self._channel = grpc.insecure_channel("unix://" + path)
        self.call = self._channel.unary_unary("/bench.Echo/Ping")
        for _ in range(200):
            self.call(b"")
        return self

    def samples_ns(self, n: int = 2000) -> list[float]:
        out = []
        for _ in range(n):
            t0 = time.perf_counter_ns()
            self.call(b"")
            out.append(time.perf_counter_ns() - t0)
        return out

    def __exit__(self, *exc):
        self._channel.close()
        self._proc.kill()
        self._proc.wait()
        self._dir.cleanup()


def machine() -> dict:
    return {
        "python": platform.python_version(),
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "date": time.strftime("%Y-%m-%d"),
    }


def print_table(title: str, header: list[str], rows: list[list]) -> None:
    widths = [max(len(str(h)), *(len(str(r[i])) for r in rows)) for i, h in enumerate(header)]
    print(f"\n{title}")
    print("  ".join(str(h).ljust(w) for h, w in zip(header, widths)))
    print("  ".join("-" * w for w in widths))
    for r in rows:
        print("  ".join(str(c).ljust(w) for c, w in zip(r, widths)))


def write_json(name: str, payload: dict) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps({"machine": machine(), **payload}, indent=2))
    print(f"\nwrote {path}")
    return path
