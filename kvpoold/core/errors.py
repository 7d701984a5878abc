"""Typed errors of the core.

Every core call validates first and mutates after, so an error always means
"nothing changed".  The server maps each class to one gRPC status code
(``kvpoold/server/errors.py``); the client re-raises the same names.
"""

from __future__ import annotations


class KvpoolError(Exception):
    """Base of every error the core raises on a caller's mistake or a full pool."""

    code = "INTERNAL"


class InvalidArgument(KvpoolError, ValueError):
    """Malformed input: bad token ids, negative counts, duplicate ids, bad layout."""

    code = "INVALID_ARGUMENT"


class UnknownSequence(KvpoolError, KeyError):
    """The sequence id was never created, or was already freed."""

    code = "NOT_FOUND"

    def __str__(self) -> str:  # KeyError quotes its message; we don't want that
        return str(self.args[0]) if self.args else "unknown sequence"


class NotOwner(KvpoolError, PermissionError):
    """A session named a sequence (or reserved block) that belongs to another session."""

    code = "PERMISSION_DENIED"


class WrongState(KvpoolError, RuntimeError):
    """The call is valid in general but not in the object's current state."""

    code = "FAILED_PRECONDITION"


class LayoutDoesNotFit(InvalidArgument):
    """A layout whose single block (or slab) is larger than the whole pool."""


class OutOfBlocks(KvpoolError, MemoryError):
    """Not enough blocks for the whole call; nothing was allocated.

    ``needed`` is what the call required, ``available`` what the class could
    have obtained (free + evictable cached + memory other classes could give).
    """

    code = "RESOURCE_EXHAUSTED"

    def __init__(self, needed: int, available: int, what: str = "blocks") -> None:
        self.needed = needed
        self.available = available
        super().__init__(f"out of {what}: needed {needed}, available {available}")


#: a ``TooManyClasses`` message starts with this: the client tells it from a full pool by it
TOO_MANY_CLASSES_PREFIX = "too many layout classes:"


class TooManyClasses(KvpoolError):
    """A new layout class would exceed ``max_classes`` or ``max_classes_per_tenant`` even after idle
    classes were reclaimed; nothing was changed."""

    code = "RESOURCE_EXHAUSTED"

    def __init__(self, detail: str) -> None:
        super().__init__(f"{TOO_MANY_CLASSES_PREFIX} {detail}")
