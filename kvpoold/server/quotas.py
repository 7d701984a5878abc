"""How much of a pool's memory a session and its user may hold: per-session quota, per-user share.

* **Quota**: ``max_blocks_per_session`` bounds the device blocks a session's
  sequences hold (a block two of its sequences share counts twice).  A call
  that would cross it is refused *before* the core allocates anything
  (:class:`QuotaExceeded`, RESOURCE_EXHAUSTED, naming the quota), so the core's
  validate-then-apply rule holds: a refused call changed nothing.  The
  session's reserve is not counted, but it is never topped up past the quota.
* **Share**: a pool's memory is shared by :class:`PoolShares`: with
  ``fair_share`` a user (the uid the kernel reported at attach, whatever
  ``tenant_by`` says) may hold at most the pool divided by the users with a
  session on it, and never more than ``max_pool_share_per_user`` of it; a call
  that would take the user past that is refused like a quota
  (:class:`ShareExceeded`).  A user alone may use the whole pool; once a second
  user attaches, a user above its share cannot grow, so the memory it frees
  goes to the others.  Held bytes are the user's sequences' blocks (counted as
  for the quota) and reserves; cached blocks are not held: they are evicted
  for whoever needs the memory.

Both read the live configuration through a callable (SIGHUP replaces it) and
the pool's core; every check reads state only and runs on the event loop
before the core call.
"""

from __future__ import annotations

from typing import Callable

from kvpool.protocol.sizes import cdiv
from kvpoold.config import Config
from kvpoold.core import KVCacheManager
from kvpoold.core.errors import KvpoolError


class QuotaExceeded(KvpoolError, MemoryError):
    """A session would hold more blocks than its quota allows; nothing was changed."""

    code = "RESOURCE_EXHAUSTED"

    def __init__(self, quota: str, limit: int, held: int, needed: int) -> None:
        self.quota, self.limit, self.held, self.needed = quota, limit, held, needed
        super().__init__(
            f"quota {quota}={limit} exceeded: the session holds {held} blocks and this call needs {needed} more"
        )


class ShareExceeded(KvpoolError, MemoryError):
    """A user would hold more of a pool than its share (``fair_share``, ``max_pool_share_per_user``)."""

    code = "RESOURCE_EXHAUSTED"

    def __init__(self, uid: int, ceiling: int, held: int, needed: int, pool_bytes: int, users: int,
                 fair: bool) -> None:
        why = f"fair_share: a pool of {pool_bytes} bytes shared by {users} users" if fair else \
            f"max_pool_share_per_user of a pool of {pool_bytes} bytes"
        super().__init__(f"pool share of uid {uid} exceeded: it holds {held} bytes, may hold {ceiling} ({why}), "
                         f"and this call needs {needed} more; free sequences and retry")


def uid_of(session) -> int | None:
    """The user of a session (its kernel credentials at attach); None for an in-process caller."""
    return None if session.creds is None else session.creds.uid


