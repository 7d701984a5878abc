"""Errors name what went wrong: a session limit is not a full pool, a refused socket is not a dead daemon."""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
import sys

import pytest

import kvpool

LAYOUT = kvpool.Layout("err-model", num_layers=1, num_kv_heads=1, head_dim=8, dtype="float16", block_size=4)


def test_too_many_sessions_is_its_own_error(daemon_factory):
    d = daemon_factory("--max-sessions", "1")
    first = kvpool.connect(d.socket, layout=LAYOUT, name="first")
    try:
        with pytest.raises(kvpool.TooManySessions) as info:
            kvpool.connect(d.socket, layout=LAYOUT, name="second")
        assert not isinstance(info.value, kvpool.OutOfBlocks)
        assert info.value.code == "RESOURCE_EXHAUSTED"
        assert "max_sessions" in str(info.value) and "blocks" not in str(info.value)
    finally:
        first.close()


USER = "kvpool-nonmember"

# Starts as root (the interpreter and the worktree need not be readable by the
# user), imports, then becomes the user before it connects.
PROBE = """
import os, sys, kvpool
import kvpool.client, kvpool.connection, kvpool.errors, kvpool.protocol.wire, kvpool.protocol.stats
layout = kvpool.Layout("m", num_layers=1, num_kv_heads=1, head_dim=8, dtype="float16", block_size=4)
try:  # loads what grpc imports lazily on a first connect
    kvpool.connect(sys.argv[1] + ".none", layout=layout, name="warm-up", timeout=1)
except kvpool.KvpoolError:
    pass
uid, gid = int(sys.argv[2]), int(sys.argv[3])
os.setgroups([]); os.setgid(gid); os.setuid(uid)
try:
    kvpool.connect(sys.argv[1], layout=layout, name="outsider", timeout=10)
except kvpool.PermissionDenied as exc:
    print("PermissionDenied", exc.code, exc)
except kvpool.KvpoolError as exc:
    print("other", type(exc).__name__, exc)
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to create a user and run as it")
def test_non_member_gets_permission_denied(daemon_factory):
    try:
        pwd.getpwnam(USER)
    except KeyError:
        if shutil.which("useradd") is None:
            pytest.skip("no useradd")
        subprocess.run(["useradd", "--system", "--no-create-home", USER], check=True)
    user = pwd.getpwnam(USER)
    d = daemon_factory("--socket-mode", "600")
    os.chmod(d.dir, 0o755)  # the user may reach the socket but not connect to it

    r = subprocess.run([sys.executable, "-c", PROBE, d.socket, str(user.pw_uid), str(user.pw_gid)],
                       capture_output=True, text=True, timeout=60)
    assert r.stdout.startswith("PermissionDenied PERMISSION_DENIED"), (r.stdout, r.stderr)
    assert "socket_group" in r.stdout
