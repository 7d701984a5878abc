"""The one place where errors become gRPC status codes.

The core raises typed errors (``kvpoold.core.errors``); the memory backends
raise theirs; the service raises ``UnknownSession``/``TooManySessions``.
Anything else is a bug: it is logged with its traceback and answered INTERNAL.
"""

from __future__ import annotations

import logging

import grpc

from kvpoold.core.errors import KvpoolError
from kvpool.ipc import BackendUnavailable, DeviceMismatch
from kvpoold.memory import PoolDoesNotFit

log = logging.getLogger("kvpoold")


class UnknownSession(Exception):
    """The session token names no live session (never attached, detached or expired)."""


class TooManySessions(Exception):
    """The daemon's session limit is reached."""


class ShuttingDown(Exception):
    """The daemon is stopping and takes no new work."""


_BY_TYPE: list[tuple[type, grpc.StatusCode]] = [
    (UnknownSession, grpc.StatusCode.UNAUTHENTICATED),
    (TooManySessions, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (ShuttingDown, grpc.StatusCode.UNAVAILABLE),
    (PoolDoesNotFit, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (DeviceMismatch, grpc.StatusCode.FAILED_PRECONDITION),
    (BackendUnavailable, grpc.StatusCode.FAILED_PRECONDITION),
]


def status_for(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """(status code, message) for an exception raised while serving a call."""
    if isinstance(exc, KvpoolError):
        return grpc.StatusCode[exc.code], str(exc)
    for kind, code in _BY_TYPE:
        if isinstance(exc, kind):
            return code, str(exc)
    if isinstance(exc, (ValueError, TypeError, OverflowError)):  # malformed packed arrays and the like
        return grpc.StatusCode.INVALID_ARGUMENT, str(exc)
    log.exception("internal error while serving a call")
    return grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}: {exc}"
