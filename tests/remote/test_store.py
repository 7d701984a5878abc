"""``RemoteStore`` alone on a real redis-server: where each chain's prefix stops, and the values it writes."""

from __future__ import annotations

import numpy as np
import pytest

from kvpoold.transfer.remote import Namespace, RemoteSettings, RemoteStore, decode


def test_each_chain_stops_at_its_first_missing_or_bad_block_and_writes_are_whole_values(redis_server):
    r = redis_server()
    rc = r.client()
    store = RemoteStore(RemoteSettings(r.url, ttl=0))
    try:
        ns = Namespace("kvpool", "a layout", 1024)
        d = [bytes([i]) * 16 for i in range(12)]
        store.put_many(ns, d[:10], [np.full(1024, i, np.uint8) for i in range(10)])
        assert store.flush(10) and store.blocks_written == 10
        assert rc.ttl(ns.key(d[0])) == -1  # --remote-ttl 0: no expiry
        value = rc.get(ns.key(d[3]))
        assert bytes(decode(ns, ns.key(d[3]), value)) == bytes([3]) * 1024  # a whole self-describing value
        rc.delete(ns.key(d[6]))  # a hole
        chains = [d[:4],  # all there
                  d[:10],  # stops at the hole (6)
                  d[7:10] + d[10:],  # there, then missing
                  d[10:],  # none there
                  d[:4],  # the same chain again
                  []]
        got = store.fetch(ns, chains)
        assert set(got.payloads) == set(d[:6]) | set(d[7:10])
        assert all(bytes(got.payloads[h]) == bytes([h[0]]) * 1024 for h in got.payloads)
        assert got.asked == 4 + 10 + 5 + 2 + 4 and got.refused == 0
        found = store.fetch(ns, chains, read=False)
        assert found.payloads == dict.fromkeys(got.payloads)
        assert store.bytes_read == 9 * len(value)  # each block read once, however many chains ask for it

        spoiled = bytearray(rc.get(ns.key(d[1])))
        spoiled[40] ^= 1  # one payload byte
        rc.set(ns.key(d[1]), bytes(spoiled))
        got = store.fetch(ns, [d[:6], d[:3]])
        assert set(got.payloads) == {d[0]} and got.refused == 1
        assert rc.get(ns.key(d[1])) is None  # dropped from the store
        assert store.failures == 0 and store.state == "connected"
    finally:
        store.close()


def test_writes_the_server_refuses_raise_and_leave_the_connection_in_step(redis_server):
    from redis.exceptions import ResponseError

    r = redis_server("--maxmemory", "3mb", "--maxmemory-policy", "noeviction")
    store = RemoteStore(RemoteSettings(r.url))
    try:
        ns = Namespace("kvpool", "a layout", 64 << 10)
        d = [i.to_bytes(16, "little") for i in range(80)]  # 5 MiB
        with pytest.raises(ResponseError, match="maxmemory"):
            store.write_batch([(ns.key(h), ns, np.full(64 << 10, i, np.uint8)) for i, h in enumerate(d)])
        got = store.fetch(ns, [d])  # the answers read are this fetch's, not the writes' left over
        assert 0 < len(got.payloads) < 80 and got.refused == 0 and store.failures == 0
        assert bytes(got.payloads[d[1]]) == bytes([1]) * (64 << 10)
    finally:
        store.close()
