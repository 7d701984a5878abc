"""Per-user caps: one user flooding the daemon cannot lock another user, or root, out.

Real daemon, real users: ``kvpt1`` (the flood) and ``kvpt2`` (the other user) from ``test_tenants``, each
a process of its own (``user_proc.py``), and the test itself as root (``kvpoolctl``-like admin calls).
"""

from __future__ import annotations

import json
import os
import pwd
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

import kvpool
from kvpool.handoff import attach_ticket
from kvpoold.server.handoff import MAX_TICKETS, Credentials, TicketStore, TooManyTickets
from test_tenants import start, users  # noqa: F401 - users is a fixture

SCRIPT = str(Path(__file__).with_name("user_proc.py"))
FLOOD, OTHER = "kvpt1", "kvpt2"
WIDE = {"head_dim": 32}  # 4 KiB blocks: the 64 MiB test pool holds 16384 of them
POOL_BLOCKS = (64 << 20) // 4096


class UserProc:
    """A process of ``user`` that runs one command per call (``user_proc.py``)."""

    def __init__(self, user: str, d) -> None:
        self.proc = subprocess.Popen([sys.executable, SCRIPT, user, d.socket], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def __call__(self, op: str, **args) -> dict:
        self.proc.stdin.write(json.dumps({"op": op, **args}) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        assert line, self.proc.stderr.read()
        return json.loads(line)

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(60)


@pytest.fixture
def user(users, daemon_factory):  # noqa: F811 - the fixture imported above
    """Start a user's process; each ends (detaching its sessions) before the daemon is stopped."""
    made: list[UserProc] = []

    def run_as(name: str, d) -> UserProc:
        made.append(UserProc(name, d))
        return made[-1]

    yield run_as
    for p in made:
        p.close()


def root_attaches(d) -> None:
    """Root (the operator) still gets a ticket, attaches, and makes admin calls."""
    with kvpool.connect(d.socket, name="root", layout=kvpool.Layout("root-model", num_layers=1, num_kv_heads=1,
                                                                   head_dim=8, dtype="float16", block_size=4)) as c:
        assert c.create_sequence(range(8)).num_tokens == 8
    with kvpool.Connection(d.socket[:-5] + "-admin.sock") as admin:
        assert admin.drain(resume=True)["draining"] is False


def peak_rss_mib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) >> 10 for line in f if line.startswith("VmHWM:"))


# -- attach tickets --------------------------------------------------------------------------------------------


def test_a_ticket_flood_takes_only_the_flooding_users_tickets(user, daemon_factory):
    d = start(daemon_factory)  # the defaults
    flood = user(FLOOD, d)
    r = flood("tickets", n=MAX_TICKETS + 100)  # more than every user together may hold
    assert r["ok"] == 64, r  # max_tickets_per_user
    assert all("max_tickets_per_user" in why for why in r["refused"]), r
    assert user(OTHER, d)("attach", n=1)["attached"] == 1  # the other user attaches within the 30 s
    root_attaches(d)
    assert "max_tickets_per_user" in d.output()  # the operator is told, once


def test_expired_tickets_stop_counting_against_their_user():
    store = TicketStore(seconds=0.0)  # every ticket expires at once
    flood, other = Credentials(pid=10, uid=1001, gid=1001), Credentials(pid=11, uid=1002, gid=1002)
    kept = TicketStore()
    for _ in range(3):
        kept.issue(flood, per_user=3)
        store.issue(flood, per_user=3)
    with pytest.raises(TooManyTickets, match="uid 1001 holds 3 unredeemed"):
        kept.issue(flood, per_user=3)
    assert kept.issue(other, per_user=3)  # another user's count is its own
    assert store.issue(flood, per_user=3)  # the expired three were dropped, not counted


# -- sessions --------------------------------------------------------------------------------------------------


def test_one_user_cannot_take_every_session(user, daemon_factory):
    d = start(daemon_factory, "--max-sessions", "12", "--max-sessions-per-user", "4")
    flood = user(FLOOD, d)
    r = flood("attach", n=12)
    assert r["attached"] == 4 and r["error"] == "TooManySessions", r
    assert "max_sessions_per_user" in r["message"] and f"uid {pwd.getpwnam(FLOOD).pw_uid}" in r["message"]
    other = user(OTHER, d)
    assert other("attach", n=4)["attached"] == 4  # its own four
    root_attaches(d)
    flood.close()  # its sessions end: it may attach again
    assert user(FLOOD, d)("attach", n=1)["attached"] == 1


# -- side-socket connections -------------------------------------------------------------------------------------


