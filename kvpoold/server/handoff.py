"""The side socket: who the client is, from the kernel.

gRPC does not tell a servicer the credentials of a Unix-socket peer, so
beside each gRPC socket the daemon serves a small side socket
(``<socket>.handoff``, same directory, mode and group).  On every
connection it reads ``SO_PEERCRED`` (pid, uid, gid) from the kernel; a
client cannot choose what it says there.

Protocol (one request per connection, both ways bounded):

* the client sends one line of at most ``MAX_REQUEST`` bytes within
  ``TIMEOUT`` seconds: ``ticket``, ``arena <session token in hex>``, or
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

from kvpoold.core.errors import KvpoolError

from .sockpath import BoundSocket, clear_stale_socket

log = logging.getLogger("kvpoold")

MAX_REQUEST = 256  # bytes of one request line
TIMEOUT = 2.0  # seconds a connection may take to send its request
TICKET_SECONDS = 30.0  # a ticket not redeemed by then is void
MAX_TICKETS = 4096  # outstanding at once: a flood of connections cannot grow the daemon without bound


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


class TicketStore:
    """One-time attach tickets, each bound to the credentials the kernel gave for its connection."""

    def __init__(self, seconds: float = TICKET_SECONDS, limit: int = MAX_TICKETS) -> None:
        self.seconds, self.limit = seconds, limit
        self._tickets: dict[bytes, tuple[Credentials, float]] = {}

    def issue(self, creds: Credentials) -> bytes | None:
        now = time.monotonic()
        if len(self._tickets) >= self.limit:
            self._tickets = {t: v for t, v in self._tickets.items() if v[1] > now}
            if len(self._tickets) >= self.limit:
                return None
        ticket = secrets.token_bytes(32)
        self._tickets[ticket] = (creds, now + self.seconds)
        return ticket

    def redeem(self, ticket: bytes, pid: int) -> Credentials:
        """The credentials of ``ticket`` (then void), or ``NoCredentials``."""
        if not ticket:
            raise NoCredentials("no ticket")
        entry = self._tickets.pop(bytes(ticket), None)
        if entry is None:
            raise NoCredentials("unknown or used ticket")
        creds, expires = entry
        if time.monotonic() > expires:
            raise NoCredentials("expired ticket")
        if creds.pid != pid:
            raise NoCredentials(f"the ticket was issued to pid {creds.pid}, not {pid}")
        return creds


class HandoffServer:
    """The side socket beside one gRPC socket; served on the daemon's event loop."""

    def __init__(self, path: str, mode: int, tickets: TicketStore, arena_fd=None, chunk_sync=None) -> None:
        """``arena_fd(token, creds) -> (fd, nbytes)`` (``Service.arena_fd``); None: no arenas here.

        ``chunk_sync(token, creds) -> chunk_sync.ChunkSync`` (``Service.chunk_sync``): CUDA VMM chunks.
        """
        self.path, self.mode, self.tickets, self.arena_fd = path, mode, tickets, arena_fd
        self.chunk_sync = chunk_sync
        self._server: asyncio.AbstractServer | None = None
        self.bound: BoundSocket | None = None  # once bound

    async def start(self, gid: int | None) -> None:
        clear_stale_socket(self.path, "the side socket")  # a stale socket only: the caller holds the lock
        old = os.umask(0o077)  # nobody can connect in the moment between bind and chmod
        try:
            self._server = await asyncio.start_unix_server(self._serve, path=self.path, limit=MAX_REQUEST)
        finally:
            os.umask(old)
        self.bound = BoundSocket(self.path, "the side socket")
        self.bound.set_access(self.mode, gid)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            creds = peer_credentials(writer.get_extra_info("socket"))
            try:
                line = await asyncio.wait_for(reader.readline(), TIMEOUT)
            except (asyncio.TimeoutError, ValueError, asyncio.LimitOverrunError):
                return
            verb = line.strip().decode("ascii", "replace")
            if verb == "ticket":
                ticket = self.tickets.issue(creds)
                writer.write(b"ok " + ticket.hex().encode() + b"\n" if ticket else b"err too many tickets\n")
            elif verb.startswith("arena ") and self.arena_fd is not None:
                self._send_arena(writer, verb[len("arena "):], creds)
                return
            elif verb.startswith("chunks ") and self.chunk_sync is not None:
                await self._sync_chunks(reader, writer, verb[len("chunks "):], creds)
                return
            else:
                writer.write(b"err unknown request\n")
            await asyncio.wait_for(writer.drain(), TIMEOUT)
        except (OSError, asyncio.TimeoutError):
            pass
        except Exception:  # noqa: BLE001 - one bad connection never stops the side socket
            log.exception("handoff: connection failed")
        finally:
            writer.close()

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

    async def _sync_chunks(self, reader, writer, token_hex: str, creds: Credentials) -> None:
        from . import chunk_sync

        try:
            sync = self.chunk_sync(bytes.fromhex(token_hex.strip()), creds)
        except Exception as exc:  # noqa: BLE001 - unknown session, other credentials, no VMM: one answer
            log.warning("handoff: chunks refused to pid %d uid %d gid %d: %s", creds.pid, creds.uid, creds.gid,
                        type(exc).__name__)
            writer.write(b"err refused\n")
            await asyncio.wait_for(writer.drain(), TIMEOUT)
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
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
        if self.bound is not None:
            self.bound.remove()
