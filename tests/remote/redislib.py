"""A redis-server of the tests' own (the remote tier's tests and benchmarks/bench_remote.py)."""

from __future__ import annotations

import os
import signal
import subprocess
import tempfile
import time


class RedisServer:
    """A redis-server of its own (no persistence) on a Unix socket in a temporary directory."""

    def __init__(self, *args: str) -> None:
        """``args``: more redis-server options (``--requirepass``...)."""
        self.args = args
        self.dir = tempfile.mkdtemp(prefix="kvpool-redis-")
        self.socket = os.path.join(self.dir, "redis.sock")
        self.url = f"unix://{self.socket}"
        self.proc: subprocess.Popen | None = None

    def start(self) -> "RedisServer":
        self.proc = subprocess.Popen(
            ["redis-server", "--port", "0", "--unixsocket", self.socket, "--unixsocketperm", "700",
             "--save", "", "--appendonly", "no", "--dir", self.dir, *self.args],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                if self.client().ping():
                    return self
            except Exception:  # noqa: BLE001 - not up yet
                time.sleep(0.02)
        raise RuntimeError("redis-server did not start")

    def client(self):
        import redis

        password = self.args[self.args.index("--requirepass") + 1] if "--requirepass" in self.args else None
        return redis.Redis(unix_socket_path=self.socket, socket_timeout=5, password=password)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)  # a paused one must be able to exit
            self.proc.kill()
            self.proc.wait()

    def pause(self) -> None:
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        self.proc.send_signal(signal.SIGCONT)


def free_port() -> int:
    """A TCP port nothing listens on now (and its cluster bus port, +10000, neither)."""
    import socket

    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port + 10000 > 65535:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port + 10000))
            except OSError:
                continue
        return port


class RedisCluster:
    """Three redis-server masters on localhost TCP ports, joined into one Redis Cluster."""

    def __init__(self) -> None:
        self.dir = tempfile.mkdtemp(prefix="kvpool-redis-cluster-")
        self.ports = [free_port() for _ in range(3)]
        self.url = f"redis://127.0.0.1:{self.ports[0]}/0"
        self.procs: list[subprocess.Popen] = []

    def start(self) -> "RedisCluster":
        for port in self.ports:
            d = os.path.join(self.dir, str(port))
            os.makedirs(d)
            self.procs.append(subprocess.Popen(
                ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--cluster-enabled", "yes",
                 "--cluster-config-file", "nodes.conf", "--save", "", "--appendonly", "no", "--dir", d],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        nodes = [f"127.0.0.1:{p}" for p in self.ports]
        deadline = time.monotonic() + 20
        while True:
            out = subprocess.run(["redis-cli", "--cluster", "create", *nodes, "--cluster-replicas", "0",
                                  "--cluster-yes"], capture_output=True, text=True)
            if out.returncode == 0:
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"the cluster did not form: {out.stdout[-500:]} {out.stderr[-500:]}")
            time.sleep(0.2)
        while subprocess.run(["redis-cli", "-p", str(self.ports[0]), "cluster", "info"], capture_output=True,
                             text=True).stdout.find("cluster_state:ok") < 0:
            if time.monotonic() > deadline:
                raise RuntimeError("the cluster is not ok")
            time.sleep(0.1)
        return self

    def stop(self) -> None:
        for p in self.procs:
            p.kill()
            p.wait()
