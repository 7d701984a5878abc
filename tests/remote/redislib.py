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
