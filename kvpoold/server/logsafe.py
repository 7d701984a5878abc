"""What clients cause, made safe to log: their strings, and events they can repeat at will.

A client chooses its name, model id, revision and extra keys.  Logged as is, a
newline forges a log line (``x\\nERROR ...``) and a megabyte name fills the
journal.  ``printable`` escapes control and non-printable characters the way
``repr`` does and keeps at most ``limit`` characters, marking what it cut.

A client can also make an event happen thousands of times a second (a refused
connection, ``accept`` failing while the daemon is out of file descriptors).
``Throttled`` logs such an event at once the first time, then at most once per
interval with how many happened in between.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time

DEFAULT_LIMIT = 200
THROTTLE_SECONDS = 10.0


def printable(s: object, limit: int = DEFAULT_LIMIT) -> str:
    """``s`` with control characters escaped (``\\n``, ``\\x1b``...), cut to ``limit`` characters."""
    text = s.decode("utf-8", "replace") if isinstance(s, (bytes, bytearray)) else str(s)
    cut = len(text) - limit if len(text) > limit else 0
    if cut:
        text = text[:limit]
    out = "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)
    return f"{out}...[{cut} more chars]" if cut else out


class Throttled:
    """One kind of repeated warning: the first logged at once, the rest counted and logged once per ``interval``.

    Called on the event loop (the count is flushed by a timer on it).
    """

    def __init__(self, logger: logging.Logger, what: str, interval: float = THROTTLE_SECONDS) -> None:
        self.log, self.what, self.interval = logger, what, interval
        self._pending = 0  # noted since the last line
        self._detail = ""
        self._logged_at = -math.inf
        self._timer: asyncio.TimerHandle | None = None

    def note(self, detail: str) -> None:
        """One more event; ``detail`` says what happened this time (the latest one is logged)."""
        now = time.monotonic()
        if not self._pending and now - self._logged_at >= self.interval:
            self._logged_at = now
            self.log.warning("%s: %s", self.what, detail)
            return
        self._pending += 1
        self._detail = detail
        if self._timer is None:
            delay = max(0.0, self._logged_at + self.interval - now)
            self._timer = asyncio.get_running_loop().call_later(delay, self._flush)

    def _flush(self) -> None:
        self._timer = None
        if self._pending:
            self.log.warning("%s: %s (%d times in the last %.0fs)", self.what, self._detail, self._pending,
                             self.interval)
            self._pending = 0
            self._logged_at = time.monotonic()
