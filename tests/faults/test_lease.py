"""Leases: a frozen client loses its session; a busy or idle one keeps it.

A SIGSTOPped process keeps its socket and its pid, so neither the Watch stream
nor the pid check notices it: the lease does.  The clients here are real
processes (``lease_worker.py``) against a real daemon.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import kvpool
from kvpoold.server.sessions import SessionRegistry

psutil_linux = pytest.importorskip("psutil._pslinux")

WORKER = str(Path(__file__).with_name("lease_worker.py"))
LEASE = 1.5


def _worker(d):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")]))
    p = subprocess.Popen([sys.executable, WORKER, d.socket], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, env=env)
    first = p.stdout.readline().split()
    if first[:1] != ["ready"]:
        p.kill()
        raise AssertionError(f"the worker did not start: {p.communicate()[1]}")
    return p, int(first[1])


def _ask(p, command: str) -> str:
    p.stdin.write(command + "\n")
    p.stdin.flush()
    return p.stdout.readline().strip()


def _stop(p) -> None:
    if p.poll() is None:
        try:
            _ask(p, "quit")
            p.wait(10)
        except (OSError, subprocess.TimeoutExpired):
            p.kill()
            p.wait()


def test_idle_and_busy_clients_keep_their_lease(daemon_factory):
    d = daemon_factory("--lease-seconds", str(LEASE))
    p, sid = _worker(d)
    try:
        time.sleep(3 * LEASE)  # idle: no call but the heartbeats
        assert _ask(p, f"busy {3 * LEASE}") == "busy done"  # the client's lock held, the GIL busy, no calls
        assert _ask(p, "call") == "ok expired=False"
        with kvpool.Connection(d.socket) as conn:
            (info,) = conn.clients()
            assert info.session_id == sid and info.sequences == 3
        assert "dropped" not in d.output()
    finally:
        _stop(p)


def test_frozen_client_loses_its_session_and_is_told_on_resume(daemon_factory):
    d = daemon_factory("--lease-seconds", str(LEASE))
    p, sid = _worker(d)
    try:
        with kvpool.Connection(d.socket) as conn:
            assert conn.stats().classes[0].used_blocks > 0
            os.kill(p.pid, signal.SIGSTOP)
            stopped_at = time.monotonic()
            try:
                deadline = stopped_at + LEASE + 30
                while time.monotonic() < deadline:
                    st = conn.stats()
                    if st.clients == 0:
                        break
                    time.sleep(0.1)
                gone_after = time.monotonic() - stopped_at
                assert st.clients == 0 and st.sequences == 0, "a frozen client kept its session"
                assert gone_after < LEASE + 5.0, gone_after  # lease + reaper period, with room for a noisy machine
                for c in st.classes:  # a class with nothing cached left is reclaimed with its session
                    assert c.used_blocks == 0 and c.reserved_blocks == 0
                    assert c.cached_blocks + c.free_blocks == c.total_blocks
                ok, detail = conn.check()
                assert ok, detail
                assert p.poll() is None, "the client process must still exist (frozen, not dead)"
                assert f"session {sid} (lease-worker, pid {p.pid}) dropped: no call or heartbeat" in d.output()
            finally:
                os.kill(p.pid, signal.SIGCONT)
        reply = _ask(p, "call")
        assert reply.startswith("SessionExpired: ") and f"session {sid} ended" in reply, reply
        assert "lease_seconds" in reply and "attach again" in reply, reply
        time.sleep(LEASE / 3 + 1.0)  # the heartbeat thread has run once since SIGCONT
        assert _ask(p, "call").endswith("expired=True")
        # the daemon serves a new client
        with kvpool.connect(d.socket, name="after", layout=_layout()) as c2:
            assert c2.create_sequence(range(10)).num_tokens == 10
    finally:
        _stop(p)


def _layout():
    from faultkit import LAYOUT

    return LAYOUT


def test_lease_bookkeeping():
    now = [100.0]
    reg = SessionRegistry(8, clock=lambda: now[0])
    a = reg.add("a", os.getpid(), "m", 0)
    b = reg.add("b", os.getpid(), "m", 0)
    now[0] += 0.5
    assert reg.lapsed(2.0) == []
    reg.get(a.token)  # any call renews the lease
    now[0] += 0.6
    assert reg.lapsed(2.0) == []
    now[0] += 0.6
    assert reg.lapsed(2.0) == []  # b: 1.7 s
    now[0] += 0.6
    (lapsed,) = reg.lapsed(2.0)  # b: 2.3 s, a: 1.8 s
    assert lapsed[0] is b and "lease_seconds=2" in lapsed[1]
    assert reg.lapsed(0) == []  # 0: no lease
    reg.remove(b)
    with pytest.raises(Exception, match=f"session {b.id} ended: no call or heartbeat .*attach again"):
        reg.get(b.token)
    # the daemon itself stalled (reaper not run for long): no session is blamed for it
    now[0] += 50.0
    assert reg.lapsed(2.0) == []
    now[0] += 0.5
    assert reg.lapsed(2.0) == []


def test_a_live_client_stays_through_a_clock_step_and_a_dead_one_is_gone(monkeypatch):
    # A name with spaces and parentheses, as /proc/<pid>/stat shows it ("(a) b (c)").
    child = subprocess.Popen([sys.executable, "-c", "import sys, time; open('/proc/self/comm', 'w').write('a) b (c');"
                              " print(flush=True); time.sleep(60)"], stdout=subprocess.PIPE, text=True)
    try:
        child.stdout.readline()  # its name is set
        reg = SessionRegistry(8)
        me, other = reg.add("me", os.getpid(), "m", 0), reg.add("child", child.pid, "m", 0)
        for s in (me, other):
            reg.stream_opened(s)
        assert me.pid_started is not None and other.pid_started is not None
        # The wall clock steps (the kernel's boot time, as it reports it, moves with it).
        real = psutil_linux.boot_time
        monkeypatch.setattr(psutil_linux, "boot_time", lambda: real() + 1.0)
        assert reg.expired(grace_seconds=5.0) == []
        child.kill()
        child.wait()
        ((gone, why),) = reg.expired(grace_seconds=5.0)
        assert gone is other and why == f"process {child.pid} is gone"
    finally:
        child.kill()
        child.wait()


def test_lease_seconds_is_validated(tmp_path):
    def check(*args):
        return subprocess.run([sys.executable, "-m", "kvpoold", "--check-config", *args], capture_output=True,
                              text=True, env={k: v for k, v in os.environ.items() if not k.startswith("KVPOOL_")},
                              cwd=tmp_path)

    out = check("--lease-seconds", "-1")
    assert out.returncode == 2 and "lease_seconds" in out.stderr, out.stderr
    out = check("--lease-seconds", "0")
    assert out.returncode == 0 and '"lease_seconds": 0.0' in out.stdout, out.stdout
