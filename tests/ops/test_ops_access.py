"""Access control: own sequences only, admin calls on the admin socket, drain, quotas, socket modes."""

from __future__ import annotations

import grp
import os
import stat

import numpy as np
import pytest

import kvpool
from kvpool import Connection
from kvpool.handoff import attach_ticket
from kvpool.protocol import kvpool_pb2 as pb
from opskit import LAYOUT


def admin_of(d) -> str:
    return d.socket[:-5] + "-admin.sock"


def test_sockets_modes_and_group(daemon_factory):
    group = grp.getgrgid(os.getgid()).gr_name
    d = daemon_factory("--socket-mode", "640", "--socket-group", group)
    st = os.stat(d.socket)
    assert stat.S_ISSOCK(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o640 and st.st_gid == os.getgid()
    st = os.stat(admin_of(d))
    assert stat.S_IMODE(st.st_mode) == 0o600  # the default: only the daemon's user
    st = os.stat(d.socket + ".handoff")  # the side socket (tickets, arena fds) has the same access
    assert stat.S_ISSOCK(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o640 and st.st_gid == os.getgid()
    with kvpool.connect(d.socket, name="g", layout=LAYOUT) as c:
        c.create_sequence(range(5))
        assert c._mapping.descriptor["kind"] == "memfd"  # no file to give a group: the fd goes to the attached process
        c.kv_cache()


def test_no_admin_socket(daemon_factory):
    d = daemon_factory("--admin-socket", "none")
    assert not os.path.exists(admin_of(d))
    with Connection(d.socket) as conn, pytest.raises(kvpool.PermissionDenied, match="none is configured"):
        conn.evict()


def test_a_session_cannot_touch_another_sessions_sequences(daemon):
    a = kvpool.connect(daemon.socket, name="a", layout=LAYOUT)
    b = kvpool.connect(daemon.socket, name="b", layout=LAYOUT)
    try:
        seq = a.create_sequence(range(6))
        one = dict(seq_ids=np.array([seq.id], "<i8").tobytes(), token_counts=np.array([1], "<i4").tobytes(),
                   tokens=np.array([1], "<u4").tobytes())
        with pytest.raises(kvpool.PermissionDenied, match="another session"):
            b._conn.call("Step", pb.StepRequest(session=b._token, **one))
        with pytest.raises(kvpool.PermissionDenied, match="another session"):
            b._conn.call("Step", pb.StepRequest(session=b._token, free_seq_ids=[seq.id]))
        with pytest.raises(kvpool.PermissionDenied, match="another session"):
            b._conn.call("Fork", pb.ForkRequest(session=b._token, seq_ids=[seq.id]))
        with pytest.raises(kvpool.PermissionDenied, match="admin call"):  # a's table, asked by b
            b._conn.sequences_of(a.session_id, session=b._token)
        with pytest.raises(kvpool.PermissionDenied, match="admin call"):  # nor without any session
            b._conn.sequences_of(a.session_id)
        assert [s.seq_id for s in a._conn.sequences_of(a.session_id, session=a._token)] == [seq.id]
        with Connection(admin_of(daemon)) as admin:
            assert [s.seq_id for s in admin.sequences_of(a.session_id)] == [seq.id]
        assert seq.num_tokens == 6 and a._conn.check()[0]
    finally:
        a.close()
        b.close()


def test_admin_calls_only_on_the_admin_socket(daemon):
    with kvpool.connect(daemon.socket, name="a", layout=LAYOUT) as c:
        c.free(c.create_sequence(range(12)))  # 3 cached blocks
        with Connection(daemon.socket) as conn:
            for call in (conn.evict, conn.drain, lambda: conn.drain(resume=True), conn.reset):
                with pytest.raises(kvpool.PermissionDenied, match=f"use the admin socket {admin_of(daemon)}"):
                    call()
            assert conn.stats().classes[0].cached_blocks == 3  # refused: nothing changed
            assert conn.clients() and conn.check()[0]  # read-only calls stay open
        with Connection(admin_of(daemon)) as admin:
            assert admin.evict() == 3
            assert admin.stats().classes[0].cached_blocks == 0


def test_drain_stops_new_work_and_lets_running_work_finish(daemon):
    with kvpool.connect(daemon.socket, name="runner", layout=LAYOUT) as c, Connection(admin_of(daemon)) as admin:
        seq = c.create_sequence(range(6))
        assert admin.drain() == {"draining": True, "sessions": 1, "sequences": 1}
        assert c.stats().draining
        with pytest.raises(kvpool.FailedPrecondition, match="draining: no new attaches"):
            kvpool.connect(daemon.socket, name="new", layout=LAYOUT)
        with pytest.raises(kvpool.FailedPrecondition, match="draining: no new sequences"):
            c.create_sequence(range(3))
        with pytest.raises(kvpool.FailedPrecondition, match="draining"):
            c.fork(seq)
        for i in range(10):  # the running sequence goes on
            c.extend({seq: [100 + i]})
        c.flush()
        assert c.lookup(range(6)) == 4  # lookups allocate nothing: allowed
        c.free(seq)
        assert admin.drain()["sequences"] == 0
        assert admin.drain(resume=True)["draining"] is False
        c.create_sequence(range(3))
        with kvpool.connect(daemon.socket, name="new", layout=LAYOUT):
            pass


def test_quota_is_resource_exhausted_naming_it_and_changes_nothing(daemon_factory):
    d = daemon_factory("--max-blocks-per-session", "6")
    with kvpool.connect(d.socket, name="q", layout=LAYOUT) as c, \
            kvpool.connect(d.socket, name="other", layout=LAYOUT) as other:
        assert c._conn.call("Stats", pb.StatsRequest()).clients == 2
        seq = c.create_sequence(range(16))  # 4 blocks
        before = c.stats().classes[0]
        with pytest.raises(kvpool.OutOfBlocks, match=r"quota max_blocks_per_session=6 exceeded: the session "
                                                      r"holds 4 blocks and this call needs 3 more"):
            c.create_sequence(range(100, 112))
        with pytest.raises(kvpool.OutOfBlocks, match="max_blocks_per_session"):
            c.fork(seq)  # a fork holds every block of its parent again
        with pytest.raises(kvpool.OutOfBlocks, match="max_blocks_per_session=6"):
            c._conn.call("Step", pb.StepRequest(
                session=c._token, seq_ids=np.array([seq.id], "<i8").tobytes(),
                token_counts=np.array([9], "<i4").tobytes(), tokens=np.arange(9, dtype="<u4").tobytes()))
        after = c.stats().classes[0]
        assert (after.used_blocks, after.cached_blocks) == (before.used_blocks, before.cached_blocks)
        assert seq.num_tokens == 16 and c._conn.check()[0]
        for t in range(8):  # up to the quota is fine: 16 + 8 tokens = 6 blocks
            c.extend({seq: [t]})
        c.flush()
        assert seq.num_tokens == 24
        with pytest.raises(kvpool.OutOfBlocks, match="max_blocks_per_session"):
            c.create_sequence(range(3))
        other.create_sequence(range(24))  # a quota is per session
        c.free(seq)
        c.create_sequence(range(20))  # freed blocks no longer count
        reserved = [cl.reserved_blocks for cl in c.stats().classes][0]
        assert reserved <= 6 + 6  # reserves are trimmed to the headroom, never an error
    with kvpool.connect(d.socket, name="attach-shows-quota", layout=LAYOUT) as c:
        r = c._conn.call("Attach", pb.AttachRequest(name="x", pid=os.getpid(), layout=pb.Layout(
            model_id="m", num_layers=1, num_kv_heads=1, head_dim=8, dtype="float16", block_size=4),
            attach_ticket=attach_ticket(c._conn.address)))
        assert r.max_blocks_per_session == 6
        c._conn.call("Detach", pb.DetachRequest(session=r.session))


def test_quota_counts_swapped_in_blocks_again(daemon_factory):
    """A swapped-out sequence holds no device blocks; swapping it back in must fit the quota again."""
    d = daemon_factory("--max-blocks-per-session", "6", env={"KVPOOL_HOST_BYTES": "16MiB"})
    with kvpool.connect(d.socket, name="swapper", layout=LAYOUT) as c:
        seq = c.create_sequence(range(16))  # 4 blocks
        out = c._conn.call("SwapOut", pb.SwapRequest(session=c._token, seq_ids=[seq.id]))
        assert out.blocks == 4
        c.create_sequence(range(200, 216))  # 4 more: the swapped-out ones do not count
        with pytest.raises(kvpool.OutOfBlocks, match="quota max_blocks_per_session=6 exceeded: the session "
                                                      "holds 4 blocks and this call needs 4 more"):
            c._conn.call("SwapIn", pb.SwapRequest(session=c._token, seq_ids=[seq.id]))
        assert c._conn.check()[0]


def test_reset_empties_the_pool_and_expires_sessions(daemon):
    import subprocess
    import sys

    c = kvpool.connect(daemon.socket, name="victim", layout=LAYOUT)
    try:
        c.free(c.create_sequence(range(12)))  # 3 cached blocks
        live = c.create_sequence(range(9))
        c.mark_written(live)
        out = subprocess.run([sys.executable, "-m", "kvpoold.ctl", "--socket", daemon.socket, "reset"],
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 2 and "--yes" in out.stderr  # nothing without --yes
        assert c.stats().sequences == 1
        out = subprocess.run([sys.executable, "-m", "kvpoold.ctl", "--socket", daemon.socket, "reset", "--yes",
                              "--json"], capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        import json

        r = json.loads(out.stdout)
        assert r["sessions_dropped"] == 1 and r["cached_evicted"] >= 3
        with Connection(daemon.socket) as conn:
            st = conn.stats()
            # nothing held or cached is left of the class: it was reclaimed with its memory
            assert st.sequences == 0 and st.clients == 0 and st.classes == ()
            assert conn.check()[0]
        with pytest.raises(kvpool.SessionExpired):
            c.create_sequence(range(3))  # the dropped client hears it at its next call
    finally:
        c.close()
