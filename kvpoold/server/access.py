"""Who may do what: admin-only calls, drain, and per-session quotas.

* **Attach**: decided by the file system — the socket's mode and group
  (``socket_mode``, ``socket_group``).  Nothing to check here.
* **Own sequences only**: the core answers ``NotOwner`` (PERMISSION_DENIED).
* **Admin calls** (evict, drain, another session's sequences) are served only
  on the admin socket (``admin_socket``, mode 0600 by default); the servicer
  bound to the normal socket raises :class:`AdminOnly`.
* **Drain**: no new attaches and no new sequences; running ones go on.
* **Quotas**: ``max_blocks_per_session`` bounds the device blocks a session's
  sequences hold (a block two of its sequences share counts twice).  A call
  that would cross it is refused *before* the core allocates anything
  (:class:`QuotaExceeded`, RESOURCE_EXHAUSTED, naming the quota), so the core's
  validate-then-apply rule holds: a refused call changed nothing.  The
  session's reserve is not counted, but it is never topped up past the quota.

Every check here reads state only; the service calls them first, on the
event loop, like everything else.
"""

from __future__ import annotations

import numpy as np

from kvpoold.core.errors import KvpoolError


class AdminOnly(KvpoolError, PermissionError):
    """An admin call arrived on the normal socket."""

    code = "PERMISSION_DENIED"

    def __init__(self, what: str, admin_socket: str) -> None:
        where = f"the admin socket {admin_socket}" if admin_socket else "the admin socket (none is configured)"
        super().__init__(f"{what} is an admin call: use {where}")


class QuotaExceeded(KvpoolError, MemoryError):
    """A session would hold more blocks than its quota allows; nothing was changed."""

    code = "RESOURCE_EXHAUSTED"

    def __init__(self, quota: str, limit: int, held: int, needed: int) -> None:
        self.quota, self.limit, self.held, self.needed = quota, limit, held, needed
        super().__init__(
            f"quota {quota}={limit} exceeded: the session holds {held} blocks and this call needs {needed} more"
        )


class Draining(KvpoolError, RuntimeError):
    """The daemon is draining: existing sequences go on, nothing new starts."""

    code = "FAILED_PRECONDITION"

    def __init__(self, what: str) -> None:
        super().__init__(f"kvpoold is draining: no {what} (an operator can resume with `kvpoolctl drain --off`)")


class Quotas:
    """Per-session limits, read from the service's current config (so SIGHUP changes them)."""

    QUOTA = "max_blocks_per_session"

    def __init__(self, service) -> None:
        self.service = service

    @property
    def limit(self) -> int:
        return self.service.config.max_blocks_per_session

    def held(self, session) -> int:
        """Device blocks in the session's sequences' page tables (swapped-out ones hold none)."""
        return self.service.manager.held_device_blocks(session.id)

    def _check(self, session, needed: int) -> None:
        limit = self.limit
        if not limit or needed <= 0:
            return
        held = self.held(session)
        if held + needed > limit:
            raise QuotaExceeded(self.QUOTA, limit, held, needed)

    # -- per call ---------------------------------------------------------------------
    def check_create(self, session, token_counts: list[int]) -> None:
        if self.limit:
            bs = self.service.manager.block_size(session.class_id)
            self._check(session, sum(-(-n // bs) for n in token_counts))

    def check_fork(self, session, seq_ids: list[int]) -> None:
        if self.limit:
            m = self.service.manager
            self._check(session, sum(len(m.sequence(session.id, i).block_table) for i in seq_ids))

    def check_step(self, session, seq_ids: np.ndarray, counts: np.ndarray | None, ntokens: int,
                   free_ids: list[int]) -> None:
        """Blocks the extends add, less what the step's frees give back (frees run after the extends)."""
        if not self.limit or not len(seq_ids):
            return
        m = self.service.manager
        grow = m.extend_growth(session.id, seq_ids, counts)  # the core's own ownership errors first
        sent = len(seq_ids) if counts is None else int(np.sum(counts))
        if grow is None or sent != ntokens:
            return  # malformed: the core rejects it with the precise message
        self._check(session, grow - m.device_blocks_of(session.id, free_ids))

    def check_swap_in(self, session, seq_ids: list[int]) -> None:
        """Swapping in brings a sequence's blocks back onto the device: they count again."""
        if self.limit:
            self._check(session, self.service.manager.device_blocks_of(session.id, seq_ids))

    def reserve_target(self, session, target: int) -> int:
        """The reserve top-up a step may ask for: never past the quota's headroom."""
        limit = self.limit
        if not limit or not target:
            return target
        return max(0, min(target, limit - self.held(session)))


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


# An extra key (e.g. a LoRA id, or a serialized adapter list) may need more room than a name.
EXTRA_KEY_FACTOR = 4


def check_string(config, what: str, value: str, factor: int = 1) -> None:
    """Refuse a client string over the limit before it reaches the core, a log or the stats."""
    limit = config.max_string_bytes * factor
    if limit and len(value) > limit // 4:  # a str's UTF-8 bytes are at most 4 per character
        nbytes = len(value.encode("utf-8", "surrogatepass"))
        if nbytes > limit:
            raise StringTooLong(what, limit, nbytes)


class Limits:
    """Per-call and per-session bounds, read from the live config; checked before the core runs."""

    def __init__(self, service) -> None:
        self.service = service

    def check_extra_key(self, extra_key: str) -> None:
        check_string(self.service.config, "extra_key", extra_key, EXTRA_KEY_FACTOR)

    def check_sequences(self, session, adding: int) -> None:
        limit = self.service.config.max_sequences_per_session
        if not limit or adding <= 0:
            return
        held = self.service.manager.owners().get(session.id, (0, 0))[0]
        if held + adding > limit:
            raise LimitExceeded("max_sequences_per_session", limit, held, adding)

    def check_tokens(self, ntokens: int) -> None:
        limit = self.service.config.max_tokens_per_call
        if limit and ntokens > limit:
            raise CallTooLarge("max_tokens_per_call", limit, ntokens)
