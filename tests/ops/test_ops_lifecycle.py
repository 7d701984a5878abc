"""Configuration errors, SIGHUP reloads and graceful SIGTERM, against real kvpoold processes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

import kvpool
from opskit import LAYOUT, run_ctl, wait_until


def kvpoold(*args, env=None):
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("KVPOOL_")}, **(env or {})}
    return subprocess.run([sys.executable, "-m", "kvpoold", *args], capture_output=True, text=True,
                          timeout=60, env=env)


# -- configuration ------------------------------------------------------------------------------
@pytest.mark.parametrize("args, env, message", [
    (["--max-blocks-per-session", "-5"], {}, "max_blocks_per_session = -5 (from --max-blocks-per-session): must be >= 0"),
    ([], {"KVPOOL_SHUTDOWN_TIMEOUT": "soon"}, "shutdown_timeout = 'soon' (from $KVPOOL_SHUTDOWN_TIMEOUT)"),
    ([], {"KVPOOL_SHUTDOWN_TIMEOUT": "-1"}, "shutdown_timeout = -1.0 (from $KVPOOL_SHUTDOWN_TIMEOUT): must be >= 0"),
    (["--socket-group", "no-such-group-kvpool"], {}, "socket_group = 'no-such-group-kvpool' (from --socket-group): no such group"),
    (["--socket", "/tmp/a.sock", "--admin-socket", "/tmp/a.sock"], {}, "admin_socket = '/tmp/a.sock' (from --admin-socket): must differ from socket"),
    (["--admin-socket-mode", "9"], {}, "admin_socket_mode = '9' (from --admin-socket-mode)"),
    (["--metrics-port", "70000"], {}, "metrics_port = 70000 (from --metrics-port): must be a TCP port"),
])
def test_config_errors_name_key_value_and_source(args, env, message):
    out = kvpoold(*args, "--check-config", env=env)
    assert out.returncode == 2, out.stdout
    assert out.stderr.startswith("kvpoold: bad configuration: ") and message in out.stderr, out.stderr
    assert out.stderr.count("\n") == 1


def test_config_file_errors_and_precedence(tmp_path):
    cfg = tmp_path / "kvpoold.toml"
    cfg.write_text('max_blocks_per_session = -1\n')
    out = kvpoold("--config", str(cfg), "--check-config")
    assert out.returncode == 2 and f"max_blocks_per_session = -1 (from {cfg}): must be >= 0" in out.stderr
    cfg.write_text('max_blocks_per_session = 10\nshutdown_timeout = 3\nadmin_socket = "none"\n')
    data = json.loads(kvpoold("--config", str(cfg), "--check-config").stdout)
    assert data["max_blocks_per_session"] == 10 and data["shutdown_timeout"] == 3 and data["admin_socket"] == "none"
    data = json.loads(kvpoold("--config", str(cfg), "--check-config", env={"KVPOOL_MAX_BLOCKS_PER_SESSION": "20"}).stdout)
    assert data["max_blocks_per_session"] == 20  # environment beats the file
    out = kvpoold("--config", str(cfg), "--max-blocks-per-session", "30", "--check-config",
                  env={"KVPOOL_MAX_BLOCKS_PER_SESSION": "20"})
    assert json.loads(out.stdout)["max_blocks_per_session"] == 30  # flags beat the environment


def test_start_failure_is_one_line_exit_2(daemon, tmp_path):
    """A second daemon on the same socket, and a metrics port already taken."""
    out = kvpoold("--socket", daemon.socket, "--pool-bytes", "64MiB", "--chunk-bytes", "64KiB")
    assert out.returncode == 2 and "another kvpoold" in out.stderr and out.stderr.count("\n") == 1
    import socket as so

    with so.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        out = kvpoold("--socket", str(tmp_path / "k.sock"), "--pool-bytes", "64MiB", "--chunk-bytes", "64KiB",
                      "--metrics-port", str(port))
    assert out.returncode == 2 and f"cannot serve metrics on 127.0.0.1:{port}" in out.stderr, out.stderr
    assert not (tmp_path / "k.sock").exists() and not (tmp_path / "k-admin.sock").exists()  # cleaned up


# -- SIGHUP -------------------------------------------------------------------------------------
def test_sighup_changes_live_settings_and_names_the_others(daemon_factory, tmp_path):
    cfg = tmp_path / "kvpoold.toml"
    cfg.write_text('log_level = "info"\ngrace_seconds = 1\npool_bytes = "64MiB"\nchunk_bytes = "64KiB"\n')
    d = daemon_factory(start=False)
    d.args = ["--socket", d.socket, "--config", str(cfg)]  # no flags for what the file should change
    d.start()
    conf = json.loads(run_ctl(d.socket, "config", "--json").stdout)["config"]
    assert conf["log_level"] == "info" and conf["grace_seconds"] == 1

    cfg.write_text('log_level = "debug"\ngrace_seconds = 7.5\nmax_blocks_per_session = 99\n'
                   'pool_bytes = "32MiB"\nchunk_bytes = "64KiB"\n')
    os.kill(d.proc.pid, signal.SIGHUP)
    wait_until(lambda: "reload: changed" in d.output(), what="the reload")
    out = d.output()
    assert "reload: changed grace_seconds 1.0 -> 7.5, log_level 'info' -> 'debug', max_blocks_per_session 0 -> 99" in out
    assert "pool_bytes cannot change while kvpoold runs (running 67108864, configured 33554432)" in out
    conf = json.loads(run_ctl(d.socket, "config", "--json").stdout)["config"]
    assert conf["log_level"] == "debug" and conf["grace_seconds"] == 7.5 and conf["max_blocks_per_session"] == 99
    assert conf["pool_bytes"] == 64 << 20  # what runs, not what the file says
    with kvpool.connect(d.socket, name="dbg", layout=LAYOUT) as c:
        assert c.grace_seconds == 7.5
    wait_until(lambda: " DEBUG " in d.output(), what="debug lines after the reload")

    cfg.write_text('log_level = "loud"\n')  # a bad reload keeps the running configuration
    os.kill(d.proc.pid, signal.SIGHUP)
    wait_until(lambda: "reload failed, keeping the running configuration" in d.output(), what="the bad reload")
    assert "log_level = 'loud'" in d.output()
    assert json.loads(run_ctl(d.socket, "config", "--json").stdout)["config"]["log_level"] == "debug"
    assert d.proc.poll() is None and d.stop() == 0


# -- SIGTERM ------------------------------------------------------------------------------------
def test_sigterm_tells_clients_waits_for_them_and_exits_0(daemon_factory):
    d = daemon_factory("--shutdown-timeout", "20")
    c = kvpool.connect(d.socket, name="finishing", layout=LAYOUT)
    seq = c.create_sequence(range(6))
    t0 = time.monotonic()
    d.proc.send_signal(signal.SIGTERM)
    assert c.daemon_shutting_down.wait(10)  # told through the Watch stream
    with pytest.raises(kvpool.KvpoolError, match="shutting down"):
        kvpool.connect(d.socket, name="late", layout=LAYOUT)  # no new attaches
    with grpc.insecure_channel("unix://" + d.socket) as ch:
        r = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert r.status == health_pb2.HealthCheckResponse.NOT_SERVING
    c.extend({seq: [1, 2, 3]})  # a client may finish its work
    assert seq.num_tokens == 9
    assert d.proc.poll() is None  # still waiting for the client
    c.close()
    assert d.proc.wait(15) == 0
    assert time.monotonic() - t0 < 15
    out = d.output()
    assert "stopping: telling 1 clients, waiting up to 20s" in out and "all clients detached" in out
    assert not os.path.exists(d.socket) and not os.path.exists(d.socket.replace(".sock", "-admin.sock"))


def test_sigterm_stops_after_shutdown_timeout(daemon_factory):
    d = daemon_factory("--shutdown-timeout", "1")
    c = kvpool.connect(d.socket, name="stubborn", layout=LAYOUT)
    c.create_sequence(range(6))
    t0 = time.monotonic()
    assert d.stop() == 0
    assert 0.9 < time.monotonic() - t0 < 10
    assert "stopping after 1s with 1 sessions still attached: 1 (stubborn" in d.output()
    c.close()  # the daemon is gone: closing is still quiet


def test_second_signal_stops_waiting(daemon_factory):
    d = daemon_factory("--shutdown-timeout", "60")
    c = kvpool.connect(d.socket, name="stubborn", layout=LAYOUT)
    d.proc.send_signal(signal.SIGTERM)
    assert c.daemon_shutting_down.wait(10)
    d.proc.send_signal(signal.SIGINT)
    assert d.proc.wait(10) == 0
    assert "stopping after a second signal" in d.output()
    c.close()
