"""Eviction policies: pure objects that only order keys.

A policy never owns memory; the pool or tier index asks it which key to give
up next.  New policies (LFU, ARC, ...) implement the same methods.  The
``*_many`` ones act on a batch (an eviction pass, a swap, a promotion is
thousands of keys) with one C-level call each, and mean exactly the same as
the single-key methods applied in order.  A key may carry a *stamp* (the
caller's clock when it became evictable, ``stamps``), so that keys of
different policies can be compared by age.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from itertools import islice, repeat
from math import isqrt
from typing import Generic, Hashable, Iterator, TypeVar

K = TypeVar("K", bound=Hashable)


class LRUPolicy(Generic[K]):
    """Least recently used first.  Every method is O(1) (a C OrderedDict)."""

    name = "lru"

    __slots__ = ("_order",)

    def __init__(self) -> None:
        self._order: OrderedDict[K, None] = OrderedDict()

    def insert(self, key: K, stamp: int | None = None) -> None:
        """A key becomes evictable; it is the most recently used."""
        self._order[key] = stamp

    def remove(self, key: K) -> None:
        """A key stops being evictable (reused, or dropped by its owner)."""
        del self._order[key]

    def insert_many(self, keys, stamp: int | None = None) -> None:
        """``insert`` of each key, in order (keys not present yet)."""
        deque(map(self._order.__setitem__, keys, repeat(stamp)), 0)  # faster than update() for an OrderedDict

    def stamps(self) -> Iterator[int | None]:
        """Each key's stamp, in the order of ``iter``."""
        return iter(self._order.values())

    def present(self, keys) -> list[K]:
        """The keys that are evictable here, in the given order."""
        return list(filter(self._order.__contains__, keys))

    def isdisjoint(self, keys) -> bool:
        """Whether none of the keys is evictable here."""
        return self._order.keys().isdisjoint(keys)

    def remove_many(self, keys) -> None:
        """``remove`` of each key, in order; KeyError at the first one not here (the ones before it are gone)."""
        deque(map(self._order.__delitem__, keys), 0)

    def victims(self, n: int) -> list[K]:
        """Remove and return the ``n`` keys ``victim`` would give next, in that order."""
        order = self._order
        if n >= len(order):
            out = list(order)
            order.clear()
            return out
        out = list(islice(order, n))
        deque(map(order.__delitem__, out), 0)
        return out

    def touch(self, key: K) -> None:
        self._order.move_to_end(key)

    def victim(self) -> K:
        """Remove and return the key to evict next; KeyError when empty."""
        return self._order.popitem(last=False)[0]

    def peek(self) -> K:
        return next(iter(self._order))

    def __contains__(self, key: object) -> bool:
        return key in self._order

    def __len__(self) -> int:
        return len(self._order)

    def __iter__(self) -> Iterator[K]:
        """Oldest first: the order in which victims would come."""
        return iter(self._order)



class DictLRU(LRUPolicy[K]):
    """``LRUPolicy`` over a plain dict (insertion order is the LRU order), for the tier indexes.

    A tier's batches are tens of thousands of keys whose hashes the index's
    own dict has just computed: ``insert_many`` of a dict (``TierIndex.add_many``
    passes one) copies those stored hashes in one C call, where an
    ``OrderedDict`` hashes every key again and links a node per key (about
    5x the cost).  The price is at the front: a dict leaves a hole where a
    key was deleted and scans past the holes before its first key, so the
    single-key ``victim`` rebuilds the dict (dropping the holes) after about
    ``sqrt(n)`` pops; batch paths (``victims``) pay one scan per batch.
    """

    __slots__ = ("_pops",)

    def __init__(self) -> None:
        self._order: dict = {}  # type: ignore[assignment]
        self._pops = 0  # single pops from the front since the dict was last rebuilt

    def insert_many(self, keys, stamp: int | None = None) -> None:
        """``insert`` of each key, in order (keys not present yet); a dict's stored hashes are reused (and its
        values are the stamps)."""
        self._order.update(keys if isinstance(keys, dict) else dict.fromkeys(keys, stamp))

    def touch(self, key: K) -> None:
        self._order[key] = self._order.pop(key)

    def victim(self) -> K:
        """Remove and return the oldest key; KeyError when empty."""
        order = self._order
        if not order:
            raise KeyError("victim(): no evictable key")
        key = next(iter(order))
        del order[key]
        self._pops += 1
        if self._pops > 64 + isqrt(len(order)):
            self._order = dict(order)  # a copy has no holes (stored hashes: nothing is hashed again)
            self._pops = 0
        return key

POLICIES = {"lru": LRUPolicy}


def make_policy(name: str) -> LRUPolicy:
    try:
        return POLICIES[name]()
    except KeyError:
        raise ValueError(f"unknown eviction policy {name!r}; known: {sorted(POLICIES)}") from None
