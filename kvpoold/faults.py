"""Failpoints: inject I/O faults at named places, for tests of the daemon under faults.

A real disk that fails or fills up is hard to get on a test machine without
root, so the disk tier's write and read calls pass through named failpoints
that the ``KVPOOLD_FAILPOINTS`` environment variable can arm when the daemon
starts.  Unset (the default, and always in production), every failpoint is
``None`` and a call site costs one comparison with ``None``.

Syntax: ``point=action[:after=N][:times=M]``, several separated by ``,``.

* ``action`` is an errno name (``EIO``, ``ENOSPC``, ...): the call raises
  ``OSError`` with that errno, as the kernel would; or ``sleep=S``: the call
  first waits ``S`` seconds (an I/O that takes long: operations stay in
  flight, so tests can interrupt them).
* ``after=N``: the first ``N`` hits pass untouched (a disk that fills up
  after ``N`` writes).
* ``times=M``: only ``M`` hits fail, then the point passes again (a transient
  fault); default: every hit from then on.

Points: ``disk.write`` (one batch of blocks written to a data file),
``disk.read`` (one batch read).  Example::

    KVPOOLD_FAILPOINTS="disk.write=ENOSPC:after=8,disk.read=EIO:times=1" kvpoold ...

A malformed value stops the daemon at start (``FailpointError``), so a test
never runs without the fault it asked for.
"""

from __future__ import annotations

import errno
import logging
import os
import threading
import time

from kvpoold.config import ConfigError

ENV = "KVPOOLD_FAILPOINTS"
POINTS = ("disk.write", "disk.read")

log = logging.getLogger("kvpoold")


class FailpointError(ConfigError):
    """``KVPOOLD_FAILPOINTS`` does not parse; the message says what is wrong (a configuration error)."""


class Failpoint:
    """One armed point; calling it may raise ``OSError`` or sleep.  Thread-safe (I/O threads call it)."""

    def __init__(self, name: str, errno_: int | None, sleep: float, after: int, times: int | None) -> None:
        self.name, self.errno, self.sleep, self.after, self.times = name, errno_, sleep, after, times
        self.hits = 0  # calls so far
        self.fired = 0  # calls that failed or slept
        self._lock = threading.Lock()

    def __call__(self) -> None:
        with self._lock:
            self.hits += 1
            if self.hits <= self.after or (self.times is not None and self.fired >= self.times):
                return
            self.fired += 1
        if self.sleep:
            time.sleep(self.sleep)
        if self.errno is not None:
            raise OSError(self.errno, f"{os.strerror(self.errno)} (failpoint {self.name})")


def parse(spec: str) -> dict[str, Failpoint]:
    out: dict[str, Failpoint] = {}
    for item in filter(None, (s.strip() for s in spec.split(","))):
        name, sep, rest = item.partition("=")
        if not sep or name not in POINTS:
            raise FailpointError(f"{ENV}: {item!r}: expected point=action with a point in {', '.join(POINTS)}")
        action, *opts = rest.split(":")
        code, sleep, after, times = None, 0.0, 0, None
        try:
            if action.startswith("sleep="):
                sleep = float(action[6:])
            elif hasattr(errno, action) and action.startswith("E"):
                code = getattr(errno, action)
            else:
                raise ValueError(f"unknown action {action!r} (an errno name such as EIO, or sleep=S)")
            for opt in opts:
                key, _, value = opt.partition("=")
                if key == "after":
                    after = int(value)
                elif key == "times":
                    times = int(value)
                else:
                    raise ValueError(f"unknown option {key!r} (after=N, times=M)")
        except ValueError as exc:
            raise FailpointError(f"{ENV}: {item!r}: {exc}") from None
        out[name] = Failpoint(name, code, sleep, after, times)
    return out


ARMED: dict[str, Failpoint] = parse(os.environ.get(ENV, ""))


def check_environment() -> None:
    """Raise ``FailpointError`` if ``KVPOOLD_FAILPOINTS`` does not parse (the daemon's start-up checks)."""
    parse(os.environ.get(ENV, ""))


def announce() -> None:
    """Say in the daemon's log that faults are armed (called where the points are used)."""
    if ARMED:
        log.warning("failpoints armed (%s=%s): for tests only", ENV, os.environ.get(ENV, ""))


def point(name: str) -> Failpoint | None:
    """The armed failpoint called ``name``, or None (the call site then does nothing)."""
    assert name in POINTS, name
    return ARMED.get(name)
