"""Client sessions: who is attached, whether it is still there, and when to let go.

A session is alive while its client holds the ``Watch`` stream open.  When
the stream drops (the process died, or closed its channel) the session is
kept for ``grace_seconds`` (a client may reconnect its stream in that time)
and then dropped: its sequences and reserve are freed, its cached blocks stay
cached.  The client's pid is checked as well (with its start time, so that a
reused pid is told apart), so a killed process is noticed even while a
half-open stream lingers.

**Lease.** A frozen client (SIGSTOPped, hung in a debugger, a VM paused)
keeps its socket and its pid: neither check above ever fires, and server
keep-alive pings do not close the connection either (they are answered by
the kernel's socket buffers, not the process).  So every session also holds a
lease of ``lease_seconds``: any call that names the session renews it (``get``),
and the client library sends a ``Heartbeat`` when it made no other call for a
third of the lease, from its own thread, without the client's lock (a client
busy with long GPU work or GIL-heavy Python keeps its lease).  A session whose
last call is older than the lease is dropped at once (no grace on top: the
grace is for a dropped stream).  Its next call, if the process ever resumes,
answers UNAUTHENTICATED with the reason ("session N ended: no call for 10s
(lease_seconds); attach again").  ``lease_seconds = 0`` turns leases off.

**Caps.**  At most ``max_sessions`` sessions at once, and at most
``max_sessions_per_user`` of one user (the uid of the kernel's credentials at
attach), so that one user holding sessions cannot lock the others out; a
session beyond either is refused with ``TooManySessions`` naming the cap.
"""

from __future__ import annotations

import os
import secrets
import time
from collections import OrderedDict
from dataclasses import dataclass, field

import psutil

from .access import PerUser
from .errors import TooManySessions, UnknownSession


@dataclass(eq=False)
class Session:
    id: int
    token: bytes
    name: str
    pid: int
    pid_started: float | None  # process_started, to tell a reused pid apart
    model_key: str
    class_id: int
    attached_at: float = field(default_factory=time.time)
    streams: int = 0
    lost_since: float | None = None  # monotonic time the last stream dropped (or attach)
    last_seen: float = 0.0  # monotonic time of the session's last call (its lease runs from here)
    end_reason: str = ""  # why the reaper dropped it (told to a client that calls afterwards)
    creds: object = None  # handoff.Credentials the kernel gave at attach; arena fds go to that process only
    remap: object = None  # asyncio.Event set when chunks its process may map left its class (Watch says "remap")

    @property
    def connected(self) -> bool:
        return self.streams > 0


def process_started(pid: int) -> float | None:
    """When ``pid`` started, in a unit fixed for the life of the process, or None if there is
    no such process: on Linux its start in clock ticks since boot (``/proc/<pid>/stat``), not
    psutil's ``create_time``, which adds the boot time in wall-clock seconds as the kernel
    reports it now, so that a clock adjustment can change it and make a live client look
    like a new process; elsewhere ``create_time``."""
    if _PROC_STAT:
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            return None
        return float(stat[stat.rindex(b")") + 2:].split()[19])  # field 22, starttime; the name may hold spaces
    try:
        return psutil.Process(pid).create_time()
    except (psutil.NoSuchProcess, psutil.AccessDenied, ValueError):
        return None


_PROC_STAT = os.path.exists("/proc/self/stat")


STALL_SECONDS = 1.0  # a gap between lease checks this long means the daemon stalled, not its clients
ENDED_REMEMBERED = 4096  # dropped sessions whose reason a late call is told (oldest forgotten first)


