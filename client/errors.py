"""Typed errors of the client library, one per gRPC status the daemon answers with."""

from __future__ import annotations

import grpc


class KvpoolError(Exception):
    """Base of every error the client raises; ``code`` is the gRPC status name."""

    code = "UNKNOWN"

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class InvalidArgument(KvpoolError, ValueError):
    code = "INVALID_ARGUMENT"


class NotFound(KvpoolError, KeyError):
    """Unknown or already freed sequence."""

    code = "NOT_FOUND"

    def __str__(self) -> str:
        return self.message


class OutOfBlocks(KvpoolError, MemoryError):
    """The pool (or a quota) cannot hold the request; nothing was changed."""

    code = "RESOURCE_EXHAUSTED"


class PermissionDenied(KvpoolError, PermissionError):
    """The sequence belongs to another session, the call needs more rights, or the
    socket refuses this user (not in the daemon's ``socket_group``)."""

    code = "PERMISSION_DENIED"


class TooManySessions(KvpoolError):
    """The daemon serves ``max_sessions`` sessions already; attach later or raise the limit.

    Not an ``OutOfBlocks``: the pool may have plenty of room.
    """

    code = "RESOURCE_EXHAUSTED"


# The daemon's TooManySessions message starts with this; RESOURCE_EXHAUSTED
# alone cannot tell it from a full pool.
TOO_MANY_SESSIONS_PREFIX = "too many sessions:"


class TooManyClasses(KvpoolError):
    """A new layout (geometry) would exceed the daemon's ``max_classes`` or ``max_classes_per_tenant`` and
    no idle class could be reclaimed; detach a model of another geometry or ask for a higher cap.

    Not an ``OutOfBlocks``: the pool may have plenty of room.
    """

    code = "RESOURCE_EXHAUSTED"


# The daemon's TooManyClasses message starts with this (kvpoold.core.errors)
TOO_MANY_CLASSES_PREFIX = "too many layout classes:"


# gRPC's own words when a message exceeds the receiving side's limit (the daemon's max_message_bytes):
# the caller's call is too large, not the pool too full.
MESSAGE_TOO_LARGE = "Received message larger than max"


class FailedPrecondition(KvpoolError, RuntimeError):
    code = "FAILED_PRECONDITION"


class SessionExpired(KvpoolError, RuntimeError):
    """The daemon no longer knows this session (it was dropped); attach again."""

    code = "UNAUTHENTICATED"


class Unavailable(KvpoolError, ConnectionError):
    """The daemon is not running or not reachable on the socket."""

    code = "UNAVAILABLE"


class DaemonError(KvpoolError, RuntimeError):
    """Anything else the daemon answered (INTERNAL, ...)."""


_BY_CODE = {cls.code: cls for cls in (
    InvalidArgument, NotFound, OutOfBlocks, PermissionDenied, FailedPrecondition, SessionExpired, Unavailable,
)}


def from_rpc_error(exc: grpc.RpcError, address: str) -> KvpoolError:
    code = exc.code() if hasattr(exc, "code") else None
    name = code.name if code is not None else "UNKNOWN"
    details = exc.details() if hasattr(exc, "details") else str(exc)
    kind = _BY_CODE.get(name, DaemonError)
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