def test_one_user_cannot_hold_every_side_socket_connection(user, daemon_factory):
    d = start(daemon_factory, "--max-handoff-connections-per-user", "8", "--handoff-timeout", "300")
    flood = user(FLOOD, d)
    assert flood("open", kind="handoff", n=40)["opened"] == 40
    r = flood("watch", want=32, timeout=60)  # accepted in order: the first 8 are held, the rest refused at once
    assert r["closed"] == 32 and r["open"] == 8 and r["said"] == ["err too many connections"], r
    refused = flood("tickets", n=1)  # the flooding user's next connection too...
    assert refused["ok"] == 0 and "too many connections" in next(iter(refused["refused"])), refused
    assert user(OTHER, d)("attach", n=2)["attached"] == 2  # ...not the other user's
    root_attaches(d)
    flood("close")  # its connections closed: the daemon counts them down
    deadline = time.monotonic() + 60
    while flood("tickets", n=1)["ok"] != 1:
        assert time.monotonic() < deadline, "the closed connections were never counted down"
        time.sleep(0.2)


def test_a_silent_side_socket_connection_is_closed_at_the_deadline(user, daemon_factory):
    d = start(daemon_factory, "--max-handoff-connections-per-user", "4", "--handoff-timeout", "1")
    flood = user(FLOOD, d)
    flood("open", kind="handoff", n=4)  # the user's whole allowance, saying nothing
    r = flood("watch", want=4, timeout=60)
    assert r["closed"] == 4 and r["said"] == [""], r  # closed without an answer
    assert flood("tickets", n=1)["ok"] == 1  # and no longer counted
    assert user(OTHER, d)("attach", n=1)["attached"] == 1


def test_out_of_descriptors_the_side_socket_backs_off_and_logs_a_count(user, daemon_factory):
    # no per-user cap, a long deadline and few descriptors: one user's idle connections exhaust them
    d = start(daemon_factory, "--max-handoff-connections-per-user", "0", "--handoff-timeout", "300",
              nofile=64)
    flood = user(FLOOD, d)
    r = flood("open", kind="handoff", n=150)  # the backlog takes what the daemon cannot accept
    assert r["opened"] > 64, r
    deadline = time.monotonic() + 60
    while "accept failed" not in d.output():
        assert time.monotonic() < deadline, d.output()
        time.sleep(0.2)
    proc = psutil.Process(d.proc.pid)
    cpu0, t0 = sum(proc.cpu_times()[:2]), time.monotonic()
    time.sleep(3)  # the window the accept loop is watched in; a loop retrying at once would burn it all
    busy = (sum(proc.cpu_times()[:2]) - cpu0) / (time.monotonic() - t0)
    assert busy < 0.5, f"the daemon used {busy:.0%} of a CPU while out of descriptors"
    log = d.output()
    assert "Traceback" not in log, log[-3000:]
    failures = [line for line in log.splitlines() if "accept failed" in line]
    assert 1 <= len(failures) <= 3, failures  # the first at once, then one line per 10 s with a count
    flood("close")
    assert user(OTHER, d)("attach", n=1)["attached"] == 1  # accepting again once descriptors are free


# -- the gRPC sockets ----------------------------------------------------------------------------------------


def test_idle_grpc_connections_are_closed(user, daemon_factory):
    d = start(daemon_factory, "--grpc-idle-seconds", "1")
    flood = user(FLOOD, d)
    flood("open", kind="grpc", n=20)  # connections that never make a call
    r = flood("watch", want=20, timeout=60)
    assert r["closed"] == 20, r
    other = user(OTHER, d)
    assert other("attach", n=1)["attached"] == 1
    time.sleep(2)  # longer than the idle limit: a session's Watch stream keeps its connection
    assert "error" not in other("create", tokens=8)
    with kvpool.Connection(d.socket) as conn:  # a connection without a call in progress is closed...
        conn.ping()
        time.sleep(2)
        conn.ping()  # ...and the next call reconnects


def test_the_grpc_connection_cap_leaves_descriptors_for_the_admin_socket(user, daemon_factory):
    d = start(daemon_factory, "--max-grpc-connections", "16", "--grpc-idle-seconds", "0", nofile=128)
    flood = user(FLOOD, d)
    assert flood("open", kind="grpc", n=200)["opened"] == 200  # more than the daemon has descriptors
    r = flood("watch", want=184, timeout=60)  # beyond the cap: closed as they are accepted
    assert r["closed"] == 184 and r["open"] == 16, r
    with kvpool.Connection(d.socket[:-5] + "-admin.sock") as admin:  # a server of its own, descriptors left
        assert admin.stats().clients == 0
        assert admin.drain(resume=False)["draining"] is True
        assert admin.drain(resume=True)["draining"] is False
    assert attach_ticket(d.socket)  # and the side socket


