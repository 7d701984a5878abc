"""Running the test clients (client_proc.py, vmm_proc.py) as separate processes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

SCRIPT = str(Path(__file__).with_name("client_proc.py"))
VMM_SCRIPT = str(Path(__file__).with_name("vmm_proc.py"))
# Layouts of two geometries for vmm_proc.py (16-token blocks).
BIG = dict(model_id="big", num_layers=4, num_kv_heads=4, head_dim=128, dtype="float16")  # 128 KiB blocks
SMALL = dict(model_id="small", num_layers=2, num_kv_heads=8, head_dim=64, dtype="bfloat16")  # 64 KiB blocks


def run_client(socket: str, action: str, env: dict | None = None, **args) -> dict:
    out = subprocess.run(
        [sys.executable, SCRIPT, socket, action, json.dumps(args)],
        capture_output=True, text=True, timeout=180, env=None if env is None else {**os.environ, **env},
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def run_client_failing(socket: str, action: str, env: dict | None = None, **args) -> str:
    """Run a client that must fail; returns its stderr."""
    out = subprocess.run(
        [sys.executable, SCRIPT, socket, action, json.dumps(args)],
        capture_output=True, text=True, timeout=180, env=None if env is None else {**os.environ, **env},
    )
    assert out.returncode != 0, out.stdout
    return out.stderr


def wait_for(predicate, timeout: float = 15.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.1)
    return False


# -- scenarios shared by the CPU and the GPU daemon tests -------------------------------


def check_second_process_reads_first_process_blocks(socket: str, prompt=None, **client) -> dict:
    """``client``: where both processes run (``device=``, ``env=``...); returns B's answer."""
    prompt = prompt or list(range(100, 114))  # 3 full blocks of 4 and 2 tokens more
    a = run_client(socket, "write", prompt=prompt, free=True, **client)
    b = run_client(socket, "read", prompt=prompt[:12] + [7, 7, 7], **client)
    assert b["cached"] == 12
    assert b["table"][:3] == a["table"][:3]  # the same physical blocks
    assert b["values"] == [float(t) for t in prompt[:12]]  # A's bytes, read by B
    return b


def check_fork_copy_on_write_seen_from_another_process(socket: str) -> None:
    f = run_client(socket, "fork", prompt=[5, 6, 7, 8, 9, 10], next=99)  # one full block, one half
    (src, dst), = f["copies"]
    assert f["parent"][1] == src and f["child"][1] == dst and f["child"][0] == f["parent"][0]
    peek = run_client(socket, "peek", blocks=[src, dst])
    assert peek["values"][0][:2] == [9.0, 10.0]  # the parent's half block
    assert peek["values"][1][:3] == [9.0, 10.0, 99.0]  # the copy, then the child's own token


def check_killed_client_is_reaped(socket: str, grace_seconds: float, n: int = 5) -> None:
    """A SIGKILLed client's sequences go within the grace period; full blocks stay cached."""
    import signal

    import kvpool

    proc = subprocess.Popen([sys.executable, SCRIPT, socket, "hold", json.dumps({"n": n})],
                            stdout=subprocess.PIPE, text=True)
    try:
        assert json.loads(proc.stdout.readline())["holding"] == n
        with kvpool.Connection(socket) as conn:
            cls = conn.stats().classes[0]
            assert cls.used_blocks - cls.reserved_blocks == 3 * n  # 10 tokens in blocks of 4
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            killed_at = time.monotonic()
            assert wait_for(lambda: conn.stats().sequences == 0)
            assert time.monotonic() - killed_at < grace_seconds + 5.0
            st = conn.stats()
            assert st.clients == 0 and st.classes[0].used_blocks == 0
            assert st.classes[0].cached_blocks == 2 * n  # full blocks stay in the prefix cache
            assert conn.check()[0]
    finally:
        proc.kill()


class Proc:
    """A vmm_proc.py model process, driven one JSON command at a time."""

    def __init__(self, socket: str, layout: dict, seed: int, device: int = 0) -> None:
        self.p = subprocess.Popen([sys.executable, VMM_SCRIPT, socket,
                                   json.dumps({"layout": layout, "seed": seed, "device": device})],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.first = self._read()

    def _read(self) -> dict:
        line = self.p.stdout.readline()
        if not line:
            raise AssertionError(f"the process died: {self.p.stderr.read()[-3000:]}")
        return json.loads(line)

    def __call__(self, op: str, **kw) -> dict:
        self.p.stdin.write(json.dumps({"op": op, **kw}) + "\n")
        self.p.stdin.flush()
        return self._read()

    def quit(self) -> None:
        if self.p.poll() is None:
            self.p.stdin.close()  # end of input: the process detaches and exits
            self.p.wait(timeout=60)


def assert_no_gpu_process(pid: int) -> None:
    """``nvidia-smi`` (where it runs) lists no compute process ``pid`` on any GPU."""
    smi = subprocess.run(["nvidia-smi", "--query-compute-apps=pid", "--format=csv,noheader"],
                         capture_output=True, text=True)
    if smi.returncode == 0:
        assert str(pid) not in smi.stdout.split()
