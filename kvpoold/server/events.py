"""KV events for cache-aware routers: which blocks were stored in, removed from or moved between tiers.

Each device pool reports after every state change (``DevicePool.sync_memory``):
the core's journal says which device blocks were stored (their writer
confirmed them) and removed (evicted); the planned moves say the rest
(demotions, promotions, drops, copies to the remote tier).  Only prefix
blocks are reported (swapped-out sequences' blocks are nobody's hits).

``EventBus`` keeps the most recent events (``kvpoolctl events`` shows them)
and hands each new one to every subscriber's bounded queue: a consumer that
falls behind loses events, counted, and is told with one ``gap`` event; it
never holds the daemon back.  Everything runs on the event loop.
"""

from __future__ import annotations

import asyncio
import collections
import time
from dataclasses import dataclass, field

import numpy as np

from kvpoold.core.tiers import DROP, Tier

RECENT_EVENTS = 1024
SUBSCRIBER_EVENTS = 4096


@dataclass(frozen=True)
class KvEvent:
    seq: int
    kind: str  # stored | removed | moved | gap
    tier: str = ""  # where the blocks are now (stored, moved) or were (removed)
    from_tier: str = ""  # moved: where they were
    model_ids: tuple[str, ...] = ()
    layout: str = ""
    block_hashes: tuple[bytes, ...] = ()
    dropped: int = 0  # gap: events this consumer missed
    time: float = field(default_factory=time.time)
    device: int = 0  # the pool's position in --devices


def _tier(t: int) -> str:
    return Tier(t).name.lower()


class Subscriber:
    """One consumer's bounded queue of events."""

    def __init__(self, bus: "EventBus", capacity: int) -> None:
        self.bus = bus
        self.capacity = capacity
        self.queue: collections.deque = collections.deque()
        self.missed = 0
        self._wake = asyncio.Event()

    def offer(self, event: KvEvent) -> None:
        if len(self.queue) >= self.capacity:
            self.missed += 1
            self.bus.dropped += 1
        else:
            self.queue.append(event)
        self._wake.set()

    async def next_batch(self) -> list[KvEvent]:
        """The events queued since the last call (a ``gap`` first if some were lost); waits for one."""
        while not self.queue and not self.missed:
            self._wake.clear()
            await self._wake.wait()
        out = []
        if self.missed:
            out.append(KvEvent(seq=0, kind="gap", dropped=self.missed))
            self.missed = 0
        out.extend(self.queue)
        self.queue.clear()
        return out

    def close(self) -> None:
        self.bus.subscribers.discard(self)


class EventBus:
    """The daemon's KV events: the recent ones, the subscribers, and an optional Redis stream."""

    def __init__(self, recent: int = RECENT_EVENTS, stream=None) -> None:
        """``stream``: a callable taking each event (the remote tier's ``--events-stream`` publisher)."""
        self.recent: collections.deque = collections.deque(maxlen=recent)
        self.subscribers: set[Subscriber] = set()
        self.stream = stream
        self.seq = 0
        self.published = 0
        self.dropped = 0  # events a slow subscriber missed

    def subscribe(self, capacity: int = SUBSCRIBER_EVENTS) -> Subscriber:
        sub = Subscriber(self, capacity)
        self.subscribers.add(sub)
        return sub

    def publish(self, kind: str, tier: int, hashes: list[bytes], *, from_tier: int | None = None,
                model_ids=(), layout: str = "", device: int = 0) -> None:
        """One event about ``hashes`` (nothing when there are none)."""
        if not hashes:
            return
        self.seq += 1
        ev = KvEvent(self.seq, kind, _tier(tier), "" if from_tier is None else _tier(from_tier),
                     tuple(sorted(model_ids)), layout, tuple(hashes), device=device)
        self.published += 1
        self.recent.append(ev)
        for sub in self.subscribers:
            sub.offer(ev)
        if self.stream is not None:
            self.stream(ev)

    # -- from a pool's state changes ---------------------------------------------------------------
    def report(self, journal: list, plan, describe, device: int = 0) -> None:
        """Publish a pool's journal entries and planned moves.

        Args:
            journal: ``KVCacheManager.drain_journal()``'s entries.
            plan: the ``MovePlan`` drained for the transfer engine, or None.
            describe: class id -> (model ids, layout text).
            device: the pool's position in ``--devices``.
        """
        for kind, tier, cid, digests in journal:
            models, layout = describe(cid)
            self.publish(kind, tier, digests, model_ids=models, layout=layout, device=device)
        if plan is None or not len(plan):
            return
        keys, src, dst, _, _ = plan.columns()
        prefix = np.fromiter((type(k[1]) is bytes for k in keys), np.bool_, len(keys))  # not swap entries
        if not prefix.any():
            return
        groups: dict = {}
        for i in np.flatnonzero(prefix).tolist():
            groups.setdefault((keys[i][0], int(src[i]), int(dst[i])), []).append(keys[i][1])
        for (cid, s, d), digests in groups.items():
            models, layout = describe(cid)
            kw = dict(model_ids=models, layout=layout, device=device)
            if d == DROP:
                self.publish("removed", s, digests, **kw)
            elif s in (Tier.DEVICE, Tier.REMOTE):  # demotions are copies: the device's removal is journaled
                self.publish("stored", d, digests, **kw)
            else:
                self.publish("moved", d, digests, from_tier=s, **kw)

    def stats(self) -> dict:
        return {"published": self.published, "dropped": self.dropped, "subscribers": len(self.subscribers)}
