"""Tenants: identity from the kernel, no shared memory or cache across users, nothing to squat.

Real daemon, real processes, real users: the test creates system users
(``kvpt1`` and ``kvpt2`` in the socket's group ``kvptg``, ``kvpt3`` outside
it) and runs model processes as them (``tenant_proc.py``).  Those tests need
root and ``useradd``; the ticket tests run as anyone.
"""

from __future__ import annotations

import grp
import json
import os
import pwd
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

import kvpool
from kvpool.handoff import attach_ticket, socket_path
from kvpool.protocol import kvpool_pb2 as pb
from kvpoold.memory.cpu_shm import instance_id

SCRIPT = str(Path(__file__).with_name("tenant_proc.py"))
GROUP, MEMBERS, OUTSIDER = "kvptg", ("kvpt1", "kvpt2"), "kvpt3"
PROMPT = list(range(100, 116))  # 4 full blocks of 4
VALUE = 4242.5  # what tenant 1 writes into its blocks
LAYOUT = kvpool.Layout("tenant-model", num_layers=2, num_kv_heads=2, head_dim=4, dtype="float32", block_size=4)


def _ensure_user(name: str, groups: tuple[str, ...] = ()) -> None:
    try:
        pwd.getpwnam(name)
    except KeyError:
        subprocess.run(["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", name],
                       check=True, capture_output=True)
    for g in groups:
        if name not in grp.getgrnam(g).gr_mem:
            subprocess.run(["usermod", "-aG", g, name], check=True, capture_output=True)


@pytest.fixture(scope="module")
def users():
    if os.geteuid() != 0 or not shutil.which("useradd") or not shutil.which("groupadd"):
        pytest.skip("needs root and useradd/groupadd to run clients as other users")
    subprocess.run(["groupadd", "-f", "--system", GROUP], check=True, capture_output=True)
    for name in MEMBERS:
        _ensure_user(name, (GROUP,))
    _ensure_user(OUTSIDER)
    return True


def start(daemon_factory, *args: str, **kw):
    """A daemon whose socket the group may use (its directory traversable by the other users)."""
    d = daemon_factory("--socket-group", GROUP, "--socket-mode", "660", *args, start=False, **kw)
    os.chmod(d.dir, 0o755)
    return d.start()


