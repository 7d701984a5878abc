"""Fixtures of the remote tier tests: real redis-server processes on temporary Unix sockets."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest

_TESTS = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(_TESTS / "tiers"))  # tierlib: the layout, block bytes
sys.path.insert(0, str(_TESTS / "server"))  # procs: wait_for

from redislib import RedisServer  # noqa: E402
from tierlib import BLOCK  # noqa: E402


@pytest.fixture
def redis_server():
    if shutil.which("redis-server") is None:
        pytest.skip("needs redis-server (scripts/setup.sh installs it)")
    servers: list[RedisServer] = []

    def make(*args: str) -> RedisServer:
        s = RedisServer(*args).start()
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
