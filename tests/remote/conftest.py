"""Fixtures of the remote tier tests: real redis-server processes on temporary Unix sockets."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

_TESTS = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(_TESTS / "tiers"))  # tierlib: the layout, block bytes
sys.path.insert(0, str(_TESTS / "server"))  # procs: wait_for

from tierlib import BLOCK  # noqa: E402


class RedisServer:
    """A redis-server of its own (no persistence) on a Unix socket in a temporary directory."""

    def __init__(self) -> None:
        self.dir = tempfile.mkdtemp(prefix="kvpool-redis-")
        self.socket = os.path.join(self.dir, "redis.sock")
        self.url = f"unix://{self.socket}"
        self.proc: subprocess.Popen | None = None

    def start(self) -> "RedisServer":
        self.proc = subprocess.Popen(
            ["redis-server", "--port", "0", "--unixsocket", self.socket, "--unixsocketperm", "700",
             "--save", "", "--appendonly", "no", "--dir", self.dir],
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

        return redis.Redis(unix_socket_path=self.socket, socket_timeout=5)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)  # a paused one must be able to exit
            self.proc.kill()
            self.proc.wait()

    def pause(self) -> None:
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        self.proc.send_signal(signal.SIGCONT)


@pytest.fixture
def redis_server():
    if shutil.which("redis-server") is None:
        pytest.skip("needs redis-server (scripts/setup.sh installs it)")
    servers: list[RedisServer] = []

    def make() -> RedisServer:
        s = RedisServer().start()
        servers.append(s)
        return s

    yield make
    for s in servers:
        s.stop()
        shutil.rmtree(s.dir, ignore_errors=True)


@pytest.fixture
def node(daemon_factory, tmp_path):
    """``node(redis, *extra)`` -> a daemon (one "machine") on ``redis``: its own socket, host and disk tiers."""
    count = [0]

    def make(server: RedisServer, *extra: str, timeout: float = 2.0, pool_blocks: int = 128, start: bool = True):
        count[0] += 1
        args = ["--backend", "cpu", "--pool-bytes", str(pool_blocks * BLOCK), "--chunk-bytes", "64KiB",
                "--remote-url", server.url, "--remote-timeout", str(timeout), *extra]
        return daemon_factory(*args, start=start)

    return make
