"""The session's two background threads: the daemon's event stream, and the heartbeat that keeps the lease."""

from __future__ import annotations

import threading
import time
from typing import Callable

from .errors import KvpoolError, SessionExpired
from .protocol import kvpool_pb2 as pb
from .session import Session


class Liveness:
    """Follows the daemon's events and keeps the session's lease while the process lives.

    ``daemon_shutting_down`` is set when the daemon says it is stopping;
    ``session_expired`` when it dropped this session (lease, operator).
    ``lease_seconds`` is the lease the daemon last told of (0: none).

    Args:
        session: the attached session (its connection and token).
        lease_seconds: the lease the attach told of.
        on_remap: called on the watch thread when chunks left the session's class.
    """

    def __init__(self, session: Session, lease_seconds: float, on_remap: Callable[[], None]) -> None:
        self._session = session
        self._on_remap = on_remap
        self.lease_seconds = lease_seconds
        self.session_expired = threading.Event()
        self.daemon_shutting_down = threading.Event()
        self._stopped = threading.Event()
        self._watch = session.conn._stub.Watch(pb.WatchRequest(session=session.token))
        first = next(self._watch)  # the stream is open once the daemon says "attached"
        assert first.kind == "attached", first
        threading.Thread(target=self._follow_watch, name="kvpool-watch", daemon=True).start()
        threading.Thread(target=self._heartbeat, name="kvpool-heartbeat", daemon=True).start()

    def stop_heartbeat(self) -> None:
        """No more heartbeats (detaching)."""
        self._stopped.set()

    def close_watch(self) -> None:
        """End the event stream, after the detach: a session without it may have lost its process."""
        self._watch.cancel()

    def _follow_watch(self) -> None:
        try:
            for event in self._watch:
                if event.kind == "shutdown":
                    self.daemon_shutting_down.set()
                elif event.kind == "remap":
                    self._on_remap()
        except Exception:  # noqa: BLE001 - the stream ends when either side closes
            pass

    def _heartbeat(self) -> None:
        """Keep the session's lease while the process lives, busy or idle.

        Runs on its own thread and never takes the client's lock: a client whose
        main thread is busy (long GPU work, GIL-heavy Python, a lock held for
        seconds) still heartbeats, as Python threads take turns on the GIL.
        Only a process that does not run at all (SIGSTOP, a hang in native
        code holding the GIL) loses its lease.  With no lease (0) it asks
        every few seconds whether the daemon has started using one since.
        """
        session = self._session
        while True:
            interval = self.lease_seconds / 3 if self.lease_seconds > 0 else 5.0
            due = session.last_call + interval
            if self._stopped.wait(max(0.05, due - time.monotonic())):
                return
            if time.monotonic() < session.last_call + interval:
                continue  # another call renewed the lease meanwhile
            try:
                r = session.conn.call("Heartbeat", pb.HeartbeatRequest(session=session.token),
                                      timeout=max(1.0, interval))
                session.touch()
                self.lease_seconds = r.lease_seconds
            except SessionExpired:
                self.session_expired.set()
                return
            except KvpoolError as exc:
                if exc.code == "UNIMPLEMENTED":
                    return  # a daemon without leases
                session.touch()  # daemon away or slow: try again in an interval
            except Exception:  # noqa: BLE001 - e.g. the channel closed under us at exit
                if self._stopped.is_set():
                    return
                session.touch()
