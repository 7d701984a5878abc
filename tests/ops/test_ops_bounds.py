"""Values that pass a naive check but break the daemon or kvpoolctl: refused at once with one line, exit 2."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time

import psutil
import pytest

from opskit import run_ctl

KVPOOLD = [sys.executable, "-m", "kvpoold"]
CTL = [sys.executable, "-m", "kvpoold.ctl"]


def _env() -> dict:
    return {k: v for k, v in os.environ.items() if not k.startswith("KVPOOL_")}


def _run(cmd: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=_env())


def _one_line_exit_2(r: subprocess.CompletedProcess, *needles: str) -> None:
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    assert "Traceback" not in r.stderr, r.stderr
    for needle in needles:
        assert needle in r.stderr, r.stderr


@pytest.mark.parametrize("flag, value, needle", [
    ("--max-reserve-blocks", "5000000000", "max_reserve_blocks"),
    ("--max-sessions", "99999999999", "max_sessions"),
    ("--max-blocks-per-session", "18446744073709551616", "max_blocks_per_session"),
    ("--max-sequences-per-session", "3000000000", "max_sequences_per_session"),
    ("--max-tokens-per-call", "3000000000", "max_tokens_per_call"),
    ("--max-tokens-per-call", "40000000", "gRPC message limit"),
    ("--grace-seconds", "nan", "grace_seconds"),
    ("--grace-seconds", "inf", "grace_seconds"),
    ("--shutdown-timeout", "nan", "shutdown_timeout"),
    ("--shutdown-timeout", "1e300", "shutdown_timeout"),
    ("--lease-seconds", "nan", "lease_seconds"),
    ("--gpu-memory-fraction", "nan", "gpu_memory_fraction"),
    ("--host-bytes", "1000TiB", "host_bytes"),
    ("--max-tickets-per-user", "-1", "max_tickets_per_user = -1 (from --max-tickets-per-user): must be >= 0"),
    ("--max-sessions-per-user", "-2", "max_sessions_per_user"),
    ("--max-handoff-connections-per-user", "3000000000", "max_handoff_connections_per_user"),
    ("--handoff-timeout", "0", "handoff_timeout = 0.0 (from --handoff-timeout): must be in (0, 3600]"),
    ("--max-pool-share-per-user", "1.5", "max_pool_share_per_user"),
    ("--fair-share", "maybe", "fair_share = 'maybe' (from --fair-share): expected true or false"),
    ("--grpc-idle-seconds", "nan", "grpc_idle_seconds"),
    ("--max-grpc-connections", "-1", "max_grpc_connections"),
    ("--max-grpc-streams", "200", "max_grpc_streams = 200 (from --max-grpc-streams): must be above"),
    ("--max-message-bytes", "1MiB", "max_message_bytes = 1048576 (from --max-message-bytes): is below the"),
])
def test_out_of_range_values_are_refused_at_start(flag, value, needle):
    r = _run([*KVPOOLD, "--socket", "/tmp/kvpool-never.sock", flag, value, "--check-config"])
    _one_line_exit_2(r, needle)
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_nan_in_the_config_file_is_refused_and_check_config_prints_json(tmp_path):
    f = tmp_path / "k.toml"
    f.write_text("grace_seconds = nan\n")
    _one_line_exit_2(_run([*KVPOOLD, "--config", str(f), "--check-config"]), "grace_seconds", "finite")
    f.write_text("grace_seconds = 2.5\n")
    r = _run([*KVPOOLD, "--config", str(f), "--socket", "/tmp/kvpool-never.sock", "--check-config"])
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout, parse_constant=lambda c: pytest.fail(f"not JSON: {c}"))["grace_seconds"] == 2.5


def test_socket_paths_longer_than_sun_path_are_refused():
    long = "/tmp/" + "s" * 120 + ".sock"
    _one_line_exit_2(_run([*KVPOOLD, "--socket", long, "--check-config"]), "socket", "107 bytes")
    ok = "/tmp/" + "s" * 80 + ".sock"  # fits, but its auto admin socket "<base>-admin.sock" may not
    _one_line_exit_2(_run([*KVPOOLD, "--socket", "/tmp/x.sock", "--admin-socket", long, "--check-config"]),
                     "admin_socket")
    assert _run([*KVPOOLD, "--socket", ok, "--check-config"]).returncode == 0


def test_non_utf8_config_file_is_one_line(tmp_path):
    f = tmp_path / "bad.toml"
    f.write_bytes(b"socket = \"/tmp/\xff\xfe.sock\"\n")
    _one_line_exit_2(_run([*KVPOOLD, "--config", str(f), "--check-config"]), str(f))
    _one_line_exit_2(_run([*CTL, "--config", str(f), "stats"]), str(f))


def test_sighup_with_a_non_utf8_config_keeps_the_daemon(daemon_factory, tmp_path):
    f = tmp_path / "k.toml"
    f.write_text("grace_seconds = 2\n")
    d = daemon_factory("--config", str(f))
    f.write_bytes(b"grace_seconds = 3\n# \xff\n")
    d.proc.send_signal(signal.SIGHUP)
    deadline = time.monotonic() + 20
    while "reload failed" not in d.output() and time.monotonic() < deadline:
        time.sleep(0.05)
    out = d.output()
    assert "reload failed, keeping the running configuration" in out, out
    assert "Traceback" not in out, out
    assert d.proc.poll() is None
    assert run_ctl(d.socket, "stats", "--json").returncode == 0


@pytest.mark.parametrize("args", [
    ["--timeout", "-1", "stats"],
    ["--timeout", "0", "stats"],
    ["--timeout", "nan", "stats"],
    ["--timeout", "inf", "stats"],
    ["sequences", "99999999999999999999999"],
    ["evict", "--class", "99999999999"],
    ["evict", "--max-blocks", "99999999999999999999999"],
    ["drain", "--wait", "--wait-timeout", "nan"],
    ["stats", "--watch", "inf"],
])
def test_kvpoolctl_refuses_values_the_wire_cannot_carry(daemon, args):
    r = subprocess.run([*CTL, "--socket", daemon.socket, *args], capture_output=True, text=True, timeout=60,
                       env=_env())
    _one_line_exit_2(r, "Invalid value")


def test_host_bytes_over_the_machine_is_refused():
    total = psutil.virtual_memory().total
    _one_line_exit_2(_run([*KVPOOLD, "--socket", "/tmp/kvpool-never.sock", "--host-bytes", str(total * 2),
                           "--check-config"]), "host_bytes", "memory")


def test_host_tier_refused_by_the_kernel_is_one_line(tmp_path):
    """host_bytes within the machine's memory, but the kernel refuses it (ENOMEM): here, an address-space limit."""
    import resource

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (6 << 30, 6 << 30))

    if psutil.virtual_memory().total < 8 << 30:
        pytest.skip("needs a machine with at least 8 GiB, so that validation lets host_bytes = 8GiB through")
    r = subprocess.run([*KVPOOLD, "--socket", str(tmp_path / "k.sock"), "--pool-bytes", "64MiB", "--chunk-bytes",
                        "64KiB", "--host-bytes", "8GiB"], capture_output=True, text=True, timeout=60, env=_env(),
                       preexec_fn=limit)
    _one_line_exit_2(r, "host tier", "host_bytes")
