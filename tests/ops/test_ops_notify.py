"""systemd notifications from a real daemon: READY once attaches work, watchdog pings, reload, stop."""

from __future__ import annotations

import os
import signal

import kvpool
from opskit import LAYOUT


def test_ready_watchdog_reload_and_stopping(daemon_factory, notify_socket):
    d = daemon_factory(env={"NOTIFY_SOCKET": notify_socket.path, "WATCHDOG_USEC": "200000"})
    msgs = notify_socket.wait_for("READY=1")
    ready = next(m for m in msgs if "READY=1" in m.split("\n"))
    assert f"MAINPID={d.proc.pid}" in ready and "STATUS=serving" in ready
    with kvpool.connect(d.socket, name="after-ready", layout=LAYOUT) as c:  # READY means attaches work
        c.create_sequence(range(5))
    notify_socket.wait_for("WATCHDOG=1", count=3, timeout=10)  # every 0.1s with WatchdogSec=0.2s

    os.kill(d.proc.pid, signal.SIGHUP)
    notify_socket.wait_for("RELOADING=1")
    msgs = notify_socket.wait_for("READY=1", count=2)
    reloading = next(i for i, m in enumerate(msgs) if "RELOADING=1" in m.split("\n"))
    assert any("MONOTONIC_USEC=" in m for m in msgs[reloading:reloading + 1])
    assert any("READY=1" in m.split("\n") for m in msgs[reloading + 1:])

    assert d.stop() == 0
    notify_socket.wait_for("STOPPING=1")


def test_no_watchdog_for_another_pid(daemon_factory, notify_socket):
    """$WATCHDOG_PID names the process systemd watches: a child of it must not ping."""
    d = daemon_factory(env={"NOTIFY_SOCKET": notify_socket.path, "WATCHDOG_USEC": "100000", "WATCHDOG_PID": "1"})
    notify_socket.wait_for("READY=1")
    assert d.proc.poll() is None
    import time

    time.sleep(0.5)
    notify_socket.sock.settimeout(0.2)
    try:
        while True:
            notify_socket.messages.append(notify_socket.sock.recv(4096).decode())
    except TimeoutError:
        pass
    assert not any("WATCHDOG=1" in m for m in notify_socket.messages)


def test_no_notify_socket_no_harm(daemon):
    """Started by hand (no $NOTIFY_SOCKET) the daemon runs the same, logging with timestamps."""
    with kvpool.connect(daemon.socket, name="plain", layout=LAYOUT) as c:
        c.create_sequence(range(3))
    assert daemon.stop() == 0
    assert " INFO kvpoold: attach: session 1" in daemon.output()


def test_journal_gets_priority_prefixes(daemon_factory):
    """When stdout is the journal ($JOURNAL_STREAM names it), each line carries its syslog priority."""
    d = daemon_factory(start=False)
    open(d.log, "w").close()
    st = os.stat(d.log)
    d.env["JOURNAL_STREAM"] = f"{st.st_dev}:{st.st_ino}"
    d.start()
    with kvpool.connect(d.socket, name="j", layout=LAYOUT):
        pass
    assert d.stop() == 0
    lines = d.output().splitlines()
    assert "<6>kvpoold: attach: session 1 (j," in "\n".join(lines)
    assert all(ln.startswith("<") or ln.startswith("kvpoold ready") for ln in lines), lines
