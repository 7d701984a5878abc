"""Half-finished tier operations when their session dies: released or completed, never leaked.

A client process is SIGKILLed, or frozen (SIGSTOP) past its lease, while its
create waits for a promotion from disk, while its swap-in reads from disk, or
right after its swap-out while the disk writes still run.  The disk I/O is
slowed by the ``sleep`` failpoint (``kvpoold/faults.py``) so the operation is
surely in flight.  Afterwards the pool is all free but cached blocks, no tier
holds a pinned copy, the self-check passes, and the blocks that stayed
cached are byte-exact.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import kvpool
from faults_helpers import settle
from test_tiers import fill
from tierlib import BLOCK, BS, LAYOUT, check_sequence, prompt

WORKER = str(Path(__file__).with_name("halfdone_worker.py"))
LEASE = 1.5


def _daemon(daemon_factory, tmp_path, failpoints: str):
    return daemon_factory("--pool-bytes", str(64 * BLOCK), "--chunk-bytes", "64KiB", "--host-bytes", "0",
                          "--disk-bytes", str(1024 * BLOCK), "--disk-dir", str(tmp_path / "disk"),
                          "--lease-seconds", str(LEASE), env={"KVPOOLD_FAILPOINTS": failpoints})


def _worker(d, mode: str):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")]))
    p = subprocess.Popen([sys.executable, WORKER, d.socket, mode], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, env=env)
    line = p.stdout.readline().strip()
    if line != "calling":
        p.kill()
        raise AssertionError(f"the worker did not get to its call: {line!r} {p.communicate()[1]}")
    return p


@pytest.mark.parametrize("how", ["kill", "freeze"])
@pytest.mark.parametrize("mode", ["create", "swap_in", "swap_out"])
def test_session_dies_mid_operation(daemon_factory, tmp_path, mode, how):
    slow = "disk.write=sleep=4" if mode == "swap_out" else "disk.read=sleep=4"  # longer than the lease
    d = _daemon(daemon_factory, tmp_path, slow)
    if mode == "create":
        with kvpool.connect(d.socket, name="filler", layout=LAYOUT) as c:
            fill(c, 0, 8)  # 128 blocks: prompt 0 is on disk now
            assert c.lookup(prompt(0, 16)) == 16 * BS
    p = _worker(d, mode)
    try:
        time.sleep(0.5)  # the call is in flight: its disk I/O takes 4 s
        os.kill(p.pid, signal.SIGKILL if how == "kill" else signal.SIGSTOP)
        with kvpool.Connection(d.socket) as conn:
            st = settle(conn, timeout=LEASE + 30)
            assert st.clients == 0 and st.sequences == 0, st
            c = st.classes[0]
            assert c.used_blocks == 0 and c.reserved_blocks == 0 and c.swapped_sequences == 0
            assert c.cached_blocks + c.free_blocks == c.total_blocks
            assert all(t.pinned_bytes == 0 for t in st.tiers), st.tiers
            ok, detail = conn.check()
            assert ok, detail
        if how == "freeze":
            assert "no call or heartbeat" in d.output()
            os.kill(p.pid, signal.SIGCONT)
            line = p.stdout.readline().strip()
            p.kill()
            err = p.communicate()[1]
            if mode != "swap_out":  # (swap_out replies after the device reads, before the freeze)
                assert not line.startswith("done"), f"a reply after the session was dropped: {line}"
                assert "SessionExpired" in err and "ended: no call or heartbeat" in err, err
    finally:
        if p.poll() is None:
            os.kill(p.pid, signal.SIGCONT)
            p.kill()
        p.wait()
    assert d.proc.poll() is None and "Traceback" not in d.output() and "internal error" not in d.output()
    with kvpool.connect(d.socket, name="after", layout=LAYOUT) as c:  # the daemon serves, cached bytes are right
        toks = prompt(0, 16)
        s = c.create_sequence(toks)
        check_sequence(c, s, toks, s.num_cached_tokens // BS)
        ok, detail = c._conn.check()
        assert ok, detail
