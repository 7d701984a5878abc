"""A model process that runs as another user, for the tenant tests: ``python tenant_proc.py USER SOCKET ACTION JSON``.

It starts as root, imports everything it needs, then drops to ``USER``
(its groups from the group database) before it connects: the kernel's
credentials of its connections are then that user's, exactly as for a
process started as that user (the interpreter may live under a home that
other users cannot read, so it cannot simply be started as them).

Actions (each prints one JSON line; ``hold`` then waits for stdin to close):
  write  -- create ``prompt``, write ``value`` into every K/V element of its blocks, mark them written;
            prints the table, the session token (hex) and what ``lookup`` says of ``prompt``
  probe  -- ``lookup`` and ``create`` ``prompt``; prints what was cached, and whether ``value``
            occurs anywhere in the memory this process can map
  steal  -- ask the side socket for the arena of session ``token`` (another process's); prints the outcome
  attach -- just attach; prints the error's class name if it fails
"""

from __future__ import annotations

import grp
import json
import os
import pwd
import sys

import grpc._channel  # noqa: F401 - grpc.insecure_channel imports it lazily
import numpy as np
import torch  # noqa: F401 - imported before the privileges go: its files may be unreadable afterwards

import kvpool
from kvpool.handoff import arena_fd
from kvpool.ipc import cpu_shm, views  # noqa: F401 - the same: imported while still root

# kvpool imports lazily: load all of it while the interpreter's files are still readable
_LOADED = (kvpool.connect, kvpool.Layout, kvpool.KvpoolError, kvpool.PermissionDenied, kvpool.Connection)

LAYOUT = dict(num_layers=2, num_kv_heads=2, head_dim=4, dtype="float32", block_size=4)


def drop_to(user: str) -> None:
    pw = pwd.getpwnam(user)
    groups = [g.gr_gid for g in grp.getgrall() if user in g.gr_mem]
    os.setgroups(groups)
    os.setgid(pw.pw_gid)
    os.setuid(pw.pw_uid)
    assert os.getuid() == pw.pw_uid and os.geteuid() == pw.pw_uid


def main() -> None:
    user, socket, action, args = sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4])
    drop_to(user)
    layout = kvpool.Layout(args.get("model", "tenant-model"), **LAYOUT)
    if action == "attach":
        try:
            with kvpool.connect(socket, name="t-attach", layout=layout) as c:
                print(json.dumps({"attached": c.session_id}), flush=True)
        except kvpool.KvpoolError as exc:
            print(json.dumps({"error": type(exc).__name__, "message": str(exc)}), flush=True)
        return
    if action == "steal":
        try:
            fd = arena_fd(socket, bytes.fromhex(args["token"]))
            print(json.dumps({"got_fd": True, "fd": fd}), flush=True)
        except kvpool.KvpoolError as exc:
            print(json.dumps({"got_fd": False, "error": type(exc).__name__, "message": str(exc)}), flush=True)
        return
    with kvpool.connect(socket, name=f"t-{action}", layout=layout) as c:
        if action == "write":
            seq = c.create_sequence(args["prompt"])
            kv = c.kv_cache()
            for b in seq.block_table.tolist():
                kv[b] = args["value"]
            c.mark_written(seq)
            print(json.dumps({"table": seq.block_table.tolist(), "class_id": c.class_id,
                              "token": c._token.hex(), "lookup": c.lookup(args["prompt"])}), flush=True)
            sys.stdin.read()  # hold the session (and its blocks) until the test is done
            kv = c.kv_cache().numpy()
            print(json.dumps({"intact": bool(np.all(kv[seq.block_table] == np.float32(args["value"])))}),
                  flush=True)
        elif action == "probe":
            looked = c.lookup(args["prompt"])
            seq = c.create_sequence(args["prompt"])
            kv = c.kv_cache().numpy()
            seen = bool(np.any(kv == np.float32(args["value"])))
            kv[...] = -1.0  # and overwrite everything this process can reach
            print(json.dumps({"lookup": looked, "cached": seq.num_cached_tokens, "seen": seen,
                              "class_id": c.class_id}), flush=True)


if __name__ == "__main__":
    main()
