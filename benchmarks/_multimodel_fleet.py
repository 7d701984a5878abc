"""The processes of bench_multimodel.py: kvpoold daemons, ``kvpool serve`` processes, and a sampler of both.

A ``Fleet`` is one configuration under test: one daemon for all three models
(the elastic pool) or one daemon per model (a static split), and one serve
process per model.  Serve processes can be killed and started again on the
same port (a crash, a rolling redeploy) while the trace runs.  The
``Sampler`` thread reads every daemon's stats and every server's counters
periodically, so figures survive a SIGKILLed server and memory can be
plotted over time.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import kvpool
from _common import die_with_parent
from bench_serve import wait

ROOT = Path(__file__).resolve().parent.parent
SERVER_COUNTERS = ("preemptions", "swaps", "recomputes", "prefix_hit_tokens", "generation_tokens")
SERVER_GAUGES = ("waiting", "running")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until(predicate, timeout: float, what: str, proc: subprocess.Popen | None = None, log: str = "") -> None:
    """``bench_serve.wait``, raising ``NotReady`` with the end of the process's log."""
    try:
        wait(predicate, timeout, what, proc)
    except SystemExit as exc:
        raise NotReady(f"{exc}:\n{tail(log)}") from None


def tail(path: str, n: int = 4000) -> str:
    try:
        return Path(path).read_text(errors="replace")[-n:]
    except OSError:
        return ""


class NotReady(RuntimeError):
    pass


