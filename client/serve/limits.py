"""What one client may take of a kvpool serve process: the size of a request body, a place in the queue."""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

from ..errors import InvalidArgument

DEFAULT_MAX_BODY_BYTES = 2 * 1024 * 1024
DEFAULT_MAX_WAITING_REQUESTS = 512
#: what a refused client is told to wait before it tries again (seconds)
RETRY_AFTER_S = 1


@dataclass(frozen=True)
class ServeLimits:
    """``max_body_bytes``: the largest request body read (larger ones get 413).  ``max_waiting_requests``:
    requests waiting for a place in the running batch (being parsed and tokenized, or queued in the engine)
    beyond which new ones get 429."""

    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    max_waiting_requests: int = DEFAULT_MAX_WAITING_REQUESTS

    def __post_init__(self) -> None:
        for name in ("max_body_bytes", "max_waiting_requests"):
            if getattr(self, name) < 1:
                raise InvalidArgument(f"{name} must be >= 1; got {getattr(self, name)}")


class QueueFull(Exception):
    """Answered 429 with a Retry-After header."""


class Admission:
    """Counts the requests that wait for a place in the running batch and refuses new ones past the limit.

    A request waits from its arrival while it is parsed and tokenized (``preparing``, counted here), then in
    the engine's queue until the scheduler admits it (``EngineStats.waiting``). ``admit`` is entered on the
    event loop and the engine takes the request before it is left, so the two counts never miss it between.
    """

    def __init__(self, engine, max_waiting: int) -> None:
        self.engine, self.max_waiting = engine, max_waiting
        self.preparing = 0

    def waiting(self) -> int:
        return self.preparing + self.engine.stats().waiting

    @contextmanager
    def admit(self):
        if self.waiting() >= self.max_waiting:
            raise QueueFull(f"too many requests are waiting (limit {self.max_waiting}); retry later")
        self.preparing += 1
        try:
            yield
        finally:
            self.preparing -= 1
