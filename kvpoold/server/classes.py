"""Which layout classes of a pool are in use, reclaiming the others, and the caps on how many exist.

Every distinct (tenant, geometry) that attaches makes a layout class with its
own arena (on the CPU backend a memfd and its mapping).  A class outlives its
sessions while the prefix cache holds blocks of it (the next client of that
model gets prefix hits), but not longer: once it has no session and no block
in any tier it is *reclaimed*: the core drops it, its arena is closed and its
id is reused.  ``DevicePool.sync_memory`` asks after every state change
(``reclaim``); only classes without sessions are looked at, with O(1) checks.

**Caps.**  ``max_classes`` (per device pool) and ``max_classes_per_tenant``
bound how many classes exist at once (0: no cap).  A new class that would
exceed one first reclaims *idle* classes (no session; only cached blocks),
least recently used first (the one whose last session ended longest ago):
their cached blocks are dropped from every tier and the classes with them.
Only when too few idle classes exist is the attach refused, with
``TooManyClasses`` (RESOURCE_EXHAUSTED) naming the cap; nothing is evicted then.
"""

from __future__ import annotations

import logging
from collections import Counter, OrderedDict
from typing import Callable

from kvpoold.core import KVCacheManager, TooManyClasses

log = logging.getLogger("kvpoold")


class ClassSessions:
    """One pool's sessions per class, and its classes without a session in least recently used order.

    ``pool_name`` names the pool to operators; ``close_class`` drops a class
    nothing is left of (its arena too); ``sync_memory`` runs the moves and slab
    changes the core planned (the pool's ``sync_memory``).
    """

    def __init__(self, manager: KVCacheManager, pool_name: str, *, close_class: Callable[[int], None],
                 sync_memory: Callable[[], object]) -> None:
        self.manager = manager
        self.pool_name = pool_name
        self._close_class = close_class
        self._sync_memory = sync_memory
        self.sessions: Counter[int] = Counter()
        #: classes without a session, the one idle longest first (disk-tier classes found at start, too)
        self.idle: OrderedDict[int, None] = OrderedDict.fromkeys(manager.live_classes())

    # -- sessions ------------------------------------------------------------------------------
    def opened(self, class_id: int) -> None:
        """A class was registered: idle until a session is bound (an attach that fails later leaves it idle)."""
        if not self.sessions[class_id]:
            self.idle.setdefault(class_id)

    def attached(self, class_id: int) -> None:
        self.sessions[class_id] += 1
        self.idle.pop(class_id, None)

    def detached(self, class_id: int) -> None:
        """A session of ``class_id`` ended; the class is idle (most recently) if that was its last."""
        self.sessions[class_id] -= 1
        if self.sessions[class_id] <= 0:
            del self.sessions[class_id]
            self.idle[class_id] = None
            self.idle.move_to_end(class_id)

    # -- reclaiming ----------------------------------------------------------------------------
    def reclaim(self) -> int:
        """Drop every idle class with nothing left in any tier; returns how many.

        Cheap when nothing can go: a class with cached blocks fails at the first check.
        """
        gone = [c for c in self.idle if self.manager.can_drop_class(c)]
        for cid in gone:
            self._close_class(cid)
            del self.idle[cid]
        return len(gone)

    def make_room(self, tenant: str, *, max_classes: int, max_classes_per_tenant: int) -> None:
        """Before a new class of ``tenant``: reclaim idle classes (least recently used first) until the
        new one fits ``max_classes_per_tenant`` and ``max_classes``.

        Args:
            tenant: the new class's tenant ("" when tenants are not told apart).
            max_classes, max_classes_per_tenant: the caps of the live configuration (0: none).
        Raises:
            TooManyClasses: not enough idle classes to reclaim; nothing was evicted.
        """
        manager = self.manager
        live = manager.live_classes()
        tenant_of = {c: manager.classes[c].geometry.tenant for c in live}
        spare = [c for c in self.idle if manager.holds_nothing_in(c)]
        victims: list[int] = []
        per_tenant = max_classes_per_tenant
        mine = sum(1 for t in tenant_of.values() if t == tenant)
        if per_tenant and mine >= per_tenant:
            victims = [c for c in spare if tenant_of[c] == tenant][:mine - per_tenant + 1]
            if len(victims) <= mine - per_tenant:
                raise TooManyClasses(
                    f"{_who(tenant)} has {mine} on {self.pool_name}, all in use, and max_classes_per_tenant is "
                    f"{per_tenant}: detach a model or raise max_classes_per_tenant")
        total = max_classes
        if total and len(live) - len(victims) >= total:
            more = len(live) - len(victims) - total + 1
            others = [c for c in spare if c not in victims][:more]
            if len(others) < more:
                raise TooManyClasses(
                    f"{self.pool_name} has {len(live)}, {len(live) - len(spare)} of them in use, and max_classes "
                    f"is {total}: detach a model or raise max_classes")
            victims += others
        for cid in victims:
            self._evict_and_drop(cid)

    def _evict_and_drop(self, class_id: int) -> None:
        dropped = self.manager.evict_class(class_id)
        self._sync_memory()  # runs the drops in the lower tiers; the class, empty now, is reclaimed there
        if class_id in self.idle:  # a move that did not finish keeps it (it goes at a later sync)
            log.warning("%s: class %d still has blocks after its cache was dropped", self.pool_name, class_id)
        else:
            log.info("%s: class %d reclaimed for a new class (%d cached blocks dropped)", self.pool_name, class_id,
                     dropped)


def _who(tenant: str) -> str:
    return f"tenant {tenant!r}" if tenant else "the only tenant"


__all__ = ["ClassSessions"]