class DaemonProc:
    """One ``kvpoold`` on its own socket."""

    def __init__(self, name: str, workdir: str, args: list[str]) -> None:
        self.name = name
        self.socket = os.path.join(workdir, f"{name}.sock")
        self.log = os.path.join(workdir, f"{name}.log")
        self.args = args
        self.proc: subprocess.Popen | None = None

    def start(self) -> "DaemonProc":
        out = open(self.log, "w")
        self.proc = subprocess.Popen([sys.executable, "-m", "kvpoold", "--socket", self.socket, *self.args],
                                     stdout=out, stderr=subprocess.STDOUT, cwd=ROOT, preexec_fn=die_with_parent,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1"})
        wait_until(lambda: "kvpoold ready" in tail(self.log, 100000), 120, f"kvpoold {self.name}", self.proc, self.log)
        return self

    def stats(self):
        with kvpool.Connection(self.socket) as conn:
            return conn.stats()

    def client_pids(self) -> set[int]:
        with kvpool.Connection(self.socket) as conn:
            return {c.pid for c in conn.clients()}

    def check(self) -> tuple[bool, str]:
        with kvpool.Connection(self.socket) as conn:
            return conn.check()

    def ctl_stats(self) -> dict:
        """``kvpoolctl stats --json``: what an operator sees."""
        out = subprocess.run([sys.executable, "-m", "kvpoold.ctl", "--socket", self.socket, "stats", "--json"],
                             capture_output=True, text=True, timeout=60, cwd=ROOT)
        return json.loads(out.stdout) if out.returncode == 0 else {"error": out.stderr.strip()}

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@dataclass
class ServeProc:
    """One ``kvpool serve`` process of one model; ``restart`` keeps its port, model directory and options."""

    key: str
    model_dir: str
    daemon: DaemonProc
    options: list[str]
    workdir: str
    port: int = field(default_factory=free_port)
    eager: bool = False
    proc: subprocess.Popen | None = None
    incarnation: int = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def log(self) -> str:
        return os.path.join(self.workdir, f"serve-{self.key}-{self.incarnation}.log")

    @property
    def pid(self) -> int:
        return self.proc.pid

    def launch(self) -> None:
        self.incarnation += 1
        out = open(self.log, "w")
        cmd = [sys.executable, "-m", "kvpool.serve", "--model", self.model_dir, "--socket", self.daemon.socket,
               "--port", str(self.port), "--served-model-name", self.key, "--log-level", "warning",
               *self.options, *(["--enforce-eager"] if self.eager else [])]
        self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT, preexec_fn=die_with_parent,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1"})

    def wait_ready(self, timeout: float = 900) -> None:
        wait_until(self.healthy, timeout, f"kvpool serve {self.key}", self.proc, self.log)

    def healthy(self) -> bool:
        import httpx

        try:
            return httpx.get(self.url + "/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 120) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(sig)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def counters(self) -> dict[str, float]:
        """The server's engine counters and queue lengths (``/metrics``); empty while it is down."""
        import httpx

        try:
            text = httpx.get(self.url + "/metrics", timeout=2).text
        except httpx.HTTPError:
            return {}
        names = {f"kvpool_serve_{n}_total": n for n in SERVER_COUNTERS}
        names.update({f"kvpool_serve_requests_{n}": n for n in SERVER_GAUGES})
        out = {}
        for line in text.splitlines():
            name, _, value = line.partition(" ")
            if name in names:
                out[names[name]] = float(value)
        return out

    def wait_no_queue(self, timeout: float) -> float:
        """Wait until no request waits for a place in the batch; returns the seconds it took."""
        t0 = time.perf_counter()
        wait_until(lambda: self.counters().get("waiting", 1) == 0, timeout, f"{self.key}'s queue to drain")
        return time.perf_counter() - t0


class Fleet:
    """The daemons and serve processes of one configuration."""

    def __init__(self, daemons: dict[str, DaemonProc], servers: dict[str, ServeProc]) -> None:
        self.daemons, self.servers = daemons, servers
        self.eager_fallback: list[str] = []

    def start(self) -> "Fleet":
        for d in self.daemons.values():
            d.start()
        for s in self.servers.values():
            s.launch()
        for s in self.servers.values():
            self._ready(s)
        return self

    def _ready(self, s: ServeProc) -> None:
        """Wait for a server; one that fails is started again, and on a GPU a third time without CUDA graphs
        (a model whose decode cannot be captured still serves eagerly: the JSON says so)."""
        for attempt in range(3):
            try:
                return s.wait_ready()
            except NotReady as exc:
                if attempt == 2 or (attempt == 1 and (s.eager or "cuda" not in s.options)):
                    raise
                if attempt == 1:
                    self.eager_fallback.append(s.key)
                    s.eager = True
                print(f"warning: {exc}\nstarting {s.key} again{' with --enforce-eager' * s.eager}", flush=True)
                s.stop()
                s.launch()

    def stop(self) -> None:
        for s in self.servers.values():
            s.stop()
        for d in self.daemons.values():
            d.stop()

    def daemon_of(self, key: str) -> DaemonProc:
        return self.servers[key].daemon


class Sampler:
    """Every ``period`` seconds, times from ``t0``: each daemon's classes and memory (``samples``), and on a
    thread of its own, so that a busy server never delays them, each server's counters (``server_samples``)."""

    def __init__(self, fleet: Fleet, geometries: dict[str, str], period: float) -> None:
        self.fleet, self.period = fleet, period
        self.model_of = {g: k for k, g in geometries.items()}  # geometry -> model key
        self.t0 = time.perf_counter()
        self.samples: list[dict] = []
        self.server_samples: list[dict] = []
        self._done = threading.Event()
        self._threads = [threading.Thread(target=self._loop, args=(read, out), daemon=True)
                         for read, out in ((self.read_daemons, self.samples),
                                           (self.read_servers, self.server_samples))]

    def start(self) -> None:
        for t in self._threads:
            t.start()

    def _loop(self, read, out: list[dict]) -> None:
        while not self._done.wait(self.period):
            out.append(read())

    def read_daemons(self) -> dict:
        out = {"t": time.perf_counter() - self.t0, "classes": {}, "devices": {}}
        for name, d in self.fleet.daemons.items():
            try:
                st = d.stats()
            except kvpool.KvpoolError:
                continue
            for dev in st.devices:
                out["devices"][name] = {"physical_bytes": dev.physical_bytes, "freed_bytes": dev.freed_bytes,
                                        "free_seconds": dev.free_seconds, "draining_bytes": dev.draining_bytes,
                                        "unassigned_bytes": dev.free_bytes}
            for c in st.classes:
                model = self.model_of.get(c.geometry.split(" [")[0])
                if model is not None:
                    out["classes"][model] = class_figures(c)
        return out

    def read_servers(self) -> dict:
        return {"t": time.perf_counter() - self.t0,
                "servers": {k: {"incarnation": s.incarnation, **s.counters()} for k, s in self.fleet.servers.items()}}

    def stop(self) -> None:
        self._done.set()
        for t in self._threads:
            t.join(30)
        self.samples.append(self.read_daemons())
        self.server_samples.append(self.read_servers())


def class_figures(c) -> dict:
    return {"mapped_bytes": c.mapped_bytes, "taken_bytes": c.taken_bytes, "released_bytes": c.released_bytes,
            "commit_seconds": c.commit_seconds, "release_seconds": c.release_seconds, "used_blocks": c.used_blocks,
            "reserved_blocks": c.reserved_blocks, "cached_blocks": c.cached_blocks, "block_bytes": c.block_bytes,
            "prefix_hit_tokens": c.prefix_hit_tokens, "promoted_blocks": c.promoted_blocks,
            "demoted_blocks": c.demoted_blocks, "evictions": c.evictions}


def growth(samples: list[dict], section: str, key: str, figure: str, t_from: float, t_to: float) -> float:
    """How much a running total grew from ``t_from`` to ``t_to`` (sampler times).

    The last sample before ``t_from`` is the baseline; a value below the one before it means the
    total started over (a restarted server, a class made anew), so all of it is new.
    """
    values = [s[section][key][figure] for s in samples
              if s["t"] <= t_to and figure in s[section].get(key, {})]
    before = [s["t"] < t_from for s in samples if s["t"] <= t_to and figure in s[section].get(key, {})]
    start = max(0, before.count(True) - 1)
    values = values[start:]
    return float(sum(b - a if b >= a else b for a, b in zip(values, values[1:])))


def level(samples: list[dict], section: str, key: str, figure: str, t: float) -> float | None:
    """The last sampled value of a figure at or before ``t``."""
    got = [s[section][key][figure] for s in samples if s["t"] <= t and figure in s[section].get(key, {})]
    return got[-1] if got else None