class SessionRegistry:
    def __init__(self, max_sessions: int, clock=time.monotonic, max_sessions_per_user: int = 0) -> None:
        self.max_sessions = max_sessions
        self.max_sessions_per_user = max_sessions_per_user  # 0: no cap
        self._per_user = PerUser()
        self._clock = clock
        self._by_token: dict[bytes, Session] = {}
        self._by_id: dict[int, Session] = {}
        self._ended: OrderedDict[bytes, str] = OrderedDict()  # token -> "session N ended: why"
        self._next_id = 1
        self._last_lease_check = clock()

    def __len__(self) -> int:
        return len(self._by_token)

    def __iter__(self):
        return iter(list(self._by_id.values()))

    def check_room(self, creds=None) -> None:
        """``TooManySessions`` unless a session of ``creds``' user (None: an in-process caller) fits both caps."""
        if len(self._by_token) >= self.max_sessions:
            raise TooManySessions(f"too many sessions: the daemon serves at most {self.max_sessions} sessions "
                                  "at once (max_sessions)")
        cap = self.max_sessions_per_user
        if creds is not None and cap and self._per_user[creds.uid] >= cap:
            raise TooManySessions(f"too many sessions: uid {creds.uid} has {self._per_user[creds.uid]} sessions "
                                  f"and may have at most {cap} at once (max_sessions_per_user)")

    def add(self, name: str, pid: int, model_key: str, class_id: int, creds=None) -> Session:
        """A new session; ``creds`` (``handoff.Credentials``) name its user, None for an in-process caller."""
        self.check_room(creds)
        if creds is not None:
            self._per_user.take(creds.uid, 0)  # check_room applied the cap
        pid = int(pid) or os.getpid()
        s = Session(
            id=self._next_id, token=secrets.token_bytes(16), name=name, pid=pid,
            pid_started=process_started(pid), model_key=model_key, class_id=class_id,
            lost_since=self._clock(),  # until its Watch stream opens
            creds=creds,
        )
        s.last_seen = self._clock()
        self._next_id += 1
        self._by_token[s.token] = s
        self._by_id[s.id] = s
        return s

    def get(self, token: bytes) -> Session:
        """The live session of ``token``; every call goes through here, so this renews its lease."""
        s = self._by_token.get(token)
        if s is None:
            why = self._ended.get(token) if isinstance(token, bytes) else None
            raise UnknownSession(f"{why}; attach again" if why else "unknown or expired session: attach again")
        s.last_seen = self._clock()
        return s

    def by_id(self, session_id: int) -> Session:
        s = self._by_id.get(session_id)
        if s is None:
            raise UnknownSession(f"no session {session_id}")
        return s

    def find_id(self, session_id: int) -> Session | None:
        return self._by_id.get(session_id)

    def remove(self, s: Session) -> None:
        if self._by_token.pop(s.token, None) is None:
            return
        if s.end_reason:
            self._ended[s.token] = f"session {s.id} ended: {s.end_reason}"
            while len(self._ended) > ENDED_REMEMBERED:
                self._ended.popitem(last=False)
        if s.creds is not None:
            self._per_user.give(s.creds.uid)
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
                s.end_reason = f"process {s.pid} is gone"
            elif s.lost_since is not None and now - s.lost_since >= grace_seconds:
                s.end_reason = f"no keep-alive stream for {grace_seconds:g}s"
            else:
                continue
            out.append((s, s.end_reason))
        return out

    def lapsed(self, lease_seconds: float) -> list[tuple[Session, str]]:
        """Sessions whose lease ran out (no call for ``lease_seconds``), with the reason; none when 0."""
        if not lease_seconds:
            return []
        now = self._clock()
        stalled = now - self._last_lease_check > max(lease_seconds / 3, STALL_SECONDS)
        self._last_lease_check = now
        if stalled:  # the daemon itself did not run (stopped, suspended): the heartbeats may be queued
            for s in self._by_token.values():
                s.last_seen = max(s.last_seen, now)
            return []
        out = []
        for s in list(self._by_token.values()):
            idle = now - s.last_seen
            if idle >= lease_seconds:
                s.end_reason = f"no call or heartbeat for {idle:.1f}s (lease_seconds={lease_seconds:g}): " \
                               "the client was frozen or hung"
                out.append((s, s.end_reason))
        return out
