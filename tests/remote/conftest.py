"""Fixtures of the remote tier tests: real redis-server processes on temporary Unix sockets."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest

_TESTS = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(_TESTS / "tiers"))  # tierlib: the layout, block bytes
sys.path.insert(0, str(_TESTS / "server"))  # procs: wait_for

from redislib import Certs, RedisCluster, RedisServer  # noqa: E402
from tierlib import BLOCK  # noqa: E402


@pytest.fixture(scope="session")
def certs(tmp_path_factory):
    """A throwaway CA with a server and a client certificate, and another CA (``redislib.Certs``)."""
    if shutil.which("openssl") is None:
        pytest.skip("needs the openssl command to make test certificates")
    return Certs(str(tmp_path_factory.mktemp("certs")))


@pytest.fixture
def redis_server():
    """``redis_server(*args, tls=None, clients="optional")`` -> a started ``RedisServer``."""
    if shutil.which("redis-server") is None:
        pytest.skip("needs redis-server (scripts/setup.sh installs it)")
    servers: list[RedisServer] = []

    def make(*args: str, **kw) -> RedisServer:
        s = RedisServer(*args, **kw)
        servers.append(s)
        try:
            return s.start()
        except RuntimeError as exc:
            if kw.get("tls") is None:
                raise
            pytest.skip(f"this redis-server does not start with TLS (built without it?): {exc}")

    yield make
    for s in servers:
        s.stop()
        shutil.rmtree(s.dir, ignore_errors=True)


@pytest.fixture
def redis_cluster():
    """``redis_cluster(tls=None, clients="optional")`` -> a started three-node ``RedisCluster``."""
    if shutil.which("redis-server") is None or shutil.which("redis-cli") is None:
        pytest.skip("needs redis-server and redis-cli (scripts/setup.sh installs them)")
    clusters: list[RedisCluster] = []

    def make(**kw) -> RedisCluster:
        c = RedisCluster(**kw)
        clusters.append(c)
        try:
            return c.start()
        except RuntimeError as exc:
            if kw.get("tls") is None:
                raise
            pytest.skip(f"this redis-server does not run a TLS cluster (built without TLS?): {exc}")

    yield make
    for c in clusters:
        c.stop()
        shutil.rmtree(c.dir, ignore_errors=True)


@pytest.fixture
def node(daemon_factory, tmp_path):
    """``node(redis, *extra, backend="cpu")`` -> a daemon (one "machine") on ``redis`` (a server, or a cluster with
    ``--remote-cluster`` in ``extra``): its own socket, host and disk tiers."""
    count = [0]

    def make(server: "RedisServer | RedisCluster", *extra: str, timeout: float = 2.0, pool_blocks: int = 128,
             start: bool = True, backend: str = "cpu"):
        count[0] += 1
        args = ["--backend", backend, "--pool-bytes", str(pool_blocks * BLOCK), "--chunk-bytes", "64KiB",
                "--remote-url", server.url, "--remote-timeout", str(timeout), *extra]
        if backend == "cuda":  # a pool of 128 small blocks: less than one 2 MiB VMM chunk (as tests/tiers)
            args += ["--cuda-memory", "ipc"]
        return daemon_factory(*args, start=start)

    return make
