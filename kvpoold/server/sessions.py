"""Client sessions: who is attached, whether it is still there, and when to let go.

A session is alive while its client holds the ``Watch`` stream open.  When
the stream drops (the process died, or closed its channel) the session is
kept for ``grace_seconds`` (a client may reconnect its stream in that time)
and then dropped: its sequences and reserve are freed, its cached blocks stay
cached.  The client's pid is checked with psutil as well, so a killed process
is noticed even while a half-open stream lingers.
"""

from __future__ import annotations

import os
import secrets
import time
from dataclasses import dataclass, field

import psutil

from .errors import TooManySessions, UnknownSession


@dataclass(eq=False)
class Session:
    id: int
    token: bytes
    name: str
    pid: int
    pid_started: float | None  # psutil create_time, to tell a reused pid apart
    model_key: str
    class_id: int
    attached_at: float = field(default_factory=time.time)
    streams: int = 0
    lost_since: float | None = None  # monotonic time the last stream dropped (or attach)

    @property
    def connected(self) -> bool:
        return self.streams > 0


def process_started(pid: int) -> float | None:
    """The creation time of ``pid``, or None if there is no such process."""
    try:
        return psutil.Process(pid).create_time()
    except (psutil.NoSuchProcess, psutil.AccessDenied, ValueError):
        return None


class SessionRegistry:
    def __init__(self, max_sessions: int, clock=time.monotonic) -> None:
        self.max_sessions = max_sessions
        self._clock = clock
        self._by_token: dict[bytes, Session] = {}
        self._by_id: dict[int, Session] = {}
        self._next_id = 1

    def __len__(self) -> int:
        return len(self._by_token)

    def __iter__(self):
        return iter(list(self._by_id.values()))

    def add(self, name: str, pid: int, model_key: str, class_id: int) -> Session:
        if len(self._by_token) >= self.max_sessions:
            raise TooManySessions(f"the daemon serves at most {self.max_sessions} sessions")
        pid = int(pid) or os.getpid()
        s = Session(
            id=self._next_id, token=secrets.token_bytes(16), name=name, pid=pid,
            pid_started=process_started(pid), model_key=model_key, class_id=class_id,
            lost_since=self._clock(),  # until its Watch stream opens
        )
        self._next_id += 1
        self._by_token[s.token] = s
        self._by_id[s.id] = s
        return s

    def get(self, token: bytes) -> Session:
        s = self._by_token.get(token)
        if s is None:
            raise UnknownSession("unknown or expired session: attach again")
        return s

    def by_id(self, session_id: int) -> Session:
        s = self._by_id.get(session_id)
        if s is None:
            raise UnknownSession(f"no session {session_id}")
        return s

    def remove(self, s: Session) -> None:
        self._by_token.pop(s.token, None)
        self._by_id.pop(s.id, None)

    def stream_opened(self, s: Session) -> None:
        s.streams += 1
        s.lost_since = None

    def stream_closed(self, s: Session) -> None:
        s.streams = max(0, s.streams - 1)
        if s.streams == 0:
            s.lost_since = self._clock()

    def expired(self, grace_seconds: float) -> list[tuple[Session, str]]:
        """Sessions to drop now, with the reason."""
        now = self._clock()
        out = []
        for s in list(self._by_token.values()):
            if s.pid_started is not None and process_started(s.pid) != s.pid_started:
                out.append((s, f"process {s.pid} is gone"))
            elif s.lost_since is not None and now - s.lost_since >= grace_seconds:
                out.append((s, f"no keep-alive stream for {grace_seconds:g}s"))
        return out
