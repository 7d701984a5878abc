"""Bounds on what one call or one session may carry: strings, tokens per call, sequences per session.

Each is read from the live configuration (SIGHUP changes it) and checked
before the core runs, so a refused call changed nothing.  0 means no bound.
"""

from __future__ import annotations

from typing import Callable

from kvpoold.config import EXTRA_KEY_FACTOR, Config
from kvpoold.core import KVCacheManager
from kvpoold.core.errors import KvpoolError


class LimitExceeded(KvpoolError, MemoryError):
    """A session would hold more sequences than ``max_sequences_per_session``; nothing was changed."""

    code = "RESOURCE_EXHAUSTED"

    def __init__(self, limit_name: str, limit: int, held: int, needed: int) -> None:
        self.limit_name, self.limit, self.held, self.needed = limit_name, limit, held, needed
        super().__init__(
            f"limit {limit_name}={limit} exceeded: the session holds {held} sequences and this call adds {needed}"
        )


class CallTooLarge(KvpoolError, ValueError):
    """One call carries more tokens than ``max_tokens_per_call``; nothing was changed."""

    code = "INVALID_ARGUMENT"

    def __init__(self, limit_name: str, limit: int, ntokens: int) -> None:
        self.limit_name, self.limit, self.ntokens = limit_name, limit, ntokens
        super().__init__(f"limit {limit_name}={limit} exceeded: this call carries {ntokens} tokens "
                         f"(split it into smaller calls)")


class StringTooLong(KvpoolError, ValueError):
    """A client string (name, model id, extra key...) longer than ``max_string_bytes`` allows."""

    code = "INVALID_ARGUMENT"

    def __init__(self, what: str, limit: int, nbytes: int) -> None:
        super().__init__(f"{what} is {nbytes} bytes; at most {limit} are allowed (max_string_bytes)")


def check_string(config: Config, what: str, value: str, factor: int = 1) -> None:
    """Refuse a client string over the limit before it reaches the core, a log or the stats."""
    limit = config.max_string_bytes * factor
    if limit and len(value) > limit // 4:  # a str's UTF-8 bytes are at most 4 per character
        nbytes = len(value.encode("utf-8", "surrogatepass"))
        if nbytes > limit:
            raise StringTooLong(what, limit, nbytes)


class Limits:
    """Per-call and per-session bounds of one pool's sessions."""

    def __init__(self, manager: KVCacheManager, live_config: Callable[[], Config]) -> None:
        self.manager = manager
        self._config = live_config

    def check_extra_key(self, extra_key: str) -> None:
        check_string(self._config(), "extra_key", extra_key, EXTRA_KEY_FACTOR)

    def check_sequences(self, session, adding: int) -> None:
        limit = self._config().max_sequences_per_session
        if not limit or adding <= 0:
            return
        held = self.manager.owners().get(session.id, (0, 0))[0]
        if held + adding > limit:
            raise LimitExceeded("max_sequences_per_session", limit, held, adding)

    def check_tokens(self, ntokens: int) -> None:
        limit = self._config().max_tokens_per_call
        if limit and ntokens > limit:
            raise CallTooLarge("max_tokens_per_call", limit, ntokens)


__all__ = ["CallTooLarge", "LimitExceeded", "Limits", "StringTooLong", "check_string"]
