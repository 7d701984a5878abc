"""The client side of the daemon's side socket (``<socket>.handoff``): attach tickets, arena fds.

The daemon learns who a client is from the kernel (``SO_PEERCRED`` on this
socket) and answers with a one-time ticket bound to that pid, uid and gid;
``Attach`` carries the ticket.  A CPU arena comes back the same way: its
memfd, sent only to the process that attached the session.  See
``kvpoold/server/handoff.py``.
"""

from __future__ import annotations

import os
import socket

from .errors import PermissionDenied, Unavailable

MAX_REPLY_BYTES = 512


def socket_path(address: str) -> str:
    """The gRPC address ``unix:///x/kvpoold.sock`` (or a path) -> the side socket's path."""
    for prefix in ("unix://", "unix:"):
        if address.startswith(prefix):
            address = address[len(prefix):]
            break
    return address + ".handoff"


#: as long as a gRPC call may take: a daemon on a loaded machine answers late, never wrongly
SIDE_SOCKET_TIMEOUT_S = 30.0


def _ask(address: str, request: bytes, timeout: float) -> tuple[bytes, list[int]]:
    """One request on the side socket: (the reply line, file descriptors that came with it)."""
    path = socket_path(address)
    fds: list[int] = []
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(timeout)
            s.connect(path)
            try:
                s.sendall(request + b"\n")
            except (BrokenPipeError, ConnectionResetError) as exc:
                sent = exc  # a daemon that refuses at accept answers and closes first: its reason is still queued
            else:
                sent = None
            reply = b""
            while not reply.endswith(b"\n") and len(reply) < MAX_REPLY_BYTES:
                part, got, _flags, _addr = socket.recv_fds(s, MAX_REPLY_BYTES - len(reply), 1)
                fds += got
                if not part:
                    break
                reply += part
            if sent is not None and not reply:
                raise sent
    except PermissionError as exc:
        for fd in fds:
            os.close(fd)
        raise PermissionDenied(f"cannot reach kvpoold's side socket {path}: {exc}; join the socket's group "
                               "(socket_group) or ask the operator") from None
    except OSError as exc:
        for fd in fds:
            os.close(fd)
        raise Unavailable(f"kvpoold is not reachable at {path} (its side socket: {exc})") from None
    return reply, fds


def attach_ticket(address: str, timeout: float = SIDE_SOCKET_TIMEOUT_S) -> bytes:
    """A one-time attach ticket for this process from the daemon at ``address``."""
    reply, fds = _ask(address, b"ticket", timeout)
    for fd in fds:
        os.close(fd)
    words = reply.decode("ascii", "replace").split(None, 1)
    if len(words) == 2 and words[0] == "ok":
        try:
            return bytes.fromhex(words[1].strip())
        except ValueError:
            pass
    raise Unavailable(f"kvpoold's side socket {socket_path(address)} gave no ticket: {reply[:200]!r}")


def arena_fd(address: str, session: bytes, timeout: float = SIDE_SOCKET_TIMEOUT_S) -> int:
    """The memfd of this process's session's arena (the caller owns it); ``PermissionDenied`` if refused."""
    reply, fds = _ask(address, b"arena " + session.hex().encode(), timeout)
    if reply.startswith(b"ok ") and len(fds) == 1:
        return fds[0]
    for fd in fds:
        os.close(fd)
    raise PermissionDenied(f"kvpoold gave this process no arena: {reply[:200].decode('ascii', 'replace').strip()}")


