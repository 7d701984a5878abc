"""The client library against a real daemon: batching, reserves, mirrors, layouts."""

from __future__ import annotations

import numpy as np
import pytest

import kvpool

LAYOUT = kvpool.Layout("client-model", num_layers=2, num_kv_heads=2, head_dim=8, dtype="float16", block_size=16)


def daemon_tables(client) -> dict[int, list[int]]:
    return {s.seq_id: list(s.block_table) for s in client._conn.sequences_of(client.session_id, session=client._token)}


def test_steady_decode_calls_the_daemon_at_most_once_every_8_steps(daemon):
    with kvpool.connect(daemon.socket, name="decoder", layout=LAYOUT) as c:
        seqs = c.create_sequences([[i, i + 1, i + 2] for i in range(256)])
        start = c.rpcs
        steps = 64
        for step in range(steps):
            c.extend({s: [step] for s in seqs})
        calls = c.rpcs - start
        assert calls * 8 <= steps, f"{calls} calls for {steps} steps"
        c.flush()
        # after the flush, the daemon's page tables equal the client's mirror
        assert daemon_tables(c) == {s.id: s.block_table.tolist() for s in seqs}
        assert all(s.num_tokens == 3 + steps for s in seqs)
        st = c.stats().classes[0]
        assert st.used_blocks == 256 * 5 + st.reserved_blocks


def test_reserve_shrinks_with_the_batch_and_goes_back_when_idle(daemon):
    """A reserve is held memory: an idle model's would keep slabs other models need."""
    with kvpool.connect(daemon.socket, name="shrinking", layout=LAYOUT) as c:
        seqs = c.create_sequences([[i] for i in range(128)])
        for step in range(40):  # at least one call after the first flush: the reserve grows to its target
            c.extend({s: [step] for s in seqs})
        assert c.reserve_size >= 128  # the target: two blocks per sequence for each flush (32 steps, 16 tokens)
        c.free(seqs[8:])
        assert 0 < c.reserve_size <= 2 * 2 * 2 * 8  # at most twice the target of 8 sequences
        assert c.stats().classes[0].reserved_blocks == c.reserve_size
        c.free(seqs[:8])
        st = c.stats().classes[0]
        assert c.reserve_size == 0 and st.reserved_blocks == 0 and st.used_blocks == 0
        again = c.create_sequence([1, 2, 3])
        for step in range(40):  # a new batch gets a reserve again
            c.extend({again: [step]})
        c.flush()
        assert c.reserve_size > 0 and c.stats().classes[0].reserved_blocks == c.reserve_size


def test_random_workload_keeps_mirror_and_daemon_equal(daemon):
    rng = np.random.default_rng(7)
    with kvpool.connect(daemon.socket, name="random", layout=LAYOUT, flush_every=5) as c:
        live = c.create_sequences([rng.integers(0, 50, rng.integers(0, 40)) for _ in range(8)])
        for _ in range(60):
            op = rng.integers(0, 10)
            if op < 6 and live:
                batch = {s: rng.integers(0, 50, rng.integers(0, 20)) for s in rng.choice(live, min(4, len(live)), replace=False)}
                c.extend(batch)
            elif op < 7 and live:
                live.append(c.fork(live[rng.integers(len(live))]))
            elif op < 8 and live:
                victim = live.pop(rng.integers(len(live)))
                c.free(victim)
            else:
                live.append(c.create_sequence(rng.integers(0, 50, rng.integers(1, 40))))
        c.flush()
        assert daemon_tables(c) == {s.id: s.block_table.tolist() for s in live}
        assert c._conn.check()[0]


def test_block_tables_are_padded_int32(daemon):
    with kvpool.connect(daemon.socket, name="tables", layout=LAYOUT) as c:
        a = c.create_sequence(range(40))
        b = c.create_sequence(range(5))
        t = c.block_tables([a, b], pad=-1)
        assert t.dtype == np.int32 and t.shape == (2, 3)
        assert t[0].tolist() == a.block_table.tolist() and t[1, 1:].tolist() == [-1, -1]
        assert c.seq_lens([a, b]).tolist() == [40, 5]


def test_kv_cache_is_a_writable_zero_copy_view(daemon):
    with kvpool.connect(daemon.socket, name="view", layout=LAYOUT) as c:
        kv = c.kv_cache()
        assert tuple(kv.shape) == (c.num_blocks, 2, 2, 2, 16, 8)
        arr = np.asarray(kv)
        arr[3, 1, 0, 1, 2, :] = 7.0
        assert float(kv[3, 1, 0, 1, 2, 0]) == 7.0
        assert arr.ctypes.data == kv.data_ptr()