class PoolShares:
    """The users with a session on one pool, and the most device memory each may hold there."""

    def __init__(self, manager: KVCacheManager, live_config: Callable[[], Config]) -> None:
        self.manager = manager
        self._config = live_config
        self._sessions: dict[int, set[int]] = {}  # uid -> its sessions bound to this pool

    def bind(self, session) -> None:
        uid = uid_of(session)
        if uid is not None:
            self._sessions.setdefault(uid, set()).add(session.id)

    def unbind(self, session) -> None:
        mine = self._sessions.get(uid_of(session))
        if mine is not None:
            mine.discard(session.id)
            if not mine:
                del self._sessions[uid_of(session)]

    @property
    def users(self) -> int:
        return len(self._sessions)

    @property
    def pool_bytes(self) -> int:
        budget = self.manager.budget
        return budget.total * budget.chunk_bytes

    def _fair(self) -> bool:
        """Whether the fair share (pool / users) is what bounds a user, rather than max_pool_share_per_user."""
        config = self._config()
        return config.fair_share and len(self._sessions) > 1 and \
            1 / len(self._sessions) <= config.max_pool_share_per_user

    def ceiling(self, session) -> int | None:
        """Bytes of this pool the session's user may hold; None when nothing bounds it below the pool."""
        if uid_of(session) is None:
            return None
        share = 1 / len(self._sessions) if self._fair() else self._config().max_pool_share_per_user
        return int(self.pool_bytes * share) if share < 1 else None

    def held(self, session) -> int:
        """Bytes the session's user holds on this pool: its sequences' blocks and its reserves."""
        return self.manager.held_bytes(self._sessions.get(uid_of(session), ()))

    def headroom(self, session, ceiling: int) -> int:
        """Blocks of the session's class its user may still take under ``ceiling``."""
        return max(0, (ceiling - self.held(session)) // self.block_bytes(session))

    def block_bytes(self, session) -> int:
        return self.manager.classes[session.class_id].block_bytes

    def check(self, session, needed_blocks: int) -> None:
        """``ShareExceeded`` if ``needed_blocks`` more blocks of its class take the user past its share."""
        ceiling = self.ceiling(session)
        if ceiling is None or needed_blocks <= 0:
            return
        held, needed = self.held(session), needed_blocks * self.block_bytes(session)
        if held + needed > ceiling:
            raise ShareExceeded(uid_of(session), ceiling, held, needed, self.pool_bytes, self.users, self._fair())


class Quotas:
    """Per-session quota and per-user share of one pool, read from the live config (so SIGHUP changes them)."""

    QUOTA = "max_blocks_per_session"

    def __init__(self, manager: KVCacheManager, live_config: Callable[[], Config]) -> None:
        self.manager = manager
        self._config = live_config
        self.shares = PoolShares(manager, live_config)

    @property
    def limit(self) -> int:
        return self._config().max_blocks_per_session

    def held(self, session) -> int:
        """Device blocks in the session's sequences' page tables (swapped-out ones hold none)."""
        return self.manager.held_device_blocks(session.id)

    def _bounded(self, session) -> bool:
        """Whether a quota or a share bounds this session's growth now (else the calls skip counting)."""
        return bool(self.limit) or self.shares.ceiling(session) is not None

    def _check(self, session, needed: int, claimed: int = 0) -> None:
        """``needed`` more blocks in the session's page tables, ``claimed`` of them from its own reserve."""
        limit = self.limit
        if limit and needed > 0:
            held = self.held(session)
            if held + needed > limit:
                raise QuotaExceeded(self.QUOTA, limit, held, needed)
        self.shares.check(session, needed - claimed)  # a claimed block was the user's already (its reserve)

    # -- per call ---------------------------------------------------------------------
    def check_create(self, session, token_counts: list[int]) -> None:
        if self._bounded(session):
            bs = self.manager.block_size(session.class_id)
            self._check(session, sum(cdiv(n, bs) for n in token_counts))

    def check_fork(self, session, seq_ids: list[int]) -> None:
        if self._bounded(session):
            m = self.manager
            self._check(session, sum(len(m.sequence(session.id, i).block_table) for i in seq_ids))

    def step_admission(self, session, free_ids: list[int], *, claimed: int = 0) -> Callable[[int], None] | None:
        """What checks a step's growth, as the core's ``extend_columns(admit=...)`` computes it: the blocks
        the extends add, less what the step's frees give back (frees run after the extends); None if no quota
        or share bounds the session."""
        if not self._bounded(session):
            return None

        def admit(grow: int) -> None:
            if grow:
                self._check(session, grow - self.manager.device_blocks_of(session.id, free_ids), claimed)

        return admit

    def check_swap_in(self, session, seq_ids: list[int]) -> None:
        """Swapping in brings a sequence's blocks back onto the device: they count again."""
        if self._bounded(session):
            self._check(session, self.manager.device_blocks_of(session.id, seq_ids))

    def reserve_target(self, session, target: int) -> int:
        """The reserve top-up a step may ask for: never past the quota's headroom nor the user's share."""
        if not target:
            return target
        limit, ceiling = self.limit, self.shares.ceiling(session)
        if limit:
            target = max(0, min(target, limit - self.held(session)))
        if ceiling is not None:
            reserve = len(self.manager.reserve(session.id, session.class_id))
            target = min(target, reserve + self.shares.headroom(session, ceiling))
        return target


__all__ = ["PoolShares", "QuotaExceeded", "Quotas", "ShareExceeded", "uid_of"]
