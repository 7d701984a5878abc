"""systemd integration: readiness, reload, stop and watchdog notifications.

The notify protocol itself is the ``sdnotify`` library's; this only decides
what to say and when.  Without ``$NOTIFY_SOCKET`` (not started by systemd)
every call does nothing.  The watchdog is armed when systemd sets
``$WATCHDOG_USEC`` (``WatchdogSec=`` in the unit) for this process
(``$WATCHDOG_PID``, when set, must be ours); the daemon then pings at half
that interval from its event loop, so a stuck loop is a missed ping and
systemd restarts the daemon.
"""

from __future__ import annotations

import os
import time
from typing import Mapping

import sdnotify


class Notifier:
    def __init__(self, env: Mapping[str, str] | None = None) -> None:
        env = os.environ if env is None else env
        self.enabled = bool(env.get("NOTIFY_SOCKET"))
        self._sd = sdnotify.SystemdNotifier() if self.enabled else None
        self.watchdog_interval: float | None = None
        usec, pid = env.get("WATCHDOG_USEC"), env.get("WATCHDOG_PID")
        if self.enabled and usec and usec.isdigit() and int(usec) > 0:
            if not pid or (pid.isdigit() and int(pid) == os.getpid()):
                self.watchdog_interval = int(usec) / 2e6

    def _send(self, *lines: str) -> None:
        if self._sd is not None:
            self._sd.notify("\n".join(lines))

    def ready(self, status: str) -> None:
        self._send("READY=1", f"STATUS={status}", f"MAINPID={os.getpid()}")

    def reloading(self) -> None:
        self._send("RELOADING=1", f"MONOTONIC_USEC={time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000}")

    def stopping(self, status: str) -> None:
        self._send("STOPPING=1", f"STATUS={status}")

    def status(self, status: str) -> None:
        self._send(f"STATUS={status}")

    def watchdog(self) -> None:
        self._send("WATCHDOG=1")
