"""The client side of the daemon's side socket (``<socket>.handoff``): attach tickets.

The daemon learns who a client is from the kernel (``SO_PEERCRED`` on this
socket) and answers with a one-time ticket bound to that pid, uid and gid;
``Attach`` carries the ticket.  See ``kvpoold/server/handoff.py``.
"""

from __future__ import annotations

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


def attach_ticket(address: str, timeout: float = 5.0) -> bytes:
    """A one-time attach ticket for this process from the daemon at ``address``."""
    path = socket_path(address)
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(timeout)
            s.connect(path)
            s.sendall(b"ticket\n")
            reply = b""
            while not reply.endswith(b"\n") and len(reply) < MAX_REPLY:
                part = s.recv(MAX_REPLY - len(reply))
                if not part:
                    break
                reply += part
    except PermissionError as exc:
        raise PermissionDenied(f"cannot reach kvpoold's side socket {path}: {exc}") from None
    except OSError as exc:
        raise Unavailable(f"kvpoold is not reachable at {path} (its side socket: {exc})") from None
    words = reply.decode("ascii", "replace").split(None, 1)
    if len(words) == 2 and words[0] == "ok":
        try:
            return bytes.fromhex(words[1].strip())
        except ValueError:
            pass
    raise Unavailable(f"kvpoold's side socket {path} gave no ticket: {reply[:200]!r}")
