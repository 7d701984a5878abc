"""The side socket: who the client is, from the kernel.

gRPC does not tell a servicer the credentials of a Unix-socket peer, so
beside each gRPC socket the daemon serves a small side socket
(``<socket>.handoff``, same directory, mode and group).  On every
connection it reads ``SO_PEERCRED`` (pid, uid, gid) from the kernel; a
client cannot choose what it says there.

Protocol (one request per connection, both ways bounded):

* the client sends one line of at most ``MAX_REQUEST`` bytes within
  ``handoff_timeout`` seconds (a silent connection is closed then):
  ``ticket``, ``arena <session token in hex>``, or
  ``chunks <session token in hex>`` (CUDA VMM: a longer dialog, in
  ``chunk_sync.py``, that hands the chunks of the session's class);
* the daemon answers one line and closes: ``ok <64 hex digits>`` (a
  ticket); ``ok <bytes>`` with the arena's memfd attached (``SCM_RIGHTS``),
  only when the connection's credentials are the session's (same pid, uid
  and gid); or ``err <reason>``.  Refusals say no more than that.

A ticket is 32 random bytes bound to the connection's credentials, valid
for ``TICKET_SECONDS`` and redeemed at most once by ``Attach``
(``TicketStore.redeem``), which also checks that the attaching pid is the
one the kernel saw.  The session then carries those credentials, so a
later request on this socket (arena file descriptors with ``SCM_RIGHTS``)
can be checked against them; the request line leaves room for more verbs.

Per user (the connection's uid): at most ``max_handoff_connections_per_user``
connections open at once (the next one is answered ``err too many
connections`` and closed at accept) and ``max_tickets_per_user`` tickets
unredeemed (``err too many tickets ...``), so one user flooding this socket
neither runs the daemon out of file descriptors nor takes the tickets of the
others.  The accept loop is the daemon's own: when the process is out of file
descriptors (EMFILE) it waits, doubling the wait up to ``ACCEPT_BACKOFF_MAX``,
and logs the failures once per interval with their count (``logsafe.Throttled``).
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import socket
import struct
import time
from dataclasses import dataclass
from typing import Callable

from kvpoold.config import Config
from kvpoold.core.errors import KvpoolError

from .access import PerUser
from .logsafe import Throttled
from .sockpath import BoundSocket, clear_stale_socket

log = logging.getLogger("kvpoold")

MAX_REQUEST = 256  # bytes of one request line
TICKET_SECONDS = 30.0  # a ticket not redeemed by then is void
MAX_TICKETS = 4096  # outstanding at once, every user together: the store's memory stays bounded
BACKLOG = 128  # connections the kernel queues before we accept them (they hold none of our descriptors)
ACCEPT_BACKOFF_MIN = 0.01  # seconds before accepting again after accept failed (EMFILE: no descriptor left)
ACCEPT_BACKOFF_MAX = 1.0  # the wait doubles up to this while accept keeps failing
_DEFAULTS = Config()


def handoff_path(socket_path: str) -> str:
    return socket_path + ".handoff"


@dataclass(frozen=True)
class Credentials:
    pid: int
    uid: int
    gid: int


def peer_credentials(sock: socket.socket) -> Credentials:
    pid, uid, gid = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
    return Credentials(pid, uid, gid)


class NoCredentials(KvpoolError, PermissionError):
    """An attach without a valid ticket from the side socket."""

    code = "PERMISSION_DENIED"

    def __init__(self, why: str) -> None:
        super().__init__(f"attach through kvpool.connect: no credentials ({why})")


class TooManyTickets(Exception):
    """No ticket now: the user (or every user together) holds as many unredeemed ones as allowed."""


class TicketStore:
    """One-time attach tickets, each bound to the credentials the kernel gave for its connection."""

    def __init__(self, seconds: float = TICKET_SECONDS, limit: int = MAX_TICKETS) -> None:
        self.seconds, self.limit = seconds, limit
        self._tickets: dict[bytes, tuple[Credentials, float]] = {}
        self._per_user = PerUser()  # uid -> its tickets in _tickets

    def issue(self, creds: Credentials, per_user: int = 0) -> bytes:
        """A ticket for ``creds``, unless its user holds ``per_user`` unredeemed ones (0: no cap) or all users
        together ``limit``: then ``TooManyTickets`` (expired tickets are dropped first)."""
        uid = creds.uid
        if len(self._tickets) >= self.limit or (per_user and self._per_user[uid] >= per_user):
            self._drop_expired()
        if len(self._tickets) >= self.limit:
            raise TooManyTickets(f"too many tickets: {self.limit} are unredeemed")
        if not self._per_user.take(uid, per_user):
            raise TooManyTickets(f"too many tickets: uid {uid} holds {per_user} unredeemed (max_tickets_per_user)")
        ticket = secrets.token_bytes(32)
        self._tickets[ticket] = (creds, time.monotonic() + self.seconds)
        return ticket

    def _drop_expired(self) -> None:
        now = time.monotonic()
        for ticket, (creds, expires) in list(self._tickets.items()):
            if expires <= now:
                del self._tickets[ticket]
                self._per_user.give(creds.uid)

    def redeem(self, ticket: bytes, pid: int) -> Credentials:
        """The credentials of ``ticket`` (then void), or ``NoCredentials``."""
        if not ticket:
            raise NoCredentials("no ticket")
        entry = self._tickets.pop(bytes(ticket), None)
        if entry is None:
            raise NoCredentials("unknown or used ticket")
        creds, expires = entry
        self._per_user.give(creds.uid)
        if time.monotonic() > expires:
            raise NoCredentials("expired ticket")
        if creds.pid != pid:
            raise NoCredentials(f"the ticket was issued to pid {creds.pid}, not {pid}")
        return creds


class HandoffServer:
    """The side socket beside one gRPC socket; served on the daemon's event loop."""

    def __init__(self, path: str, mode: int, tickets: TicketStore, arena_fd=None, chunk_sync=None,
                 settings: Callable[[], Config] = lambda: _DEFAULTS) -> None:
        """``arena_fd(token, creds) -> (fd, nbytes)`` (``Service.arena_fd``); None: no arenas here.

        ``chunk_sync(token, creds) -> chunk_sync.ChunkSync`` (``Service.chunk_sync``): CUDA VMM chunks.
        ``settings()``: the live configuration (caps and deadline; SIGHUP changes them).
        """
        self.path, self.mode, self.tickets, self.arena_fd = path, mode, tickets, arena_fd
        self.chunk_sync, self.settings = chunk_sync, settings
        self._sock: socket.socket | None = None
        self.bound: BoundSocket | None = None  # once bound
        self._backoff = ACCEPT_BACKOFF_MIN  # the wait after the next failed accept
        self._resume: asyncio.TimerHandle | None = None  # watching the socket again after a failed accept
        self._serving: set[asyncio.Task] = set()
        self._open = PerUser()  # uid -> connections open now
        self._accept_failed = Throttled(log, f"side socket {path}: accept failed")
        self._refused = Throttled(log, f"side socket {path}: refused")

    async def start(self, gid: int | None) -> None:
        clear_stale_socket(self.path, "the side socket")  # a stale socket only: the caller holds the lock
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o077)  # nobody can connect in the moment between bind and chmod
        try:
            sock.bind(self.path)
            sock.listen(BACKLOG)
        except BaseException:
            sock.close()
            raise
        finally:
            os.umask(old)
        sock.setblocking(False)
        self._sock = sock
        self.bound = BoundSocket(self.path, "the side socket")
        self.bound.set_access(self.mode, gid)
        self._watch()

    def _accept_ready(self) -> None:
        """The listening socket is readable: accept every queued connection, as asyncio's servers do.

        Out of descriptors (EMFILE, ENFILE, ENOBUFS...) the connection stays queued and accept would fail
        again at once: stop watching the socket for a while, longer each time it fails again.
        """
        for _ in range(BACKLOG):
            try:
                conn, _ = self._sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except ConnectionAbortedError:
                continue  # that one connection went before we took it
            except OSError as exc:
                self._accept_failed.note(f"{exc.strerror or exc}; retrying in {self._backoff:g}s")
                self._pause()
                return
            self._backoff = ACCEPT_BACKOFF_MIN
            conn.setblocking(False)
            self._admit(conn)

    def _pause(self) -> None:
        loop = asyncio.get_running_loop()
        loop.remove_reader(self._sock.fileno())
        self._resume = loop.call_later(self._backoff, self._watch)
        self._backoff = min(2 * self._backoff, ACCEPT_BACKOFF_MAX)

    def _watch(self) -> None:
        self._resume = None
        asyncio.get_running_loop().add_reader(self._sock.fileno(), self._accept_ready)

    def _admit(self, conn: socket.socket) -> None:
        """Serve ``conn`` unless its user has ``max_handoff_connections_per_user`` open already."""
        try:
            creds = peer_credentials(conn)
        except OSError:
            conn.close()
            return
        cap = self.settings().max_handoff_connections_per_user
        if not self._open.take(creds.uid, cap):
            self._refused.note(f"uid {creds.uid} has {cap} connections open (max_handoff_connections_per_user)")
            try:
                conn.send(b"err too many connections\n")  # an empty send buffer: never blocks
            except OSError:
                pass
            conn.close()
            return
        task = asyncio.create_task(self._serve_connection(conn, creds))
        self._serving.add(task)
        task.add_done_callback(self._serving.discard)

    async def _serve_connection(self, conn: socket.socket, creds: Credentials) -> None:
        try:
            try:
                reader, writer = await asyncio.open_unix_connection(sock=conn, limit=MAX_REQUEST)
            except OSError:
                conn.close()
                return
            await self._serve(reader, writer, creds)
        finally:
            self._open.give(creds.uid)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, creds: Credentials) -> None:
        settings = self.settings()
        timeout = settings.handoff_timeout
        try:
            try:
                line = await asyncio.wait_for(reader.readline(), timeout)
            except (asyncio.TimeoutError, ValueError, asyncio.LimitOverrunError):
                return
            verb = line.strip().decode("ascii", "replace")
            if verb == "ticket":
                writer.write(self._ticket(creds, settings.max_tickets_per_user))
            elif verb.startswith("arena ") and self.arena_fd is not None:
                self._send_arena(writer, verb[len("arena "):], creds)
                return
            elif verb.startswith("chunks ") and self.chunk_sync is not None:
                await self._sync_chunks(reader, writer, verb[len("chunks "):], creds, timeout)
                return
            else:
                writer.write(b"err unknown request\n")
            await asyncio.wait_for(writer.drain(), timeout)
        except (OSError, asyncio.TimeoutError):
            pass
        except Exception:  # noqa: BLE001 - one bad connection never stops the side socket
            log.exception("handoff: connection failed")
        finally:
            writer.close()

    def _ticket(self, creds: Credentials, per_user: int) -> bytes:
        """The reply to ``ticket``: ``ok <hex>``, or ``err too many tickets ...``."""
        try:
            return b"ok " + self.tickets.issue(creds, per_user).hex().encode() + b"\n"
        except TooManyTickets as exc:
            self._refused.note(str(exc))
            return f"err {exc}\n".encode()

    def _send_arena(self, writer: asyncio.StreamWriter, token_hex: str, creds: Credentials) -> None:
        try:
            fd, nbytes = self.arena_fd(bytes.fromhex(token_hex.strip()), creds)
        except Exception as exc:  # noqa: BLE001 - unknown session, other credentials, bad hex: one answer
            log.warning("handoff: arena refused to pid %d uid %d gid %d: %s", creds.pid, creds.uid, creds.gid,
                        type(exc).__name__)
            writer.write(b"err refused\n")
            return
        # a fresh connection's send buffer is empty: this one short message with its fd never blocks
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM, fileno=os.dup(writer.get_extra_info("socket").fileno()))
        try:
            socket.send_fds(sock, [b"ok %d\n" % nbytes], [fd])
        finally:
            sock.close()

    async def _sync_chunks(self, reader, writer, token_hex: str, creds: Credentials, timeout: float) -> None:
        from . import chunk_sync

        try:
            sync = self.chunk_sync(bytes.fromhex(token_hex.strip()), creds)
        except Exception as exc:  # noqa: BLE001 - unknown session, other credentials, no VMM: one answer
            log.warning("handoff: chunks refused to pid %d uid %d gid %d: %s", creds.pid, creds.uid, creds.gid,
                        type(exc).__name__)
            writer.write(b"err refused\n")
            await asyncio.wait_for(writer.drain(), timeout)
            return
        raw = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM, fileno=os.dup(writer.get_extra_info("socket").fileno()))
        try:
            raw.setblocking(False)
            await chunk_sync.serve(reader, raw, sync)
        except (OSError, asyncio.TimeoutError, asyncio.IncompleteReadError, PermissionError) as exc:
            log.info("handoff: chunk sync of session %d broke off: %s", sync.viewer, type(exc).__name__)
        finally:
            raw.close()

    async def stop(self) -> None:
        if self._sock is not None:
            if self._resume is not None:
                self._resume.cancel()
            else:
                asyncio.get_running_loop().remove_reader(self._sock.fileno())
            self._sock.close()
            self._sock = None
        tasks = list(self._serving)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self.bound is not None:
            self.bound.remove()
