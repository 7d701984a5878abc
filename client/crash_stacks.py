"""Every thread's Python stack on a native crash, for the long-running processes (kvpoold, kvpool serve)."""

from __future__ import annotations

import contextlib
import faulthandler


def show_stacks_on_native_crash() -> None:
    """A crash in a driver or a C extension (SIGSEGV, SIGABRT, ...) prints every thread's stack to stderr: the
    journal or the log. Nothing happens where stderr has no file (an embedding process)."""
    with contextlib.suppress(OSError, ValueError, AttributeError):
        faulthandler.enable()