def test_uncounted_creates_and_known_tokens_in_prefix_statistics(daemon):
    # what a vLLM connector does per request: the scheduler's lookup is the query (counted from its
    # own cache's hit on), the worker's create for the load is not counted again
    with kvpool.connect(daemon.socket, name="a", layout=LAYOUT) as a:
        a.free(a.create_sequence(range(64), counted=False))
        assert a.stats().classes[0].prefix_queries == 0
        assert a.lookup(range(70), known_tokens=16) == 64
        seq = a.create_sequence(range(64), counted=False)
        assert seq.num_cached_tokens == 64
        st = a.stats().classes[0]
        assert (st.prefix_queries, st.prefix_hits, st.prefix_query_tokens, st.prefix_hit_tokens) == (1, 1, 54, 48)
        assert a.lookup(range(70), known_tokens=64) == 64  # all of the hit was the caller's own: no pool hit
        st = a.stats().classes[0]
        assert (st.prefix_queries, st.prefix_hits, st.prefix_query_tokens, st.prefix_hit_tokens) == (2, 1, 60, 48)

def test_different_layouts_share_one_pool(daemon):
    other = kvpool.Layout("other-model", num_layers=4, num_kv_heads=1, head_dim=8, dtype="float32", block_size=8)
    with kvpool.connect(daemon.socket, name="a", layout=LAYOUT) as a, \
            kvpool.connect(daemon.socket, name="b", layout=other) as b:
        assert a.class_id != b.class_id
        a.create_sequence(range(100))
        b.create_sequence(range(100))
        st = a.stats()
        assert [c.models for c in st.classes] == [("client-model",), ("other-model",)]
        assert st.classes[0].used_blocks == 7 and st.classes[1].used_blocks == 13
        assert st.free_bytes < st.pool_bytes


def test_same_model_shares_blocks_across_clients(daemon):
    with kvpool.connect(daemon.socket, name="a", layout=LAYOUT) as a, \
            kvpool.connect(daemon.socket, name="b", layout=LAYOUT) as b:
        sa = a.create_sequence(range(64))
        assert b.lookup(range(64)) == 0  # not before a says the KV is written
        a.mark_written(sa)
        sb = b.create_sequence(range(70))
        assert sb.num_cached_tokens == 64
        assert sb.block_table[:4].tolist() == sa.block_table.tolist()
        assert a.lookup(range(80)) == 64
        st = a.stats().classes[0]
        # two creates and two lookups were queries; the second create and the last lookup hit 64 each
        assert (st.prefix_queries, st.prefix_hits, st.prefix_hit_tokens) == (4, 2, 128)


def test_mark_written_confirms_tokens_queued_from_the_reserve(daemon):
    """An engine's last prefill chunk is often queued locally; its blocks must become hits once it says so
    (for other processes, and for this model's successor should it die before its next call)."""
    with kvpool.connect(daemon.socket, name="writer", layout=LAYOUT) as a, \
            kvpool.connect(daemon.socket, name="reader", layout=LAYOUT) as b:
        seq = a.create_sequence(range(8))
        a.flush()  # the reserve is topped up
        calls = a.rpcs
        a.extend({seq: list(range(8, 40))})  # two blocks filled from the reserve, no call
        assert a.rpcs == calls
        a.mark_written(seq)
        assert b.lookup(range(40)) == 32


def test_failed_step_leaves_the_mirror_as_it_was(daemon_factory):
    d = daemon_factory("--pool-bytes", "1MiB", "--chunk-bytes", "64KiB")  # 512 blocks of 2 KiB
    with kvpool.connect(d.socket, name="oom", layout=LAYOUT, flush_every=1000) as c:
        a = c.create_sequence(range(20))
        c.flush()
        c.extend({a: [1, 2, 3]})  # queued locally from the reserve
        before = (a.block_table.tolist(), a.num_tokens, c.reserve_size)
        with pytest.raises(kvpool.OutOfBlocks):
            c.extend({a: list(range(16 * 600))})  # needs more blocks than the pool has
        assert (a.block_table.tolist(), a.num_tokens, c.reserve_size) == before
        c.flush()
        assert daemon_tables(c) == {a.id: a.block_table.tolist()}
        assert a.num_tokens == 23


def test_a_remap_waits_for_the_call_in_progress(daemon):
    """The watch thread's chunk sync runs between two client calls: during one, a daemon answer older than the
    call's reply could unmap a chunk the reply handed out blocks in (tests/server/test_gpu_vmm.py on the GPU)."""
    import threading

    with kvpool.connect(daemon.socket, name="remapped", layout=LAYOUT) as c:
        seq = c.create_sequence(list(range(40)))
        remap = threading.Thread(target=c._liveness._on_remap)  # what a "remap" event runs
        with c._lock:  # a call in progress
            remap.start()
            remap.join(timeout=1.0)
            assert remap.is_alive()
        remap.join(timeout=60)
        assert not remap.is_alive()
        assert c.block_ids(seq) == daemon_tables(c)[seq.id]  # nothing changed on the CPU pool
