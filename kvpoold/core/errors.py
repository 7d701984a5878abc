"""Typed errors of the core.

Every core call validates first and mutates after, so an error always means
"nothing changed".  The classes are the shared ones of ``kvpool.protocol.errors``
(each names its gRPC status; the server answers with it and the client raises the
same class); the core's own names below are subclasses that say more.
"""

from __future__ import annotations

from kvpool.protocol.errors import (
    TOO_MANY_CLASSES_PREFIX,
    FailedPrecondition,
    InvalidArgument,
    KvpoolError,
    NotFound,
    PermissionDenied,
)
from kvpool.protocol.errors import OutOfBlocks as _OutOfBlocks
from kvpool.protocol.errors import TooManyClasses as _TooManyClasses


class UnknownSequence(NotFound):
    """The sequence id was never created, or was already freed."""


class NotOwner(PermissionDenied):
    """A session named a sequence (or reserved block) that belongs to another session."""


class WrongState(FailedPrecondition):
    """The call is valid in general but not in the object's current state."""


class LayoutDoesNotFit(InvalidArgument):
    """A layout whose single block (or slab) is larger than the whole pool."""


class OutOfBlocks(_OutOfBlocks):
    """Not enough blocks for the whole call; nothing was allocated.

    ``needed`` is what the call required, ``available`` what the class could
    have obtained (free + evictable cached + memory other classes could give).
    """

    def __init__(self, needed: int, available: int, what: str = "blocks") -> None:
        self.needed = needed
        self.available = available
        super().__init__(f"out of {what}: needed {needed}, available {available}")


class TooManyClasses(_TooManyClasses):
    """A new layout class would exceed ``max_classes`` or ``max_classes_per_tenant`` even after idle
    classes were reclaimed; nothing was changed."""

    def __init__(self, detail: str) -> None:
        super().__init__(f"{TOO_MANY_CLASSES_PREFIX} {detail}")


__all__ = [
    "KvpoolError", "InvalidArgument", "UnknownSequence", "NotOwner", "WrongState", "LayoutDoesNotFit", "OutOfBlocks",
    "TooManyClasses", "TOO_MANY_CLASSES_PREFIX",
]