def as_user(user: str, d, action: str, **args) -> dict:
    out = subprocess.run([sys.executable, SCRIPT, user, d.socket, action, json.dumps(args)],
                         capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


class Holder:
    """Tenant 1's process: writes ``VALUE`` into its blocks and holds them until ``finish``."""

    def __init__(self, user: str, d, **args) -> None:
        self.proc = subprocess.Popen([sys.executable, SCRIPT, user, d.socket, "write",
                                      json.dumps({"prompt": PROMPT, "value": VALUE, **args})],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        line = self.proc.stdout.readline()
        assert line, self.proc.stderr.read()
        self.info = json.loads(line)

    def finish(self) -> dict:
        out, err = self.proc.communicate("", timeout=60)
        assert self.proc.returncode == 0, err
        return json.loads(out.strip().splitlines()[-1])


def test_a_second_tenant_sees_nothing_of_the_first(users, daemon_factory):
    d = start(daemon_factory)  # tenant_by = uid (the default)
    one = Holder("kvpt1", d)
    try:
        assert one.info["lookup"] == len(PROMPT)  # tenant 1's own prefix is cached for tenant 1
        # same model id, same geometry, same prompt: another user gets its own class, arena and cache
        two = as_user("kvpt2", d, "probe", prompt=PROMPT, value=VALUE)
        assert two["class_id"] != one.info["class_id"]
        assert two["lookup"] == 0 and two["cached"] == 0  # lookup and create reveal nothing
        assert two["seen"] is False  # none of tenant 1's bytes in any memory tenant 2 can map
        # with tenant 1's session token (stolen), another user's process gets no fd...
        stolen = as_user("kvpt2", d, "steal", token=one.info["token"])
        assert stolen["got_fd"] is False and stolen["error"] == "PermissionDenied"
        # ...and neither does another process of the same user: the fd goes to the attached process only
        same_user = as_user("kvpt1", d, "steal", token=one.info["token"])
        assert same_user["got_fd"] is False
        assert "arena refused" in d.output()
    finally:
        done = one.finish()
    assert done["intact"] is True  # tenant 2 overwrote everything it could reach: none of it was tenant 1's


def test_tenant_by_none_shares_across_users(users, daemon_factory):
    d = start(daemon_factory, "--tenant-by", "none")
    one = Holder("kvpt1", d)
    try:
        two = as_user("kvpt2", d, "probe", prompt=PROMPT, value=VALUE)
        assert two["class_id"] == one.info["class_id"]
        assert two["lookup"] == len(PROMPT) and two["cached"] == len(PROMPT)  # a prefix hit across users
        assert two["seen"] is True
    finally:
        one.finish()


def test_a_user_outside_the_socket_group_cannot_attach(users, daemon_factory):
    d = start(daemon_factory)
    r = as_user(OUTSIDER, d, "attach")
    assert r.get("error") == "PermissionDenied", r
    assert "attached" in as_user("kvpt1", d, "attach")


def test_squatted_shared_memory_names_do_not_stop_the_daemon(users, daemon_factory):
    d = daemon_factory("--socket-group", GROUP, "--socket-mode", "660", start=False)
    os.chmod(d.dir, 0o755)
    inst = instance_id(os.path.abspath(d.socket))
    names = [f"kvpool-{os.getuid()}-{inst}-c{i}" for i in range(8)] + \
            [f"kvpool-{uid}-{inst}-c0" for uid in (0, pwd.getpwnam(OUTSIDER).pw_uid)] + \
            ["kvpool-anything", f"kvpool-{inst}-c0"]
    outsider = pwd.getpwnam(OUTSIDER)
    made = []
    try:
        for name in names:  # what a local user could create before the daemon starts, as that user
            path = os.path.join("/dev/shm", name)
            if os.path.exists(path):
                continue
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
            os.fchown(fd, outsider.pw_uid, outsider.pw_gid)
            os.close(fd)
            made.append(path)
        d.start()
        one = Holder("kvpt1", d)
        assert one.info["lookup"] == len(PROMPT)
        assert one.finish()["intact"] is True
        d.stop()
        d.start()  # and across a restart
        assert "attached" in as_user("kvpt2", d, "attach")
    finally:
        for path in made:
            os.unlink(path)


# -- tickets: run as anyone ------------------------------------------------------------------------


def _attach_request(**kw) -> pb.AttachRequest:
    return pb.AttachRequest(name="raw", pid=kw.pop("pid", os.getpid()), layout=pb.Layout(
        model_id="m", num_layers=1, num_kv_heads=1, head_dim=8, dtype="float16", block_size=4), **kw)


def test_attach_needs_a_valid_ticket_of_its_own_process(daemon):
    with kvpool.Connection(daemon.socket) as conn:
        for bad in (b"", os.urandom(32), b"x"):  # absent, forged
            with pytest.raises(kvpool.PermissionDenied, match="attach through kvpool.connect: no credentials"):
                conn.call("Attach", _attach_request(attach_ticket=bad))
        ticket = attach_ticket(conn.address)
        r = conn.call("Attach", _attach_request(attach_ticket=ticket))
        assert r.session
        with pytest.raises(kvpool.PermissionDenied, match="used"):  # one use only
            conn.call("Attach", _attach_request(attach_ticket=ticket))
        # a ticket another process got is not this process's
        out = subprocess.run([sys.executable, "-c", "import sys; from kvpool.handoff import attach_ticket; "
                              "print(attach_ticket(sys.argv[1]).hex())", daemon.socket],
                             capture_output=True, text=True, timeout=120, check=True)
        theirs = bytes.fromhex(out.stdout.strip())
        with pytest.raises(kvpool.PermissionDenied, match="issued to pid"):
            conn.call("Attach", _attach_request(attach_ticket=theirs))
        with pytest.raises(kvpool.PermissionDenied):  # and it is void now
            conn.call("Attach", _attach_request(attach_ticket=theirs))


def test_side_socket_is_bounded_and_never_blocks_attaches(daemon):
    path = socket_path(daemon.socket)
    assert os.stat(path).st_mode & 0o777 == os.stat(daemon.socket).st_mode & 0o777
    silent = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    silent.connect(path)  # says nothing: must not hold anyone up, and is dropped after the timeout
    flood = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    flood.connect(path)
    flood.sendall(b"x" * 100_000)  # no newline within the bound
    try:
        with kvpool.connect(daemon.socket, name="beside", layout=LAYOUT) as c:
            assert c.create_sequence(PROMPT).num_tokens == len(PROMPT)
        unknown = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        unknown.connect(path)
        unknown.sendall(b"open sesame\n")
        unknown.settimeout(10)
        assert unknown.recv(100).startswith(b"err")
        unknown.close()
        silent.settimeout(10)
        t0 = time.monotonic()
        assert silent.recv(100) == b""  # closed by the daemon
        assert time.monotonic() - t0 < 9
    finally:
        silent.close()
        flood.close()
