"""kvpoolctl and kvpoold's command line, run as real commands."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

import kvpool

LAYOUT = kvpool.Layout("cli-model", num_layers=1, num_kv_heads=1, head_dim=8, dtype="float16", block_size=4)


def ctl(socket, *args):
    return subprocess.run([sys.executable, "-m", "kvpoold.ctl", "--socket", socket, *args],
                          capture_output=True, text=True, timeout=60)


def test_stats_table_and_json(daemon):
    with kvpool.connect(daemon.socket, name="cli", layout=LAYOUT) as c:
        c.create_sequence(range(10))
        c.create_sequence(range(9))  # hits the first 8 tokens
        out = ctl(daemon.socket, "stats")
        assert out.returncode == 0, out.stderr
        for word in ("class 0 · device", "cli-model", "prefix hits", "hit rate", "free", "cached"):
            assert word in out.stdout
        data = json.loads(ctl(daemon.socket, "stats", "--json").stdout)
        (cls,) = data["classes"]
        assert data["clients"] == 1 and data["sequences"] == 2
        assert cls["used_blocks"] == 3 + 1 and cls["prefix_hits"] == 1
        assert cls["hit_rate"] == pytest.approx(8 / 19)


def test_clients_sequences_check_evict(daemon):
    with kvpool.connect(daemon.socket, name="worker-7", layout=LAYOUT) as c:
        s = c.create_sequence(range(12))
        rows = json.loads(ctl(daemon.socket, "clients", "--json").stdout)
        assert [(r["name"], r["sequences"]) for r in rows] == [("worker-7", 1)]
        seqs = json.loads(ctl(daemon.socket, "sequences", str(c.session_id), "--json").stdout)
        assert seqs[0]["seq_id"] == s.id and seqs[0]["block_table"] == s.block_table.tolist()
        c.free(s)
        assert ctl(daemon.socket, "check").stdout.startswith("ok:")
        assert json.loads(ctl(daemon.socket, "evict", "--json").stdout) == {"evicted": 3}


def test_errors_are_one_line_with_exit_codes(daemon, tmp_path):
    out = ctl(str(tmp_path / "none.sock"), "stats")
    assert out.returncode == 3 and "kvpoold is not running" in out.stderr and out.stderr.count("\n") == 1
    out = ctl(daemon.socket, "sequences", "999")
    assert out.returncode == 1 and "no session 999" in out.stderr
    out = ctl(daemon.socket, "evict", "--max-blocks", "0")
    assert out.returncode == 2


def test_kvpoold_config_errors_name_the_key(tmp_path):
    def kvpoold(*args, env=None):
        import os

        return subprocess.run([sys.executable, "-m", "kvpoold", *args], capture_output=True, text=True,
                              timeout=60, env={**os.environ, **(env or {})})

    out = kvpoold("--pool-bytes", "lots", "--check-config")
    assert out.returncode == 2 and "pool_bytes = 'lots' (from --pool-bytes)" in out.stderr
    out = kvpoold("--check-config", env={"KVPOOL_GRACE_SECONDS": "-1"})
    assert out.returncode == 2 and "grace_seconds" in out.stderr and "KVPOOL_GRACE_SECONDS" in out.stderr
    cfg = tmp_path / "kvpoold.toml"
    cfg.write_text('pool_bytes = "3GiB"\nbackend = "cpu"\nsocket = "/tmp/x.sock"\n')
    out = kvpoold("--config", str(cfg), "--check-config", env={"KVPOOL_SOCKET": "/tmp/y.sock"})
    data = json.loads(out.stdout)
    assert data["pool_bytes"] == 3 << 30 and data["socket"] == "/tmp/y.sock"  # env beats file
    out = kvpoold("--config", str(cfg), "--socket", "/tmp/z.sock", "--check-config", env={"KVPOOL_SOCKET": "/tmp/y.sock"})
    assert json.loads(out.stdout)["socket"] == "/tmp/z.sock"  # flag beats env
    cfg.write_text('pool_byts = "3GiB"\n')
    out = kvpoold("--config", str(cfg), "--check-config")
    assert out.returncode == 2 and "unknown key 'pool_byts'" in out.stderr
    out = kvpoold("--config", str(tmp_path / "missing.toml"))
    assert out.returncode == 2 and "does not exist" in out.stderr
    for bad, why in (("disk.write=BOGUS", "unknown action 'BOGUS'"), ("nosuch=EIO", "expected point=action")):
        out = kvpoold("--check-config", env={"KVPOOLD_FAILPOINTS": bad})  # the testing-only fault switch
        assert out.returncode == 2 and why in out.stderr and out.stderr.count("\n") == 1, out.stderr
