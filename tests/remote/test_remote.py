"""Tier 3 against real daemons and a real redis-server: cross-node hits, corruption, faults, tenants."""

from __future__ import annotations

import time

import pytest

import kvpool
from procs import wait_for
from redislib import free_port
from tierlib import BACKENDS, BS, LAYOUT, check_sequence, prompt, write_sequence


def remote_stats(c):
    (r,) = c.stats().remote
    return r


def write_prompt(c, toks):
    """Create and write a prompt, say it is written, free it: its blocks go to the remote tier."""
    s = c.create_sequence(toks)
    write_sequence(c, s, toks)
    c.mark_written(s)
    c.free(s)


def test_a_prompt_written_on_node_a_is_a_prefix_hit_on_node_b_of_its_tenant_only(redis_server, node):
    r = redis_server()
    a, b = node(r), node(r)
    toks, spoiled = prompt(1, blocks=6, extra=5), prompt(2, blocks=4)
    rc = r.client()
    with kvpool.connect(a.socket, name="a", layout=LAYOUT) as ca:
        write_prompt(ca, toks)
        assert wait_for(lambda: remote_stats(ca).blocks_written >= 6)
        first = set(rc.keys("kvpool:*"))
        write_prompt(ca, spoiled)
        assert wait_for(lambda: remote_stats(ca).blocks_written >= 10)
    keys = set(rc.keys("kvpool:*"))
    assert len(first) == 6 and len(keys) == 10
    with kvpool.connect(b.socket, name="b", layout=LAYOUT) as cb:
        assert cb.lookup(toks) == 6 * BS
        s = cb.create_sequence(toks, wait=False)  # as for a host or disk hit: wait before reading
        assert s.num_cached_tokens == 6 * BS
        assert cb.wait(s)[s.id] == 6 * BS
        check_sequence(cb, s, toks, blocks=6)  # node A's bytes, byte for byte
        st = cb.stats()
        assert st.classes[0].remote_hit_blocks == 6 and st.classes[0].promoted_blocks >= 6
        rs = st.remote[0]
        assert rs.state == "connected" and rs.hit_blocks >= 6 and rs.bytes_read > 6 * 4096
        cb.free(s)
        s = cb.create_sequence(toks)  # now a local hit: the remote tier is not asked again
        assert s.num_cached_tokens == 6 * BS and remote_stats(cb).lookups == rs.lookups
        cb.free(s)

        # a value overwritten in the store (one byte of its payload flipped): counted, dropped, recomputed
        victim = sorted(keys - first)[0]  # one block of the second prompt
        assert 0 < rc.ttl(victim) <= 86400
        value = bytearray(rc.get(victim))
        value[-1] ^= 0xFF
        rc.set(victim, bytes(value))
        s = cb.create_sequence(spoiled)
        got = s.num_cached_tokens // BS
        assert got < 4  # the chain stops at the bad block
        check_sequence(cb, s, spoiled, blocks=got)  # what was served is right
        assert remote_stats(cb).corrupt_blocks == 1
        assert rc.get(victim) is None  # and the bad value is gone from the store
    tag = {k.split(b":")[1] for k in keys}
    c = node(r, "--tenant-by", "none")  # another tenant ("" instead of this uid): another namespace
    with kvpool.connect(c.socket, name="c", layout=LAYOUT) as cc:
        assert cc.create_sequence(toks).num_cached_tokens == 0
        assert remote_stats(cc).hit_blocks == 0
    assert {k.split(b":")[1] for k in rc.keys("kvpool:*")} == tag  # nothing of C's written yet


