"""Where requests and aborts wait between the threads that send them and the engine thread that takes them."""

from __future__ import annotations

import threading
from typing import Callable

from ..errors import InvalidArgument
from .request import Request


class Inbox:
    """New requests, aborts and the request ids in use, under one lock; wakes the engine thread.

    Any thread ``put``s and ``abort``s; the engine thread ``take``s, and
    ``release``s an id when its request ends.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._requests: list[Request] = []
        self._aborts: list[str] = []
        self._ids: set[str] = set()
        self._stopping = False

    def put(self, req: Request) -> None:
        """Queue a request; ``InvalidArgument`` if its id is in use."""
        with self._lock:
            if req.id in self._ids:
                raise InvalidArgument(f"request id {req.id!r} is already in use")
            self._ids.add(req.id)
            self._requests.append(req)
            self._wake.notify()

    def abort(self, request_id: str) -> None:
        with self._lock:
            self._aborts.append(request_id)
            self._wake.notify()

    def take(self) -> tuple[list[Request], list[str]]:
        """The requests and aborts queued since the last ``take``."""
        with self._lock:
            requests, self._requests = self._requests, []
            aborts, self._aborts = self._aborts, []
        return requests, aborts

    def release(self, request_id: str) -> None:
        """The request ended: its id may be used again."""
        with self._lock:
            self._ids.discard(request_id)

    @property
    def num_requests(self) -> int:
        """Requests queued and not taken yet."""
        return len(self._requests)

    def stop(self) -> None:
        """Wake the engine thread for good: ``wait_for_work`` answers False from now on."""
        with self._lock:
            self._stopping = True
            self._wake.notify()

    def wait_for_work(self, has_work: Callable[[], bool]) -> bool:
        """Until something is queued or ``has_work()`` (read under the lock); False once stopped."""
        with self._lock:
            while not (self._stopping or self._requests or self._aborts or has_work()):
                self._wake.wait()
            return not self._stopping
