"""Stress: 16 client processes doing random sequence calls, some SIGKILLed; nothing leaks.

Bounded: a fixed number of operations per process, loopback Unix socket only.
At the end the daemon's self-check passes and, after the grace period, no block
is used or reserved: only cached blocks remain.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import kvpool
from faultkit import wait_all_free

WORKER = str(Path(__file__).with_name("stress_worker.py"))
PROCS, OPS = 16, 150


def test_stress_random_calls_with_kills(daemon_factory, swap=True):
    # one run (CI time): the host tier on, so swap_out/swap_in are among the random calls
    args = ["--pool-bytes", "8MiB", "--chunk-bytes", "64KiB", "--grace-seconds", "0.5"]
    if swap:
        args += ["--host-bytes", "4MiB"]
    d = daemon_factory(*args)
    rng = random.Random(1234 + swap)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")]))
    procs = [subprocess.Popen([sys.executable, WORKER, d.socket, str(100 * swap + i), str(OPS), "1" if swap else "0"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
             for i in range(PROCS)]
    victims = set(rng.sample(range(PROCS), 5))
    t0 = time.monotonic()
    for i in sorted(victims):  # kill some at a random moment after they attached
        assert procs[i].stdout.readline().strip() == "ready", procs[i].stderr.read()
        time.sleep(rng.uniform(0.0, 0.4))
        procs[i].send_signal(signal.SIGKILL)
    done, by_op = 0, {}
    for i, p in enumerate(procs):
        out, err = p.communicate(timeout=120)
        if i in victims:
            assert p.returncode in (0, -signal.SIGKILL), err
            continue
        assert p.returncode == 0, err
        counts = json.loads(out.strip().splitlines()[-1])
        done += sum(counts.values())
        for k, v in counts.items():
            by_op[k] = by_op.get(k, 0) + v
    assert done >= (PROCS - len(victims)) * OPS
    assert all(by_op.get(k, 0) > 0 for k in ("create", "extend", "fork", "free")), by_op
    assert not swap or (by_op.get("swap_out", 0) > 0 and by_op.get("swap_in", 0) > 0), by_op
    assert d.proc.poll() is None, "the daemon died"
    with kvpool.Connection(d.socket) as conn:
        ok, detail = conn.check()
        assert ok, detail
    st = wait_all_free(d.socket)
    with kvpool.Connection(d.socket) as conn:
        ok, detail = conn.check()
        assert ok, detail
    assert st.sequences == 0 and st.clients == 0
    for cls in st.classes:
        assert cls.used_blocks == 0 and cls.reserved_blocks == 0, cls
        assert cls.cached_blocks + cls.free_blocks == cls.total_blocks, cls
    for cls in st.classes:
        assert cls.swapped_sequences == 0 and cls.lost_blocks == 0, cls
    print(f"stress: {PROCS} processes x {OPS} ops, {len(victims)} killed, {done} ops done {by_op}, "
          f"{time.monotonic() - t0:.1f} s")
