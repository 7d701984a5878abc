"""Every kvpoolctl command against a live daemon, tables and --json, help and exit codes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

import kvpool
from opskit import LAYOUT, run_ctl

COMMANDS = ["stats", "clients", "sequences", "evict", "drain", "config", "check"]


def test_every_command_json(daemon):
    admin = daemon.socket[:-5] + "-admin.sock"
    with kvpool.connect(daemon.socket, name="w", layout=LAYOUT) as c:
        s = c.create_sequence(range(12))
        c.free(c.create_sequence(range(100, 108)))  # 2 cached blocks

        data = json.loads(run_ctl(daemon.socket, "stats", "--json").stdout)
        assert data["clients"] == 1 and data["sequences"] == 1 and data["draining"] is False
        assert data["classes"][0]["cached_blocks"] == 2 and data["pool_bytes"] == 64 << 20

        (row,) = json.loads(run_ctl(daemon.socket, "clients", "--json").stdout)
        assert row["name"] == "w" and row["session_id"] == c.session_id and row["pid"] == os.getpid()

        (seq,) = json.loads(run_ctl(daemon.socket, "sequences", str(c.session_id), "--json").stdout)
        assert seq["seq_id"] == s.id and seq["block_table"] == s.block_table.tolist()

        conf = json.loads(run_ctl(daemon.socket, "config", "--json").stdout)
        assert conf["config"]["socket"] == daemon.socket and conf["admin_socket"] == admin
        assert "log_level" in conf["live_keys"] and "socket" not in conf["live_keys"]

        assert json.loads(run_ctl(daemon.socket, "check", "--json").stdout)["ok"] is True
        assert json.loads(run_ctl(daemon.socket, "evict", "--max-blocks", "1", "--json").stdout) == {"evicted": 1}

        out = run_ctl(daemon.socket, "drain", "--json")
        assert json.loads(out.stdout) == {"draining": True, "sessions": 1, "sequences": 1, "finished": False}
        assert json.loads(run_ctl(daemon.socket, "stats", "--json").stdout)["draining"] is True
        out = run_ctl(daemon.socket, "drain", "--wait", "--wait-timeout", "0.3", "--json")
        assert out.returncode == 1 and "still 1 sequences after 0.3s" in out.stderr
        assert json.loads(out.stdout)["finished"] is False
        c.free(s)
        out = run_ctl(daemon.socket, "drain", "--wait", "--json")
        assert out.returncode == 0 and json.loads(out.stdout)["finished"] is True
        out = run_ctl(daemon.socket, "drain", "--off", "--json")
        assert json.loads(out.stdout)["draining"] is False
        c.create_sequence(range(3))


def test_every_command_table(daemon):
    with kvpool.connect(daemon.socket, name="tab", layout=LAYOUT) as c:
        c.create_sequence(range(12))
        for args, words in (
            (["stats"], ["class 0 · device", "ops-model", "prefix hits"]),
            (["clients"], ["tab", "ops-model", "yes"]),
            (["sequences", str(c.session_id)], [f"sequences of session {c.session_id}"]),
            (["config"], ["max_blocks_per_session", "live", "restart", "admin socket:"]),
            (["check"], ["ok:"]),
            (["evict"], ["evicted 0 cached blocks"]),
            (["drain"], ["draining: 1 sessions, 1 sequences left"]),
            (["drain", "--off"], ["not draining"]),
        ):
            out = run_ctl(daemon.socket, *args)
            assert out.returncode == 0, (args, out.stderr)
            for w in words:
                assert w in out.stdout, (args, w, out.stdout)


def test_stats_watch_refreshes(daemon):
    cmd = [sys.executable, "-m", "kvpoold.ctl", "--socket", daemon.socket, "stats", "--watch", "0.1", "--json"]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    try:
        first = json.loads(p.stdout.readline())
        with kvpool.connect(daemon.socket, name="later", layout=LAYOUT):
            deadline = time.monotonic() + 10
            while json.loads(p.stdout.readline())["clients"] != 1:
                assert time.monotonic() < deadline
        assert first["clients"] == 0
    finally:
        p.terminate()
        p.wait(10)
    # the table form redraws in place (rich Live) until Ctrl-C, which ends it cleanly
    p = subprocess.Popen([*cmd[:-1]], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    time.sleep(1.5)
    p.send_signal(2)
    out, err = p.communicate(timeout=10)
    assert p.returncode == 0 and "prefix hits" in out and "Traceback" not in err


def test_not_running_is_one_line_exit_3(tmp_path):
    for cmd in (["stats"], ["clients", "--json"]):
        out = run_ctl(str(tmp_path / "kvpoold.sock"), *cmd)
        assert out.returncode == 3, (cmd, out)
        assert out.stderr.startswith("kvpoolctl: kvpoold is not running: no socket at ") and out.stderr.count("\n") == 1
    for cmd in (["drain"],):  # admin commands use the admin socket
        out = run_ctl(str(tmp_path / "kvpoold.sock"), *cmd)
        assert out.returncode == 3, (cmd, out)
        assert out.stderr.startswith("kvpoolctl: kvpoold is not running, or has no admin socket: nothing at "
                                     f"{tmp_path / 'kvpoold-admin.sock'}") and out.stderr.count("\n") == 1
    stale = tmp_path / "stale.sock"
    import socket

    s = socket.socket(socket.AF_UNIX)
    s.bind(str(stale))
    s.close()  # a socket file nobody listens on
    out = run_ctl(str(stale), "stats")
    assert out.returncode == 3 and "kvpoold is not running: nothing listens on" in out.stderr


def test_errors_and_exit_codes(daemon):
    out = run_ctl(daemon.socket, "sequences", "999")
    assert out.returncode == 1 and out.stderr == "kvpoolctl: UNAUTHENTICATED: no session 999\n"
    out = run_ctl(daemon.socket, "evict", admin=daemon.socket)  # an admin call on the normal socket
    assert out.returncode == 5 and "PERMISSION_DENIED: evict is an admin call" in out.stderr
    out = run_ctl(daemon.socket, "evict", "--max-blocks", "0")
    assert out.returncode == 2
    out = run_ctl(daemon.socket, "frobnicate")
    assert out.returncode == 2


def test_admin_socket_from_the_config_file(daemon_factory, tmp_path):
    admin = str(tmp_path / "ops.sock")
    d = daemon_factory("--admin-socket", admin)
    cfg = tmp_path / "kvpoold.toml"
    cfg.write_text(f'socket = "{d.socket}"\nadmin_socket = "{admin}"\n')
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVPOOL_")}
    out = subprocess.run([sys.executable, "-m", "kvpoold.ctl", "--config", str(cfg), "evict", "--json"],
                         capture_output=True, text=True, timeout=60, env=env)
    assert out.returncode == 0 and json.loads(out.stdout) == {"evicted": 0}, out.stderr


@pytest.mark.parametrize("command", COMMANDS)
def test_help_has_examples_and_exit_codes(command):
    out = subprocess.run([sys.executable, "-m", "kvpoold.ctl", command, "--help"], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0
    assert "Examples:" in out.stdout and "kvpoolctl " + command in out.stdout
    assert "Exit codes:" in out.stdout and "--json" in out.stdout


def test_top_level_help():
    out = subprocess.run([sys.executable, "-m", "kvpoold.ctl", "--help"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "Exit codes:" in out.stdout
    for command in COMMANDS:
        assert command in out.stdout
