"""A hostile tenant: ``python hostile_arena_proc.py SOCKET UID``; prints one JSON line.

It starts as root, imports everything it needs, then drops to ``UID`` (no
supplementary groups) before it connects, so the daemon sees another user's
kernel credentials (another tenant).  It writes a sequence's KV, asks the side
socket for its arena's memfd once more (the same file the daemon maps), and
tries every way of changing that file's size: shrink it to 0, grow it,
``pwrite`` and ``posix_fallocate`` past its end, a mapping past its end (in a
forked child, which a write there may kill), and sealing it against writes.
Then it makes the calls that make the daemon read its arena: ``mark_written``
(a remote tier writes the blocks out) and ``swap_out`` (to the host or disk
tier), and reports what each returned.  Nothing here raises: the test judges
the report.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import json
import mmap
import os
import signal
import sys

import grpc._channel  # noqa: F401 - grpc.insecure_channel imports it lazily
import numpy as np
import torch  # noqa: F401 - imported before the privileges go: its files may be unreadable afterwards

import kvpool
from kvpool.handoff import arena_fd
from kvpool.ipc import cpu_shm, views  # noqa: F401 - the same: imported while still root

# kvpool imports lazily: load all of it while the interpreter's files are still readable
_LOADED = (kvpool.connect, kvpool.Layout, kvpool.KvpoolError, kvpool.Connection)

LAYOUT = kvpool.Layout("hostile-model", num_layers=2, num_kv_heads=2, head_dim=16, dtype="float16", block_size=16)
UNOWNED_FILL = 16 << 20
PROMPTS = ([7] + list(range(1, 64)), [8] + list(range(1, 64)))  # 4 full blocks each, no shared block


def drop_to(uid: int) -> None:
    os.setgroups([])
    os.setgid(uid)
    os.setuid(uid)
    assert os.getuid() == uid and os.geteuid() == uid


def errno_of(fn, *args) -> str:
    """``ok`` if ``fn(*args)`` worked, else the name of its errno."""
    try:
        fn(*args)
    except OSError as exc:
        return errno.errorcode.get(exc.errno, str(exc.errno))
    return "ok"


def write_past_the_end(fd: int, size: int) -> str:
    """Map one page more than the file holds and write into it, in a child: how the child ended."""
    pid = os.fork()
    if pid == 0:  # the child: any exit path must be os._exit
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.mmap.restype = ctypes.c_void_p
            libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                                  ctypes.c_long]
            addr = libc.mmap(None, size + mmap.PAGESIZE, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED, fd, 0)
            if addr in (None, ctypes.c_void_p(-1).value):
                os._exit(3)
            ctypes.memset(addr + size, 0x5A, mmap.PAGESIZE)  # past the end: SIGBUS unless the file grew
            os._exit(0)
        except BaseException:  # noqa: BLE001 - a forked child never returns into the caller
            os._exit(4)
    _, status = os.waitpid(pid, 0)
    if os.WIFSIGNALED(status):
        return signal.Signals(os.WTERMSIG(status)).name
    return f"exit {os.WEXITSTATUS(status)}"


def attack(fd: int, size: int) -> dict:
    """Every change of the memfd's size a client could try; what each gave, and the file afterwards."""
    out = {
        "seals": fcntl.fcntl(fd, fcntl.F_GET_SEALS),
        # inside the size but outside every slab of its class: memory no budget counts, until the daemon
        # takes it back (when the session ends)
        "fill_unowned": errno_of(os.pwrite, fd, b"u" * UNOWNED_FILL, size - UNOWNED_FILL),
        "grow": errno_of(os.ftruncate, fd, size * 8),
        "pwrite_past_end": errno_of(os.pwrite, fd, b"x" * 4096, size),
        "fallocate_past_end": errno_of(os.posix_fallocate, fd, size, 64 << 20),
        "map_past_end": write_past_the_end(fd, size),
        "seal_write": errno_of(fcntl.fcntl, fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_WRITE),
        "seal_future_write": errno_of(fcntl.fcntl, fd, fcntl.F_ADD_SEALS, getattr(fcntl, "F_SEAL_FUTURE_WRITE", 16)),
        "shrink": errno_of(os.ftruncate, fd, 0),  # last: what the daemon reads next is the file as left here
    }
    st = os.fstat(fd)
    out["size_after"], out["allocated_after"] = st.st_size, st.st_blocks * 512
    return out


def call(fn) -> str:
    try:
        fn()
    except kvpool.KvpoolError as exc:
        return f"{type(exc).__name__}: {exc}"
    return "ok"


def main() -> None:
    sock, uid = sys.argv[1], int(sys.argv[2])
    drop_to(uid)
    report: dict = {"uid": os.getuid()}
    try:
        run(sock, report)
    except Exception as exc:  # noqa: BLE001 - a daemon that died mid-way: the report says where
        report["failed"] = f"{type(exc).__name__}: {exc}"
    print(json.dumps(report), flush=True)


def run(sock: str, report: dict) -> None:
    with kvpool.connect(sock, name="hostile", layout=LAYOUT) as c:
        seqs = [c.create_sequence(p) for p in PROMPTS]
        kv = c.kv_cache().numpy()
        for s in seqs:
            kv[s.block_table] = 1.5
        fd = arena_fd(c._conn.address, c._token)  # the very file the daemon maps, from the daemon
        try:
            report["arena_bytes"] = c.num_blocks * c.block_bytes
            report.update(attack(fd, os.fstat(fd).st_size))
        finally:
            os.close(fd)
        # the calls that make the daemon read this arena: a remote tier writes confirmed blocks out,
        # a swap-out copies the blocks to the host or disk tier
        report["mark_written"] = call(lambda: c.mark_written(seqs[0]))
        report["swap_out"] = call(lambda: c.swap_out(seqs[1]))
        report["swap_in"] = call(lambda: c.swap_in(seqs[1]))
        if report["shrink"] != "ok":  # a process that shrank the file it maps would fault on its own read
            report["intact"] = bool(np.all(c.kv_cache().numpy()[c.block_ids(seqs[1])] == 1.5))


if __name__ == "__main__":
    main()