def test_an_oversized_request_is_refused_unread(user, daemon_factory):
    d = start(daemon_factory)  # max_message_bytes 0: what max_tokens_per_call and the other limits need (12 MiB)
    before = peak_rss_mib(d.proc.pid)
    flood = user(FLOOD, d)
    flood("attach", n=1)
    r = flood("big", nbytes=240_000_000)
    assert r["error"] == "InvalidArgument" and "max_message_bytes" in r["message"], r
    grown = peak_rss_mib(d.proc.pid) - before
    assert grown < 100, f"the daemon's peak memory grew {grown} MiB for a request it refused"
    other = user(OTHER, d)
    assert other("attach", n=1)["attached"] == 1 and "error" not in other("create", tokens=8)


# -- the pool's memory ---------------------------------------------------------------------------------------------


def test_a_user_alone_may_use_the_whole_pool(user, daemon_factory):
    d = start(daemon_factory)
    one = user(FLOOD, d)
    one("attach", n=2, layout=WIDE)
    r = one("fill", tokens=400)  # 100 blocks a sequence
    assert r["error"] == "OutOfBlocks" and "pool share" not in r["message"], r
    assert r["blocks"] >= POOL_BLOCKS - 200, r


def test_two_users_share_the_pool_fairly(user, daemon_factory):
    d = start(daemon_factory, "--max-blocks-per-session", "2000")  # a quota per session is no bound per user
    other = user(OTHER, d)
    other("attach", n=9, layout=WIDE)  # attached, holding nothing yet (9 x 2000 blocks: more than the pool)
    flood = user(FLOOD, d)
    flood("attach", n=12, layout=WIDE)
    r = flood("fill", tokens=400)
    assert r["error"] == "OutOfBlocks" and "pool share of uid" in r["message"] and "fair_share" in r["message"], r
    assert POOL_BLOCKS // 2 - 100 <= r["blocks"] <= POOL_BLOCKS // 2, r  # half: two users
    mine = other("fill", tokens=400)
    assert mine["blocks"] >= POOL_BLOCKS // 2 - 200, mine  # the other half is there for the other user
    flood.close()  # the first user leaves (its sessions detach): the other may grow into the whole pool
    alone = other("fill", tokens=400)
    assert "pool share" not in alone["message"] and alone["blocks"] >= POOL_BLOCKS - 200, alone


def test_a_pool_share_cap_bounds_a_user_that_comes_first(user, daemon_factory):
    d = start(daemon_factory, "--max-pool-share-per-user", "0.25")
    flood = user(FLOOD, d)
    flood("attach", n=4, layout=WIDE)
    r = flood("fill", tokens=400)  # alone, it takes at most a quarter
    assert "max_pool_share_per_user" in r["message"] and r["blocks"] <= POOL_BLOCKS // 4, r
    other = user(OTHER, d)
    other("attach", n=1, layout=WIDE)
    assert other("fill", tokens=400)["blocks"] >= POOL_BLOCKS // 4 - 100  # the memory was there when it came


def test_per_user_caps_change_on_sighup(daemon_factory, tmp_path):
    cfg = tmp_path / "kvpoold.toml"
    base = 'pool_bytes = "64MiB"\nchunk_bytes = "64KiB"\n'
    cfg.write_text(base + "max_sessions_per_user = 1\n")
    d = daemon_factory(start=False)
    d.args = ["--socket", d.socket, "--config", str(cfg)]
    d.start()
    layout = kvpool.Layout("reload", num_layers=1, num_kv_heads=1, head_dim=8, dtype="float16", block_size=4)
    with kvpool.connect(d.socket, name="first", layout=layout):
        with pytest.raises(kvpool.TooManySessions, match="max_sessions_per_user"):
            kvpool.connect(d.socket, name="second", layout=layout)
        cfg.write_text(base + "max_sessions_per_user = 2\nmax_tokens_per_call = 2097152\n")
        os.kill(d.proc.pid, signal.SIGHUP)
        deadline = time.monotonic() + 60
        while "reload: changed" not in d.output():
            assert time.monotonic() < deadline, d.output()
            time.sleep(0.1)
        with kvpool.connect(d.socket, name="second", layout=layout):
            pass
    assert "max_sessions_per_user 1 -> 2" in d.output()
    assert "restart kvpoold for the" in d.output()  # the gRPC message limit is fixed at start
