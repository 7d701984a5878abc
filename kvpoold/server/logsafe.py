"""Client strings made safe to log: one helper for every place that logs one.

A client chooses its name, model id, revision and extra keys.  Logged as is, a
newline forges a log line (``x\\nERROR ...``) and a megabyte name fills the
journal.  ``printable`` escapes control and non-printable characters the way
``repr`` does and keeps at most ``limit`` characters, marking what it cut.
"""

from __future__ import annotations

DEFAULT_LIMIT = 200


def printable(s: object, limit: int = DEFAULT_LIMIT) -> str:
    """``s`` with control characters escaped (``\\n``, ``\\x1b``...), cut to ``limit`` characters."""
    text = s.decode("utf-8", "replace") if isinstance(s, (bytes, bytearray)) else str(s)
    cut = len(text) - limit if len(text) > limit else 0
    if cut:
        text = text[:limit]
    out = "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)
    return f"{out}...[{cut} more chars]" if cut else out