def test_redis_killed_mid_run_keeps_serving_then_recovers(redis_server, node):
    import json
    import subprocess
    import sys
    import urllib.request

    r = redis_server()
    port = free_port()
    a = node(r, "--metrics-port", str(port), timeout=1.0)
    with kvpool.connect(a.socket, name="a", layout=LAYOUT) as ca:
        write_prompt(ca, prompt(4, blocks=2))
        assert wait_for(lambda: remote_stats(ca).blocks_written >= 2)
        r.stop()
        for i in range(5, 9):  # local serving goes on: creates, writes, local prefix hits
            toks = prompt(i, blocks=2)
            write_prompt(ca, toks)
            s = ca.create_sequence(toks)
            assert s.num_cached_tokens == 2 * BS
            ca.free(s)
        ca.create_sequence(prompt(50, blocks=2))  # a miss everywhere: asks the remote tier (down)
        assert wait_for(lambda: remote_stats(ca).state in ("backoff", "retrying"))
        assert remote_stats(ca).failures > 0
        out = subprocess.run([sys.executable, "-m", "kvpoold.ctl", "--socket", a.socket, "stats", "--json"],
                             capture_output=True, text=True)
        (shown,) = json.loads(out.stdout)["remote"]
        assert shown["failures"] > 0 and shown["last_error"]
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
        assert 'kvpool_remote_up{state="' in text or "kvpool_remote_up{" in text
        assert "kvpool_remote_failures_total" in text
        r.start()  # the same socket, empty
        write_prompt(ca, prompt(60, blocks=2))
        assert wait_for(lambda: remote_stats(ca).state == "connected", timeout=20)
        assert wait_for(lambda: len(r.client().keys("kvpool:*")) > 0, timeout=20)  # the queued writes went out


def test_a_stalled_server_costs_at_most_the_timeout(redis_server, node):
    r = redis_server()
    a = node(r, timeout=0.05)
    with kvpool.connect(a.socket, name="a", layout=LAYOUT) as ca:
        ca.create_sequence(prompt(70, blocks=2))  # connected, answered (a miss)
        r.pause()
        try:
            t0 = time.monotonic()
            s = ca.create_sequence(prompt(71, blocks=2))
            took = time.monotonic() - t0
            assert s.num_cached_tokens == 0
            assert took < 1.0, f"a create took {took:.2f}s with the server stalled"
            rs = remote_stats(ca)
            assert rs.timeouts >= 1 and rs.state in ("backoff", "retrying")
            t0 = time.monotonic()
            ca.create_sequence(prompt(72, blocks=2))  # in backoff: not asked at all
            assert time.monotonic() - t0 < 0.5
        finally:
            r.resume()


def test_a_bad_url_is_one_line_and_exit_2():
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "kvpoold", "--remote-url", "http://example.com", "--check-config"],
                         capture_output=True, text=True)
    assert out.returncode == 2
    assert out.stderr.count("\n") == 1 and "remote_url" in out.stderr and "redis://" in out.stderr
    out = subprocess.run([sys.executable, "-m", "kvpoold", "--remote-url", "redis://:secret@h:1/0",
                          "--remote-write", "never", "--check-config"], capture_output=True, text=True)
    assert out.returncode == 2
    out = subprocess.run([sys.executable, "-m", "kvpoold", "--remote-url", "redis://:secret@h:1/0", "--check-config"],
                         capture_output=True, text=True)
    assert out.returncode == 0 and "secret" not in out.stdout


