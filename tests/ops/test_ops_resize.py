"""The pool's ceiling moves (``kvpoolctl resize``) and empty slabs are given back after a while.

On the CPU backend the ceiling can shrink and grow back up to its size at
start (the GPU's VMM pool can grow to the GPU's memory: tests/server/test_gpu_vmm.py).
"""

from __future__ import annotations

import json
import time

import pytest

import kvpool
from opskit import LAYOUT, run_ctl

MiB = 1 << 20


def admin_of(d) -> str:
    return d.socket[:-5] + "-admin.sock"


def device(d):
    with kvpool.Connection(d.socket) as conn:
        (dev,) = conn.stats().devices
    return dev


def test_resize_shrinks_down_to_held_blocks_and_grows_back(daemon_factory):
    d = daemon_factory("--pool-bytes", "8MiB", "--chunk-bytes", "64KiB")
    layout = kvpool.Layout("resize", num_layers=1, num_kv_heads=1, head_dim=64, dtype="float16", block_size=16)
    with kvpool.connect(d.socket, name="r", layout=layout) as c:  # 4 KiB blocks
        kv = c.kv_cache()
        seqs = c.create_sequences([[n * 1000 + i for i in range(16 * 32)] for n in range(20)])  # 2.5 MiB
        for s in seqs:
            kv[s.block_table.tolist()] = float(s.id % 100)
        c.mark_written(seqs)
        with kvpool.Connection(admin_of(d)) as admin:
            (r,) = admin.resize(MiB)
            assert not r["met"] and 2 * MiB < r["pool_bytes"] <= 4 * MiB  # held blocks stop it
            assert device(d).pool_bytes == r["pool_bytes"]
            for s in seqs:  # nothing held moved or changed
                assert bool((kv[s.block_table.tolist()] == float(s.id % 100)).all())
            c.free(seqs[:15])  # cached now: a shrink may evict them
            (r,) = admin.resize(MiB)
            assert r["met"] and r["pool_bytes"] == MiB and r["evicted_blocks"] > 0
            with pytest.raises(kvpool.OutOfBlocks):  # 20 distinct prompts of 256 KiB: five times the pool
                c.create_sequences([[7 + n] * (16 * 64) for n in range(20)])
            (r,) = admin.resize(8 * MiB)
            assert r["met"] and r["max_pool_bytes"] == 8 * MiB
            c.create_sequences([[9] * (16 * 64)] * 20)
            with pytest.raises(kvpool.InvalidArgument, match="pool_bytes must be between"):
                admin.resize(16 * MiB)  # the CPU pool cannot grow past its size at start
            assert device(d).pool_bytes == 8 * MiB  # a refused resize changes nothing
        for s in seqs[15:]:
            assert bool((kv[s.block_table.tolist()] == float(s.id % 100)).all())


def test_kvpoolctl_resize(daemon_factory):
    d = daemon_factory("--pool-bytes", "8MiB", "--chunk-bytes", "64KiB")
    out = run_ctl(d.socket, "resize", "--pool-bytes", "4MiB", admin=admin_of(d))
    assert out.returncode == 0, out.stderr
    assert "cpu: pool 4.0 MiB" in out.stdout
    out = run_ctl(d.socket, "resize", "--pool-bytes", "8MiB", "--json", admin=admin_of(d))
    assert out.returncode == 0 and json.loads(out.stdout)[0]["pool_bytes"] == 8 * MiB
    bad = run_ctl(d.socket, "resize", "--pool-bytes", "lots", admin=admin_of(d))
    assert bad.returncode == 2 and "lots" in bad.stderr
    past = run_ctl(d.socket, "resize", "--pool-bytes", "1GiB", admin=admin_of(d))
    assert past.returncode == 1 and len(past.stderr.strip().splitlines()) == 1 and "between" in past.stderr
    wrong = run_ctl(d.socket, "resize", "--pool-bytes", "4MiB", "--device", "3", admin=admin_of(d))
    assert wrong.returncode == 1 and "no pool on device 3" in wrong.stderr
    with kvpool.Connection(d.socket) as conn, pytest.raises(kvpool.PermissionDenied):
        conn.resize(4 * MiB)  # an admin call: not on the normal socket


def test_empty_slabs_are_given_back_after_release_after_seconds(daemon_factory):
    d = daemon_factory("--pool-bytes", "8MiB", "--chunk-bytes", "64KiB", "--release-after-seconds", "0")
    with kvpool.connect(d.socket, name="idle", layout=LAYOUT) as c:  # attached: the class stays
        seqs = c.create_sequences([list(range(n, n + 400)) for n in range(20)])
        mapped = sum(cl.mapped_bytes for cl in device(d).classes)
        assert mapped > 0
        c.free(seqs)  # a free says the KV is written: the full blocks stay cached
        time.sleep(1.5)
        assert sum(cl.mapped_bytes for cl in device(d).classes) > 0  # cached blocks keep their slabs
        with kvpool.Connection(admin_of(d)) as admin:
            admin.evict()
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and sum(cl.mapped_bytes for cl in device(d).classes) > 4 * 65536:
            time.sleep(0.2)
        st = device(d)
        # what is left backs the session's reserve (held blocks): every empty slab went back
        assert sum(cl.mapped_bytes for cl in st.classes) <= 4 * 65536
        assert sum(cl.released_bytes for cl in st.classes) >= mapped - 4 * 65536
        assert st.memory == "shm"


def test_memory_moving_between_classes_is_counted_with_its_time(daemon_factory):
    d = daemon_factory("--pool-bytes", "1MiB", "--chunk-bytes", "64KiB", "--release-after-seconds", "3600")
    other = kvpool.Layout("ops-other", num_layers=2, num_kv_heads=1, head_dim=8, dtype="float16", block_size=4)
    with kvpool.connect(d.socket, name="a", layout=LAYOUT) as a, kvpool.connect(d.socket, name="b", layout=other) as b:
        a.free(a.create_sequences([[n] * 4000 for n in range(7)]))  # about the whole pool, cached
        first = min(device(d).classes, key=lambda c: c.class_id)
        assert first.taken_bytes >= 12 * 65536 and first.commit_seconds > 0 and first.release_seconds == 0
        b.create_sequences([[n] * 2000 for n in range(7)])  # takes the cached slabs of the first class
        giver, taker = sorted(device(d).classes, key=lambda c: c.class_id)
        assert giver.released_bytes > 0 and giver.release_seconds > 0
        assert taker.taken_bytes >= giver.released_bytes and taker.commit_seconds > 0
        for c in (giver, taker):
            assert c.taken_bytes - c.released_bytes == c.mapped_bytes
        out = run_ctl(d.socket, "stats")
        assert out.returncode == 0 and "memory taken (commit / release time)" in out.stdout
