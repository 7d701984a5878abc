"""Daemon restart: a clear UNAVAILABLE, and ``connect(reconnect=True)`` retries with backoff."""

from __future__ import annotations

import threading
import time

import pytest

import kvpool
from faultkit import LAYOUT


def test_connect_without_reconnect_fails_at_once(daemon_factory):
    d = daemon_factory(start=False)
    t0 = time.monotonic()
    with pytest.raises(kvpool.Unavailable):
        kvpool.connect(d.socket, name="r", layout=LAYOUT)
    assert time.monotonic() - t0 < 10


def test_reconnect_waits_for_a_daemon_that_starts_later(daemon_factory):
    d = daemon_factory(start=False)
    threading.Timer(1.0, d.start).start()
    t0 = time.monotonic()
    with kvpool.connect(d.socket, name="r", layout=LAYOUT, reconnect=True, timeout=30) as c:
        assert time.monotonic() - t0 >= 0.9
        assert c.create_sequence(range(9)).num_tokens == 9


def test_reconnect_gives_up_after_timeout(daemon_factory):
    d = daemon_factory(start=False)
    t0 = time.monotonic()
    with pytest.raises(kvpool.Unavailable):
        kvpool.connect(d.socket, name="r", layout=LAYOUT, reconnect=True, timeout=1.5)
    assert 1.2 < time.monotonic() - t0 < 15


def test_restart_unavailable_then_reconnect(daemon_factory):
    d = daemon_factory("--shutdown-timeout", "0.5")  # a restart does not wait long for attached clients
    old = kvpool.connect(d.socket, name="before", layout=LAYOUT)
    old.create_sequence(range(9))
    d.stop()
    with pytest.raises(kvpool.Unavailable):
        old.create_sequence(range(5))  # a clear UNAVAILABLE while the daemon is down
    threading.Timer(0.5, d.start).start()
    with kvpool.connect(d.socket, name="after", layout=LAYOUT, reconnect=True, timeout=30) as c:
        c.create_sequence(range(9))
        with pytest.raises(kvpool.SessionExpired):
            old.create_sequence(range(5))  # the old session did not survive the restart
        ok, detail = kvpool.Connection(d.socket).check()
        assert ok, detail
    try:
        old.close()
    except kvpool.KvpoolError:
        pass
