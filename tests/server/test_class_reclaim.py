"""Layout classes are reclaimed, and capped (issue #19): a real daemon over a real Unix socket.

A class lives while a session uses it or a block of it is cached in some tier; then its memory, its
arena (memfd and mapping) and its id go.  ``max_classes`` / ``max_classes_per_tenant`` cap how many
exist at once: idle classes are reclaimed (least recently used first) to make room, else the attach
is refused with ``TooManyClasses`` and nothing changes.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import numpy as np
import pytest

import kvpool
from kvpool.connection import Connection

PROMPT = list(range(100, 108))  # two full blocks of 4


def layout(i: int, model: str | None = None) -> kvpool.Layout:
    """A geometry of its own for each ``i`` (small: a block is at most a few KiB)."""
    return kvpool.Layout(model or f"m{i}", num_layers=1 + i % 8, num_kv_heads=1 + (i // 8) % 4,
                         head_dim=8 * (1 + i // 32), dtype="float16", block_size=4)


def fds(d) -> int:
    return len(os.listdir(f"/proc/{d.proc.pid}/fd"))


def stats(d):
    with Connection(d.socket) as conn:
        return conn.stats()


def admin_evict(d) -> int:
    with Connection(os.path.join(d.dir, "kvpoold-admin.sock")) as conn:
        return conn.evict()


def check(d) -> None:
    with Connection(d.socket) as conn:
        ok, detail = conn.check()
    assert ok, detail


def cache_prompt(d, lay: kvpool.Layout) -> int:
    """Attach, write ``PROMPT`` (its full blocks stay cached), detach; returns the class id."""
    with kvpool.connect(d.socket, name="writer", layout=lay) as c:
        c.free(c.create_sequence(PROMPT))
        return c.class_id


def wait_for(cond, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


# 10,000 takes about 160 s here (16 ms per attach and detach, most of it the client's connect):
# 1,500 shows the same (nothing grows with the count) in about 25 s
MANY = 1500


def test_many_distinct_geometries_leave_nothing_behind(daemon_factory):
    d = daemon_factory("--max-classes", "8", "--max-classes-per-tenant", "8")
    with kvpool.connect(d.socket, name="warm-up", layout=layout(0)):
        pass  # the first attach opens the daemon's lasting descriptors (side socket, gRPC)
    start_fds = fds(d)
    for i in range(1, MANY + 1):
        with kvpool.connect(d.socket, name="g", layout=layout(i)) as c:
            if i % 10 == 0:  # some leave cached blocks behind: their classes stay until the cap needs room
                c.free(c.create_sequence(PROMPT))
            assert c.class_id < 8, f"class id {c.class_id}: ids are not reused"
    st = stats(d)
    assert len(st.classes) <= 8
    assert all(c.cached_blocks for c in st.classes), "a class with nothing cached was kept"
    # each kept class has its memfd open twice (the arena's, and the mapping's own: Python's mmap dups it)
    assert abs(fds(d) - start_fds) <= 2 + 2 * len(st.classes), (start_fds, fds(d))
    out = subprocess.run([sys.executable, "-m", "kvpoold.ctl", "--socket", d.socket, "stats", "--json"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert len(out.stdout) < 40_000, f"stats --json is {len(out.stdout)} bytes"
    admin_evict(d)
    assert not stats(d).classes
    assert fds(d) <= start_fds + 2
    with kvpool.connect(d.socket, name="new", layout=layout(0, "a-new-model")) as c:
        assert c.class_id == 0
        assert c.create_sequence(range(9)).num_tokens == 9
    check(d)


def test_cached_class_survives_its_last_detach_and_goes_once_evicted(daemon):
    before = fds(daemon)
    lay = layout(3)
    cid = cache_prompt(daemon, lay)
    (cls,) = stats(daemon).classes
    assert cls.class_id == cid and cls.cached_blocks == 2 and cls.models == ("m3",)
    with kvpool.connect(daemon.socket, name="reader", layout=lay) as c:
        assert c.class_id == cid
        assert c.create_sequence(PROMPT).num_cached_tokens == 8  # a prefix hit for the next client
    assert admin_evict(daemon) == 2
    assert not stats(daemon).classes
    assert fds(daemon) <= before + 2  # the arena's memfd is closed
    check(daemon)


def test_a_reused_id_gets_a_fresh_arena(daemon):
    a, b = layout(1), layout(2)
    with kvpool.connect(daemon.socket, name="a", layout=a) as c:
        seq = c.create_sequence(PROMPT)
        kv = np.asarray(c.kv_cache())
        kv[seq.block_table.tolist()] = 7.0
        old_id, blocks = c.class_id, seq.block_table.tolist()
    admin_evict(daemon)
    assert not stats(daemon).classes
    with kvpool.connect(daemon.socket, name="b", layout=b) as c:
        assert c.class_id == old_id
        seq = c.create_sequence(PROMPT)
        kv = np.asarray(c.kv_cache())
        assert not kv.any(), "bytes of the dropped class show through"
        assert sorted(seq.block_table.tolist()) == sorted(blocks)  # the same ids, zeroed memory
        kv[seq.block_table.tolist()] = 3.0
        assert set(np.unique(kv).tolist()) == {0.0, 3.0}
    check(daemon)


def test_the_cap_in_all_reclaims_the_least_recently_used_idle_class_first(daemon_factory):
    d = daemon_factory("--max-classes", "2", "--max-classes-per-tenant", "0")
    first = cache_prompt(d, layout(1))
    cache_prompt(d, layout(2))
    with kvpool.connect(d.socket, name="third", layout=layout(3)) as c:
        assert c.class_id == first  # layout 1's class was idle longest: reclaimed, its id reused
        models = sorted(m for cls in stats(d).classes for m in cls.models)
        assert models == ["m2", "m3"]
    with kvpool.connect(d.socket, name="again", layout=layout(2)) as c:
        assert c.create_sequence(PROMPT).num_cached_tokens == 8  # layout 2 kept its cache
    check(d)


@pytest.mark.parametrize("option", ["max_classes", "max_classes_per_tenant"])
def test_a_cap_refuses_when_every_class_is_in_use_and_changes_nothing(daemon_factory, option):
    other = "max_classes_per_tenant" if option == "max_classes" else "max_classes"
    d = daemon_factory(f"--{option.replace('_', '-')}", "2", f"--{other.replace('_', '-')}", "0")
    with kvpool.connect(d.socket, name="a", layout=layout(1)) as a, \
            kvpool.connect(d.socket, name="b", layout=layout(2)) as b:
        a.create_sequence(PROMPT)
        before = stats(d)
        with pytest.raises(kvpool.TooManyClasses, match=option) as err:
            kvpool.connect(d.socket, name="c", layout=layout(3))
        assert err.value.code == "RESOURCE_EXHAUSTED"
        after = stats(d)
        assert after.classes == before.classes and after.clients == 2
        assert b.create_sequence(PROMPT).num_tokens == 8  # the others go on
        check(d)
    wait_for(lambda: not stats(d).clients)
    with kvpool.connect(d.socket, name="c", layout=layout(3)) as c:  # idle now: reclaimed to make room
        assert c.create_sequence(PROMPT).num_cached_tokens == 0
    check(d)


def test_stats_name_each_class_tenant(daemon):
    with kvpool.connect(daemon.socket, name="a", layout=layout(1)):
        (cls,) = stats(daemon).classes
        assert cls.tenant == f"uid {os.getuid()}"


def test_a_class_whose_cache_memory_pressure_evicts_is_reclaimed(daemon):
    small = cache_prompt(daemon, layout(1))
    big = kvpool.Layout("big", num_layers=8, num_kv_heads=4, head_dim=64, dtype="float16", block_size=16)
    with kvpool.connect(daemon.socket, name="big", layout=big) as c:
        for i in range(1000):  # fill the pool: the idle class's cached blocks are evicted for room
            if small not in [cls.class_id for cls in stats(daemon).classes if cls.models == ("m1",)]:
                break
            try:
                c.create_sequence(range(256 * i, 256 * (i + 1)))
            except kvpool.OutOfBlocks:
                break
        assert [cls.models for cls in stats(daemon).classes] == [("big",)]
    check(daemon)
