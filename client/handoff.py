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

MAX_REPLY = 512


def socket_path(address: str) -> str:
    """The gRPC address ``unix:///x/kvpoold.sock`` (or a path) -> the side socket's path."""
    for prefix in ("unix://", "unix:"):
        if address.startswith(prefix):
            address = address[len(prefix):]
            break
    return address + ".handoff"


def _ask(address: str, request: bytes, timeout: float) -> tuple[bytes, list[int]]:
    """One request on the side socket: (the reply line, file descriptors that came with it)."""
    path = socket_path(address)
    fds: list[int] = []
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(timeout)
            s.connect(path)
            s.sendall(request + b"\n")
            reply = b""
            while not reply.endswith(b"\n") and len(reply) < MAX_REPLY:
                part, got, _flags, _addr = socket.recv_fds(s, MAX_REPLY - len(reply), 1)
                fds += got
                if not part:
                    break
                reply += part
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


def attach_ticket(address: str, timeout: float = 5.0) -> bytes:
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


def arena_fd(address: str, session: bytes, timeout: float = 5.0) -> int:
    """The memfd of this process's session's arena (the caller owns it); ``PermissionDenied`` if refused."""
    reply, fds = _ask(address, b"arena " + session.hex().encode(), timeout)
    if reply.startswith(b"ok ") and len(fds) == 1:
        return fds[0]
    for fd in fds:
        os.close(fd)
    raise PermissionDenied(f"kvpoold gave this process no arena: {reply[:200].decode('ascii', 'replace').strip()}")
