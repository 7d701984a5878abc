"""Who may do what: admin-only calls, drain, per-user caps.

* **Attach**: decided by the file system — the socket's mode and group
  (``socket_mode``, ``socket_group``).  Nothing to check here.
* **Own sequences only**: the core answers ``NotOwner`` (PERMISSION_DENIED).
* **Admin calls** (evict, drain, another session's sequences) are served only
  on the admin socket (``admin_socket``, mode 0600 by default); the servicer
  bound to the normal socket raises :class:`AdminOnly`.
* **Drain**: no new attaches and no new sequences; running ones go on.
* **Quotas and shares** of a pool's memory: ``quotas.py``; bounds on one
  call or session (tokens, sequences, strings): ``limits.py``.
* **Per-user caps**: what one user (the uid the kernel reported at attach,
  whatever ``tenant_by`` says) may hold at once is capped, so that one user
  cannot lock the others out: attach tickets, sessions and side-socket
  connections are counted with :class:`PerUser` where they are made
  (``handoff.py``, ``sessions.py``).

Every check reads state only; the service calls them first, on the event
loop, like everything else.
"""

from __future__ import annotations

from collections import Counter

from kvpoold.core.errors import KvpoolError


class AdminOnly(KvpoolError, PermissionError):
    """An admin call arrived on the normal socket."""

    code = "PERMISSION_DENIED"

    def __init__(self, what: str, admin_socket: str) -> None:
        where = f"the admin socket {admin_socket}" if admin_socket else "the admin socket (none is configured)"
        super().__init__(f"{what} is an admin call: use {where}")


class Draining(KvpoolError, RuntimeError):
    """The daemon is draining: existing sequences go on, nothing new starts."""

    code = "FAILED_PRECONDITION"

    def __init__(self, what: str) -> None:
        super().__init__(f"kvpoold is draining: no {what} (an operator can resume with `kvpoolctl drain --off`)")


class PerUser:
    """How many of something each user (uid) holds, against a cap read when taking one (0: no cap)."""

    def __init__(self) -> None:
        self._held: Counter[int] = Counter()

    def __getitem__(self, uid: int) -> int:
        return self._held[uid]

    def take(self, uid: int, cap: int) -> bool:
        """One more for ``uid`` unless it holds ``cap`` already; says whether it took one."""
        if cap and self._held[uid] >= cap:
            return False
        self._held[uid] += 1
        return True

    def give(self, uid: int) -> None:
        self._held[uid] -= 1
        if self._held[uid] <= 0:
            del self._held[uid]


__all__ = ["AdminOnly", "Draining", "PerUser"]