class _Stream:
    """Bytes and file descriptors from one side-socket connection, read in order."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock, self.buf, self.fds = sock, b"", []

    def _more(self) -> None:
        part, fds, _flags, _addr = socket.recv_fds(self.sock, 1 << 16, CHUNK_BATCH)
        self.fds += fds
        if not part:
            raise ConnectionError("kvpoold closed the side socket mid-sync")
        self.buf += part

    def line(self) -> str:
        while b"\n" not in self.buf:
            if len(self.buf) > MAX_REPLY_BYTES:
                raise ConnectionError("the side socket sent an overlong line")
            self._more()
        line, self.buf = self.buf.split(b"\n", 1)
        return line.decode("ascii", "replace")

    def exactly(self, n: int) -> bytes:
        while len(self.buf) < n:
            self._more()
        out, self.buf = self.buf[:n], self.buf[n:]
        return out

    def take_fds(self, n: int) -> list[int]:
        while len(self.fds) < n:
            self._more()
        out, self.fds = self.fds[:n], self.fds[n:]
        return out

    def close(self) -> None:
        for fd in self.fds:
            os.close(fd)
        self.fds = []


CHUNK_BATCH = 64  # file descriptors per message: far below the kernel's 253 and the in-flight limit


def sync_chunks(address: str, session: bytes, arena, timeout: float = 60.0) -> int:
    """Bring ``arena`` (a ``kvpool.ipc.vmm.VmmMappedArena``) to the chunks its class has now.

    The daemon sends its class's places (index, chunk id); chunks that are
    not mapped here come as file descriptors, in batches, and are imported and
    mapped; chunks no longer at their place are unmapped.  ``ack`` tells the
    daemon this process maps exactly those chunks, so it may reuse or free the
    others.  A sync that breaks off leaves the mapping as it stands: every
    chunk mapped here came from the daemon, which counts it as mapped by this
    process until an ack says otherwise, and the next sync starts from there
    (unmapping everything would pull memory from under kernels still running
    on it).  Call under the client's lock: in one of its calls, or between two.

    Returns the class's generation the arena now matches.
    """
    for _ in range(SYNC_ATTEMPTS):
        try:
            return _sync_once(address, session, arena, timeout)
        except _Moved:
            pass  # a chunk left its place during the dialog: start again from the daemon's new answer
    raise Unavailable("the class's chunks kept moving while this process mapped them; try again")


SYNC_ATTEMPTS = 5


class _Moved(Exception):
    """The daemon ended a sync: a chunk it listed left its place before this process mapped it."""


def _sync_once(address: str, session: bytes, arena, timeout: float) -> int:
    import numpy as np

    path = socket_path(address)
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stream = _Stream(s)
    try:
        s.settimeout(timeout)
        s.connect(path)
        s.sendall(b"chunks " + session.hex().encode() + b"\n")
        words = stream.line().split()
        if len(words) != 3 or words[0] != "ok":
            raise PermissionDenied(f"kvpoold gave this process no chunks: {' '.join(words)[:200]}")
        generation, n = int(words[1]), int(words[2])
        places = np.frombuffer(stream.exactly(16 * n), "<i8").reshape(n, 2)
        have = arena.chunk_of
        index, chunk = places[:, 0], places[:, 1]
        stale = np.flatnonzero(have)
        wanted_here = np.zeros(len(have), np.int64)
        wanted_here[index] = chunk
        for i in stale[have[stale] != wanted_here[stale]].tolist():
            arena.unmap(i)  # left its place (or another chunk is there now)
        missing = have[index] != chunk
        want_index, want_chunk = index[missing], chunk[missing]
        s.sendall(b"want %d\n" % len(want_chunk) + want_chunk.astype("<i8").tobytes())
        for start in range(0, len(want_chunk), CHUNK_BATCH):
            words = stream.line().split()
            count = min(CHUNK_BATCH, len(want_chunk) - start)
            if words == ["moved"]:
                raise _Moved()
            if words != ["fds", str(count)]:
                raise ConnectionError(f"unexpected reply on the side socket: {' '.join(words)[:200]}")
            for i, c, fd in zip(want_index[start:start + count].tolist(), want_chunk[start:start + count].tolist(),
                                stream.take_fds(count)):
                arena.map_fd(i, c, fd)
            s.sendall(b"next\n")
        s.sendall(b"ack\n")
        if stream.line() != "done":
            raise ConnectionError("kvpoold did not confirm the sync")
        return generation
    except PermissionDenied:
        raise
    except (OSError, ValueError) as exc:
        raise Unavailable(f"mapping the pool's chunks over {path} failed: {exc}") from None
    finally:
        stream.close()
        s.close()
