"""A tenant that resizes the memory it was handed harms nobody: not the daemon, not other tenants, not the budget.

A real daemon, a real second process as another user (uid 65534: another
tenant), the arena's real memfd from the side socket.  The hostile process
(``hostile_arena_proc.py``) tries to shrink, grow, write past the end of and
seal its arena, then makes the calls that make the daemon read that arena
through each tier: a swap-out to the host tier and to the disk tier, a
``mark_written`` with a remote tier where nothing listens and with a real
redis-server.  Before arenas were sealed a shrunk memfd killed the daemon
with SIGBUS on that read, and a grown one held memory outside the pool.
"""

from __future__ import annotations

import json
import os
import pwd
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import kvpool
from faultkit import LAYOUT

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "remote"))
from redislib import RedisServer  # noqa: E402

HOSTILE = str(Path(__file__).with_name("hostile_arena_proc.py"))
NOBODY = 65534
SEALS = 0x1 | 0x2 | 0x4  # F_SEAL_SEAL | F_SEAL_SHRINK | F_SEAL_GROW

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a client as another user")


def _nothing_listens() -> str:
    """A redis:// URL of a local TCP port that nothing listens on."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"redis://127.0.0.1:{port}/0"


@pytest.fixture
def redis():
    if shutil.which("redis-server") is None:
        pytest.skip("needs redis-server (scripts/setup.sh installs it)")
    r = RedisServer().start()
    yield r
    r.stop()
    shutil.rmtree(r.dir, ignore_errors=True)


def _tier_args(tier: str, tmp_path: Path, request) -> list[str]:
    if tier == "host":
        return ["--host-bytes", "4MiB"]
    if tier == "disk":
        return ["--disk-bytes", "4MiB", "--disk-dir", str(tmp_path / "disk")]
    if tier == "remote, nothing listening":
        return ["--remote-url", _nothing_listens(), "--remote-timeout", "0.2"]
    return ["--remote-url", request.getfixturevalue("redis").url]


def _run_hostile(sock: str) -> subprocess.CompletedProcess:
    try:
        pwd.getpwuid(NOBODY)
    except KeyError:
        pytest.skip(f"no user {NOBODY} on this machine")
    return subprocess.run([sys.executable, HOSTILE, sock, str(NOBODY)], capture_output=True, text=True, timeout=180)


def _daemon_shm_bytes(pid: int) -> int:
    """Physical bytes of every memfd the daemon holds open (its arenas)."""
    total = 0
    for fd in os.listdir(f"/proc/{pid}/fd"):
        path = f"/proc/{pid}/fd/{fd}"
        try:
            if os.readlink(path).startswith("/memfd:"):
                total += os.stat(path).st_blocks * 512
        except OSError:
            continue  # closed meanwhile
    return total


def _still_serves(client, prompt: list[int], swap: bool) -> None:
    """A whole round trip of another tenant's client: create, write, (``swap``: out and in), read back."""
    seq = client.create_sequence(prompt)
    kv = client.kv_cache().numpy()
    kv[seq.block_table] = 3.0
    client.mark_written(seq)
    if swap:
        client.swap_out(seq)
        client.swap_in(seq)
    assert np.all(client.kv_cache().numpy()[client.block_ids(seq)] == 3.0)
    client.free(seq)


@pytest.mark.parametrize("tier", ["host", "disk", "remote, nothing listening", "remote, a real redis-server"])
def test_a_tenant_cannot_resize_its_arena_and_the_daemon_survives_reading_it(daemon_factory, tmp_path, request, tier):
    d = daemon_factory("--socket-mode", "666", *_tier_args(tier, tmp_path, request), start=False)
    os.chmod(d.dir, 0o755)  # the other user reaches the socket
    d.start()
    swap = tier in ("host", "disk")
    with kvpool.connect(d.socket, name="bystander", layout=LAYOUT) as bystander:
        _still_serves(bystander, list(range(1, 17)), swap)
        out = _run_hostile(d.socket)
        assert d.proc.poll() is None, d.output()  # the daemon is alive...
        assert out.returncode == 0, out.stderr
        got = json.loads(out.stdout.strip().splitlines()[-1])
        assert got["uid"] == NOBODY and "failed" not in got, got
        # the memfd it was handed is sealed: its size cannot change, and no one can add a seal
        assert got["seals"] & SEALS == SEALS, got
        for attempt in ("shrink", "grow", "pwrite_past_end", "fallocate_past_end", "seal_write",
                        "seal_future_write"):
            assert got[attempt] == "EPERM", (attempt, got)
        assert got["map_past_end"] == "SIGBUS", got  # a mapping past the end gives no memory either
        assert got["size_after"] == got["arena_bytes"], got
        assert got["allocated_after"] <= got["arena_bytes"], got
        # the calls that read its arena answered (the remote tier's own failure is no error of the call)
        assert got["mark_written"] == "ok", got
        if swap:
            assert got["swap_out"] == "ok" and got["swap_in"] == "ok" and got["intact"] is True, got
        # ...and another tenant's client goes on working
        _still_serves(bystander, list(range(101, 117)), swap)
        # what it wrote outside its class's slabs went with its session
        assert got["fill_unowned"] == "ok", got
        deadline = time.monotonic() + 60
        while _daemon_shm_bytes(d.proc.pid) >= 16 << 20 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert _daemon_shm_bytes(d.proc.pid) < 16 << 20
    if tier == "remote, a real redis-server":  # the daemon did read the hostile arena: its blocks went out
        r = request.getfixturevalue("redis")
        deadline = time.monotonic() + 30
        while not r.keys("kvpool*") and time.monotonic() < deadline:
            time.sleep(0.1)
        assert r.keys("kvpool*")
    assert "Traceback" not in d.output()
