"""Throughput counters of the transfer engine: bytes, blocks and busy wall time.

``busy_seconds`` is the wall time during which at least one copy of that
kind was running (overlapping copies are not counted twice), so
``bytes / busy_seconds`` is the rate the tier delivered while it worked.
Worker threads update meters, hence the lock.
"""

from __future__ import annotations

import threading
import time


class Meter:
    __slots__ = ("bytes", "blocks", "busy_seconds", "_active", "_since", "_lock")

    def __init__(self) -> None:
        self.bytes = 0
        self.blocks = 0
        self.busy_seconds = 0.0
        self._active = 0
        self._since = 0.0
        self._lock = threading.Lock()

    def start(self) -> float:
        now = time.perf_counter()
        with self._lock:
            if self._active == 0:
                self._since = now
            self._active += 1
        return now

    def stop(self, nbytes: int, blocks: int) -> None:
        now = time.perf_counter()
        with self._lock:
            self._active -= 1
            if self._active == 0:
                self.busy_seconds += now - self._since
            self.bytes += nbytes
            self.blocks += blocks

    def add(self, nbytes: int, blocks: int, seconds: float) -> None:
        """A copy timed elsewhere (CUDA events)."""
        with self._lock:
            self.bytes += nbytes
            self.blocks += blocks
            self.busy_seconds += seconds

    @property
    def gbps(self) -> float:
        return self.bytes / self.busy_seconds / 1e9 if self.busy_seconds > 0 else 0.0


class Meters:
    """The four directions the engine moves bytes in."""

    def __init__(self) -> None:
        self.host_write = Meter()  # device -> host (demotions, swap-outs)
        self.host_read = Meter()  # host -> device (promotions, swap-ins)
        self.disk_write = Meter()  # host/device -> disk
        self.disk_read = Meter()  # disk -> device
