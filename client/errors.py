"""Typed errors of the client library, one per gRPC status the daemon answers with.

The classes are the shared vocabulary (``kvpool.protocol.errors``, which the
daemon raises too); this module turns a gRPC status back into one of them.
"""

from __future__ import annotations

import grpc

from .protocol.errors import (
    BY_CODE,
    TOO_MANY_CLASSES_PREFIX,
    TOO_MANY_SESSIONS_PREFIX,
    DaemonError,
    FailedPrecondition,
    InvalidArgument,
    KvpoolError,
    NotFound,
    OutOfBlocks,
    PermissionDenied,
    SessionExpired,
    TooManyClasses,
    TooManySessions,
    Unavailable,
)

# gRPC's own words when a message exceeds the receiving side's limit (the daemon's max_message_bytes):
# the caller's call is too large, not the pool too full.
MESSAGE_TOO_LARGE = "Received message larger than max"

__all__ = [
    "KvpoolError", "InvalidArgument", "NotFound", "OutOfBlocks", "PermissionDenied", "FailedPrecondition",
    "SessionExpired", "Unavailable", "DaemonError", "TooManySessions", "TooManyClasses", "TOO_MANY_SESSIONS_PREFIX",
    "TOO_MANY_CLASSES_PREFIX", "MESSAGE_TOO_LARGE", "from_rpc_error",
]


def from_rpc_error(exc: grpc.RpcError, address: str) -> KvpoolError:
    code = exc.code() if hasattr(exc, "code") else None
    name = code.name if code is not None else "UNKNOWN"
    details = exc.details() if hasattr(exc, "details") else str(exc)
    kind = BY_CODE.get(name, DaemonError)
    if name == "UNAVAILABLE" and "permission denied" in (details or "").lower():
        # connect() failed with EACCES: the socket exists but this user may not use it
        name, kind = "PERMISSION_DENIED", PermissionDenied
        details = (f"permission denied on kvpoold's socket {address}: join the socket's group "
                   f"(socket_group) or ask the operator ({details})")
    elif name == "UNAVAILABLE":
        details = f"kvpoold is not reachable at {address} ({details})"
    elif name == "RESOURCE_EXHAUSTED" and (details or "").startswith(TOO_MANY_SESSIONS_PREFIX):
        kind = TooManySessions
    elif name == "RESOURCE_EXHAUSTED" and (details or "").startswith(TOO_MANY_CLASSES_PREFIX):
        kind = TooManyClasses
    elif name == "RESOURCE_EXHAUSTED" and MESSAGE_TOO_LARGE in (details or ""):
        kind = InvalidArgument
        details = f"the call is larger than kvpoold reads (its max_message_bytes): split it ({details})"
    err = kind(details or name)
    err.code = name
    return err
