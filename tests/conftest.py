"""Fixtures shared by every test folder: a real kvpoold in a real process."""

from __future__ import annotations

import pytest

from daemonlib import Daemon


@pytest.fixture
def daemon_factory():
    started: list[Daemon] = []

    def make(*args: str, start: bool = True, **kw) -> Daemon:
        d = Daemon(*args, **kw)
        started.append(d)
        return d.start() if start else d

    yield make
    for d in started:
        d.stop()


@pytest.fixture
def daemon(daemon_factory) -> Daemon:
    return daemon_factory()