def test_events_report_blocks_stored_moved_and_removed_to_readers_and_a_stream(redis_server, node):
    import json
    import subprocess
    import sys
    import threading

    r = redis_server()
    a = node(r, "--host-bytes", str(2 * 4096), "--events-stream", "kvpool-events", pool_blocks=16)
    admin = a.socket[:-5] + "-admin.sock"
    followed = []
    listening = threading.Event()

    def follow():
        with kvpool.Connection(admin) as conn:
            listening.set()
            for e in conn.events(follow=True, recent=0, timeout=30):
                followed.append(e)
                if e["kind"] == "stored" and e["tier"] == "host":
                    return

    reader = threading.Thread(target=follow)
    reader.start()
    listening.wait(10)
    time.sleep(0.3)  # the stream is open
    with kvpool.connect(a.socket, name="a", layout=LAYOUT) as ca:
        for i in range(80, 88):  # 24 blocks through a pool of 16 and a host tier of 2
            write_prompt(ca, prompt(i, blocks=3))
    reader.join(30)
    assert ("stored", "device") in {(e["kind"], e["tier"]) for e in followed}
    with kvpool.Connection(admin) as conn:
        events = list(conn.events(recent=1000))
    kinds = {(e["kind"], e["tier"]) for e in events}
    assert ("stored", "device") in kinds and ("stored", "remote") in kinds
    assert ("removed", "device") in kinds and ("stored", "host") in kinds and ("removed", "host") in kinds
    assert all(e["model_ids"] and e["layout"] for e in events)
    stored = [h for e in events if e["kind"] == "stored" and e["tier"] == "device" for h in e["block_hashes"]]
    assert len(stored) == 8 * 3
    out = subprocess.run([sys.executable, "-m", "kvpoold.ctl", "--socket", a.socket, "events", "--recent", "5",
                          "--json"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert len(out.stdout.splitlines()) == 5 and json.loads(out.stdout.splitlines()[0])["kind"]
    denied = subprocess.run([sys.executable, "-m", "kvpoold.ctl", "--admin-socket", a.socket, "events"],
                            capture_output=True, text=True)
    assert denied.returncode == 5  # the normal socket refuses: events carry every tenant's block hashes
    assert wait_for(lambda: r.client().xlen("kvpool-events") >= len(events))


def test_evict_writes_only_blocks_leaving_the_last_local_tier_and_they_come_back(redis_server, node):
    r = redis_server()
    a = node(r, "--remote-write", "evict", pool_blocks=16)  # no host or disk tier: the device is the last
    toks = prompt(100, blocks=3)
    with kvpool.connect(a.socket, name="a", layout=LAYOUT) as ca:
        write_prompt(ca, toks)
        time.sleep(0.3)
        assert remote_stats(ca).blocks_written == 0  # still on the device: nothing sent
        for i in range(101, 108):  # 21 more blocks through a pool of 16: the first prompt's leave it
            write_prompt(ca, prompt(i, blocks=3))
        assert wait_for(lambda: remote_stats(ca).blocks_written >= 3)
        s = ca.create_sequence(toks)
        assert s.num_cached_tokens == 3 * BS and ca.stats().classes[0].remote_hit_blocks == 3
        check_sequence(ca, s, toks, blocks=3)


@pytest.mark.parametrize("secret", [None, b"k" * 32], ids=["checksummed", "keyed"])
def test_a_redis_cluster_given_by_one_node_stores_and_serves_blocks(redis_cluster, secret):
    import numpy as np

    from kvpoold.transfer.remote import Namespace, RemoteSettings, RemoteStore

    cluster = redis_cluster()
    store = RemoteStore(RemoteSettings(cluster.url, cluster=True, secret=secret))
    try:
        ns = Namespace("kvpool", "a layout", 4096, secret)
        digests = [bytes([i]) * 16 for i in range(40)]  # keys on every node
        store.put_many(ns, digests, [np.full(4096, i, np.uint8) for i in range(40)])
        assert store.flush(10) and store.blocks_written == 40
        got = store.fetch(ns, [digests, digests[:3] + [b"?" * 16] + digests[3:]])
        assert len(got.payloads) == 40 and bytes(got.payloads[digests[7]]) == bytes([7]) * 4096
        assert store.failures == 0 and store.state == "connected"
    finally:
        store.close()


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_prompt_written_through_node_a_is_a_hit_on_node_b_after_a_is_gone(redis_server, node, backend):
    """Node A writes a prompt and exits (SIGTERM): node B serves its prefix from Redis, byte for byte (on the
    GPU: A's blocks leave its device pool, B's arrive in its device pool)."""
    r = redis_server()
    a, b = node(r, backend=backend), node(r, backend=backend)
    toks = prompt(7, blocks=5, extra=3)
    with kvpool.connect(a.socket, name="a", layout=LAYOUT) as ca:
        write_prompt(ca, toks)
        assert wait_for(lambda: remote_stats(ca).blocks_written >= 5 and remote_stats(ca).write_queue_blocks == 0)
    assert a.stop() == 0  # SIGTERM
    assert a.proc.poll() is not None  # process gone
    with kvpool.connect(b.socket, name="b", layout=LAYOUT) as cb:
        s = cb.create_sequence(toks)
        assert s.num_cached_tokens == 5 * BS
        cb.wait(s)
        check_sequence(cb, s, toks, blocks=5)  # node A's bytes, byte for byte
        assert remote_stats(cb).hit_blocks >= 5
        cb.free(s)
        ok, detail = cb._conn.check()
        assert ok, detail
