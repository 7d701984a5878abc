"""Real daemon, real client processes, real shared memory."""

from __future__ import annotations

import os
import signal
import subprocess
import sys


import kvpool

from procs import (
    check_fork_copy_on_write_seen_from_another_process,
    check_killed_client_is_reaped,
    check_second_process_reads_first_process_blocks,
    run_client,
)


def test_second_process_reads_first_process_blocks(daemon):
    check_second_process_reads_first_process_blocks(daemon.socket)


def test_fork_and_copy_on_write_seen_from_another_process(daemon):
    check_fork_copy_on_write_seen_from_another_process(daemon.socket)


def test_killed_client_loses_its_blocks_within_grace(daemon):
    check_killed_client_is_reaped(daemon.socket, grace_seconds=1.0)


def test_second_daemon_on_the_same_socket_refuses(daemon, daemon_factory):
    second = daemon_factory(start=False)
    second.args[second.args.index("--socket") + 1] = daemon.socket
    out = subprocess.run([sys.executable, "-m", "kvpoold", *second.args], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert "already serving" in out.stderr and str(daemon.proc.pid) in out.stderr
    with kvpool.Connection(daemon.socket) as conn:
        conn.ping()  # the first one is unharmed


def memfds(pid: int) -> list[str]:
    """The daemon's anonymous arenas: memfds among its open files."""
    out = []
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except FileNotFoundError:
            continue
        if target.startswith("/memfd:kvpool-"):
            out.append(target)
    return out


def test_arenas_are_anonymous_and_nothing_outlives_the_daemon(daemon_factory):
    from kvpoold.memory.cpu_shm import instance_id

    d = daemon_factory(start=False)
    inst = instance_id(os.path.abspath(d.socket))

    def named():  # anything in /dev/shm that names this daemon (other tests' files come and go meanwhile)
        return [n for n in os.listdir("/dev/shm") if inst in n]

    before = named()
    assert before == []
    d.start()
    # a full block stays cached: the class and its arena outlive the client (an empty class is reclaimed)
    run_client(d.socket, "write", prompt=[1, 2, 3, 4, 5])
    held = memfds(d.proc.pid)
    assert len(set(held)) == 1  # one class, one memfd (and mmap's own copy of it): no file in any directory
    run_client(d.socket, "write", prompt=[1, 2, 3, 4, 5])
    assert memfds(d.proc.pid) == held  # handing it to a client leaves no descriptor behind
    assert named() == []
    assert d.stop(signal.SIGTERM) == 0
    assert not os.path.exists(d.socket) and not os.path.exists(d.socket + ".handoff")

    d.start()
    run_client(d.socket, "write", prompt=[1, 2, 3])
    d.stop(signal.SIGKILL)  # a crash leaves no memory behind to clean up: the kernel frees the memfd
    assert named() == []
    d.start()
    run_client(d.socket, "write", prompt=[1, 2, 3])
