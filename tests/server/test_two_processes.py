"""Real daemon, real client processes, real shared memory."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

import kvpool

from procs import SCRIPT, run_client, wait_for


def test_second_process_reads_first_process_blocks(daemon):
    prompt = list(range(100, 114))  # 3 full blocks of 4 and 2 tokens more
    a = run_client(daemon.socket, "write", prompt=prompt, free=True)
    b = run_client(daemon.socket, "read", prompt=prompt[:12] + [7, 7, 7])
    assert b["cached"] == 12
    assert b["table"][:3] == a["table"][:3]  # the same physical blocks
    assert b["values"] == [float(t) for t in prompt[:12]]  # A's bytes, read by B


def test_fork_and_copy_on_write_seen_from_another_process(daemon):
    prompt = [5, 6, 7, 8, 9, 10]  # one full block and a half-full one
    f = run_client(daemon.socket, "fork", prompt=prompt, next=99)
    (src, dst), = f["copies"]
    assert f["parent"][1] == src and f["child"][1] == dst and f["child"][0] == f["parent"][0]
    peek = run_client(daemon.socket, "peek", blocks=[src, dst])
    assert peek["values"][0][:2] == [9.0, 10.0]  # the parent's half block
    assert peek["values"][1][:3] == [9.0, 10.0, 99.0]  # the copy, then the child's own token


def test_killed_client_loses_its_blocks_within_grace(daemon):
    proc = subprocess.Popen([sys.executable, SCRIPT, daemon.socket, "hold", json.dumps({"n": 5})],
                            stdout=subprocess.PIPE, text=True)
    try:
        assert json.loads(proc.stdout.readline())["holding"] == 5
        with kvpool.Connection(daemon.socket) as conn:
            assert conn.stats().classes[0].used_blocks == 15
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            killed_at = time.monotonic()
            assert wait_for(lambda: conn.stats().sequences == 0)
            assert time.monotonic() - killed_at < 1.0 + 5.0  # grace (1 s) plus a little
            st = conn.stats()
            assert st.clients == 0 and st.classes[0].used_blocks == 0
            assert st.classes[0].cached_blocks == 10  # full blocks stay in the prefix cache
            assert conn.check()[0]
    finally:
        proc.kill()


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
