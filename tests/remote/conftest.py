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


def _redis_processes(kind, binaries: tuple[str, ...]):
    """A fixture's body: ``make(*args, **kw)`` starts a ``kind`` (``RedisServer`` or ``RedisCluster``), all of
    them stopped and their files removed at the end. A redis-server that will not start with TLS (built
    without it) skips the test."""
    missing = [b for b in binaries if shutil.which(b) is None]
    if missing:
        pytest.skip(f"needs {' and '.join(missing)} (scripts/setup.sh installs them)")
    started: list = []

    def make(*args: str, **kw):
        r = kind(*args, **kw)
        started.append(r)
        try:
            return r.start()
        except RuntimeError as exc:
            if kw.get("tls") is None:
                raise
            pytest.skip(f"this redis-server does not start with TLS (built without it?): {exc}")

    yield make
    for r in started:
        r.stop()
        shutil.rmtree(r.dir, ignore_errors=True)


@pytest.fixture
def redis_server():
    """``redis_server(*args, tls=None, clients="optional")`` -> a started ``RedisServer``."""
    yield from _redis_processes(RedisServer, ("redis-server",))


@pytest.fixture
def redis_cluster():
    """``redis_cluster(tls=None, clients="optional")`` -> a started three-node ``RedisCluster``."""
    yield from _redis_processes(RedisCluster, ("redis-server", "redis-cli"))


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
