"""KV events: a reader that falls behind loses events, counted, and never holds the publisher back."""

from __future__ import annotations

import asyncio

from kvpoold.core import Tier
from kvpoold.server.events import EventBus


def test_a_slow_reader_gets_a_gap_and_the_newest_events_are_kept_for_later_readers():
    async def run():
        bus = EventBus(recent=3)
        slow = bus.subscribe(capacity=2)
        for i in range(5):
            bus.publish("stored", Tier.DEVICE, [bytes([i]) * 16], model_ids={"m@r"}, layout="L")
        bus.publish("stored", Tier.DEVICE, [])  # nothing to say: no event
        batch = await slow.next_batch()
        assert [e.kind for e in batch] == ["gap", "stored", "stored"]
        assert batch[0].dropped == 3 and [e.seq for e in batch[1:]] == [1, 2]
        assert [e.seq for e in bus.recent] == [3, 4, 5]
        assert bus.stats() == {"published": 5, "dropped": 3, "subscribers": 1}
        waiting = asyncio.ensure_future(slow.next_batch())
        await asyncio.sleep(0)
        assert not waiting.done()
        bus.publish("removed", Tier.HOST, [b"x" * 16])
        (e,) = await waiting
        assert (e.kind, e.tier, e.block_hashes) == ("removed", "host", (b"x" * 16,))
        slow.close()
        assert not bus.subscribers

    asyncio.run(run())
