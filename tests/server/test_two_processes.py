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


def shm_segments(daemon) -> list[str]:
    from kvpoold.memory.cpu_shm import instance_id

    prefix = f"kvpool-{os.getuid()}-{instance_id(os.path.abspath(daemon.socket))}-"
    return [n for n in os.listdir("/dev/shm") if n.startswith(prefix)]


def test_shared_memory_removed_on_sigterm_and_after_a_crash(daemon_factory):
    d = daemon_factory()
    run_client(d.socket, "write", prompt=[1, 2, 3])
    assert len(shm_segments(d)) == 1
    assert d.stop(signal.SIGTERM) == 0
    assert shm_segments(d) == [] and not os.path.exists(d.socket)

    d.start()
    run_client(d.socket, "write", prompt=[1, 2, 3])
    d.stop(signal.SIGKILL)
    assert len(shm_segments(d)) == 1  # a crash leaves it behind...
    d.start()
    assert shm_segments(d) == []  # ...and the next start removes it
    assert "removed shared memory left by a previous daemon" in d.output()
