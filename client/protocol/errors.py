"""The errors both sides name, each with the gRPC status it travels as (standard library only).

``code`` is the status's name (``grpc.StatusCode[code]``): the daemon's server
answers a raised error with it, the client turns a status back into the class
(``kvpool.errors.from_rpc_error``).  No gRPC here, so the daemon's core raises
these same classes (or subclasses that carry more, ``kvpoold.core.errors``).
"""

from __future__ import annotations


class KvpoolError(Exception):
    """Base of every error either side raises on a caller's mistake or a full pool; ``code`` is the status name."""

    code = "UNKNOWN"

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class InvalidArgument(KvpoolError, ValueError):
    """Malformed input: bad token ids, negative counts, duplicate ids, bad layout."""

    code = "INVALID_ARGUMENT"


class NotFound(KvpoolError, KeyError):
    """Unknown or already freed sequence."""

    code = "NOT_FOUND"

    def __str__(self) -> str:  # KeyError quotes its message; we don't want that
        return self.message


class OutOfBlocks(KvpoolError, MemoryError):
    """The pool (or a quota) cannot hold the request; nothing was changed."""

    code = "RESOURCE_EXHAUSTED"


class PermissionDenied(KvpoolError, PermissionError):
    """The sequence belongs to another session, the call needs more rights, or the
    socket refuses this user (not in the daemon's ``socket_group``)."""

    code = "PERMISSION_DENIED"


class FailedPrecondition(KvpoolError, RuntimeError):
    """The call is valid in general but not in the object's current state."""

    code = "FAILED_PRECONDITION"


class SessionExpired(KvpoolError, RuntimeError):
    """The daemon no longer knows this session (it was dropped); attach again."""

    code = "UNAUTHENTICATED"


class Unavailable(KvpoolError, ConnectionError):
    """The daemon is not running or not reachable on the socket."""

    code = "UNAVAILABLE"


class DaemonError(KvpoolError, RuntimeError):
    """Anything else the daemon answered (INTERNAL, ...)."""


#: a ``TooManySessions`` message starts with this: RESOURCE_EXHAUSTED alone cannot tell it from a full pool
TOO_MANY_SESSIONS_PREFIX = "too many sessions:"

#: a ``TooManyClasses`` message starts with this, for the same reason
TOO_MANY_CLASSES_PREFIX = "too many layout classes:"


class TooManySessions(KvpoolError):
    """The daemon serves ``max_sessions`` sessions already; attach later or raise the limit.

    Not an ``OutOfBlocks``: the pool may have plenty of room.
    """

    code = "RESOURCE_EXHAUSTED"


class TooManyClasses(KvpoolError):
    """A new layout (geometry) would exceed the daemon's ``max_classes`` or ``max_classes_per_tenant`` and
    no idle class could be reclaimed; detach a model of another geometry or ask for a higher cap.

    Not an ``OutOfBlocks``: the pool may have plenty of room.
    """

    code = "RESOURCE_EXHAUSTED"


#: the one class each status name comes back as, where the name alone decides it
BY_CODE: dict[str, type[KvpoolError]] = {cls.code: cls for cls in (
    InvalidArgument, NotFound, OutOfBlocks, PermissionDenied, FailedPrecondition, SessionExpired, Unavailable,
)}
