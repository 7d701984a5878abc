"""The remote tier's store without a server: value format, URLs, the engine's rows to and from tier 3."""

from __future__ import annotations

import time

import numpy as np

from kvpoold.config import check_url, redact
from kvpoold.core.tiers import MovePlan, Tier
from kvpoold.transfer import Arrivals, TransferEngine
from kvpoold.transfer.remote import Namespace, RemoteLink, RemoteSettings, RemoteStore, decode, encode, layout_string

BB = 4096
GEOM = {"num_layers": 1, "num_kv_heads": 1, "head_dim": 8, "dtype": "float16", "block_size": 16, "block_bytes": BB}


def test_a_value_is_served_only_whole_of_its_layout_and_with_its_checksum():
    ns = Namespace("kvpool", layout_string(GEOM), BB)
    payload = np.arange(BB, dtype=np.uint32).astype(np.uint8)
    key = ns.key(b"\x01" * 16)
    value = encode(ns, key, payload)
    assert bytes(decode(ns, key, value)) == payload.tobytes()
    flipped = bytearray(value)
    flipped[-1] ^= 1
    assert decode(ns, key, bytes(flipped)) is None  # checksum
    assert decode(ns, key, value[:-1]) is None  # truncated
    other = Namespace("kvpool", layout_string({**GEOM, "tenant": "uid 7"}), BB)
    assert decode(other, key, value) is None and other.prefix != ns.prefix  # another tenant's layout
    assert key.startswith(b"kvpool:") and key.endswith(b"01" * 16)


SECRET = b"0123456789abcdef0123456789abcdef"


def test_with_a_secret_keys_are_unguessable_and_only_values_sealed_for_their_key_are_served():
    lay = layout_string({**GEOM, "tenant": "uid 7"})
    ns, plain = Namespace("kvpool", lay, BB, SECRET), Namespace("kvpool", lay, BB)
    digest, next_digest = b"\x01" * 16, b"\x02" * 16
    key = ns.key(digest)
    assert key != plain.key(digest) and digest.hex().encode() not in key  # not the public block hash
    assert ns.prefix != plain.prefix and len(key) == len(plain.key(digest))
    again = Namespace("kvpool", lay, BB, SECRET)  # another daemon with the same secret: the same keys
    assert again.key(digest) == key and again.prefix == ns.prefix
    payload = np.arange(BB, dtype=np.uint32).astype(np.uint8)
    value = encode(ns, key, payload)
    assert bytes(decode(again, key, value)) == payload.tobytes()
    assert decode(ns, ns.key(next_digest), value) is None  # copied to another block's key: refused
    forged = encode(plain, key, payload)  # the checksummed format, its checksum valid
    assert bytes(decode(plain, key, forged)) == payload.tobytes() and decode(ns, key, forged) is None
    flipped = bytearray(value)
    flipped[-1] ^= 1
    assert decode(ns, key, bytes(flipped)) is None
    other_secret = Namespace("kvpool", lay, BB, SECRET[::-1])
    assert other_secret.key(digest) != key and decode(other_secret, key, value) is None
    other_tenant = Namespace("kvpool", layout_string({**GEOM, "tenant": "uid 8"}), BB, SECRET)
    assert other_tenant.key(digest) != key and other_tenant.prefix != ns.prefix
    assert "0123456789abcdef" not in repr(RemoteSettings("redis://h", secret=SECRET))


def test_urls_are_checked_and_passwords_never_shown():
    assert check_url("redis://h:6379/0") == "" and check_url("rediss://u:p@h/1") == ""
    assert check_url("unix:///run/redis.sock") == ""
    assert "scheme" in check_url("http://h") and "database" in check_url("redis://h/x")
    assert "port" in check_url("redis://h:99999") or "range" in check_url("redis://h:99999")
    assert redact("redis://user:pw@h:1/0") == "redis://user:***@h:1/0" and redact("redis://h") == "redis://h"


class Captured:
    """Stands for ``RemoteStore``: records the blocks handed to its writer."""

    def __init__(self) -> None:
        self.settings = RemoteSettings("redis://unused")
        self.put: dict = {}

    def put_many(self, ns, digests, rows):
        for d, row in zip(digests, rows):
            self.put[d] = bytes(row)


def test_the_engine_copies_blocks_out_to_and_in_from_the_remote_tier():
    store = Captured()
    link = RemoteLink(store)
    link.bind(0, GEOM)
    eng = TransferEngine(host_bytes=4 * BB, remote=link)
    rows = np.zeros((8, BB), np.uint8)
    eng.add_class(0, BB, rows)
    for b in range(8):
        rows[b] = b + 1
    key = lambda i: (0, bytes([i]) * 16)  # noqa: E731
    plan = MovePlan()
    plan.add(key(1), Tier.DEVICE, Tier.HOST, 1, BB)  # a demotion, then that block leaves the host tier
    eng.submit(plan)
    plan = MovePlan()
    plan.add(key(2), Tier.DEVICE, Tier.REMOTE, 2, BB)  # a confirmed block: copied, the device keeps it
    plan.add(key(1), Tier.HOST, Tier.REMOTE, -1, BB)
    eng.submit(plan)
    assert store.put == {key(2)[1]: bytes([3]) * BB, key(1)[1]: bytes([2]) * BB}
    assert not eng.host.entries  # the host slot was freed
    link.staged = {key(5)[1]: memoryview(bytes([9]) * BB)}
    plan = MovePlan()
    plan.add(key(5), Tier.REMOTE, Tier.DEVICE, 6, BB)
    plan.add(key(6), Tier.REMOTE, Tier.DEVICE, 7, BB)  # not fetched: lost, its owner recomputes it
    (arr,) = eng.submit(plan)
    assert arr.done and arr.state.tolist() == [Arrivals.OK, Arrivals.LOST]
    assert (rows[6] == 9).all() and (rows[7] == 8).all()
    eng.close()


def test_a_full_write_queue_drops_the_oldest_and_counts_them(tmp_path):
    store = RemoteStore(RemoteSettings(f"unix://{tmp_path}/nobody.sock", queue_bytes=3 * BB, socket_timeout=0.2))
    try:
        ns = Namespace("kvpool", layout_string(GEOM), BB)
        store.put_many(ns, [bytes([i]) * 16 for i in range(5)], [np.zeros(BB, np.uint8) for _ in range(5)])
        assert store.write_dropped == 2 and store.queued_blocks <= 3
        deadline = time.monotonic() + 5
        while store.failures == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        st = store.stats()  # no server: counted, backing off; the blocks wait for the retry
        assert st["failures"] > 0 and st["state"] in ("backoff", "retrying") and st["last_error"]
        assert st["blocks_written"] == 0 and st["write_dropped"] == 2
    finally:
        store.close()
