"""The daemon on the GPU: the pool in device memory, shared with client processes over CUDA IPC.

Run on a machine with an NVIDIA GPU:  python3 -m pytest -m gpu -q
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import pytest

import kvpool
from procs import SCRIPT, run_client, wait_for

torch = pytest.importorskip("torch")
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

POOL = 1 << 30


@pytest.fixture
def gpu_daemon(daemon_factory):
    return daemon_factory("--backend", "cuda", "--pool-bytes", "1GiB", "--chunk-bytes", "2MiB")


def test_writes_of_one_process_are_read_by_another(gpu_daemon):
    prompt = list(range(100, 114))
    a = run_client(gpu_daemon.socket, "write", prompt=prompt, free=True)
    b = run_client(gpu_daemon.socket, "read", prompt=prompt[:12] + [7])
    assert b["cached"] == 12 and b["table"][:3] == a["table"][:3]
    assert b["values"] == [float(t) for t in prompt[:12]]
    assert run_client(gpu_daemon.socket, "peek", blocks=[0])["device"].startswith("cuda")


def test_copy_on_write_runs_on_the_gpu(gpu_daemon):
    f = run_client(gpu_daemon.socket, "fork", prompt=[5, 6, 7, 8, 9, 10], next=99)
    (src, dst), = f["copies"]
    peek = run_client(gpu_daemon.socket, "peek", blocks=[src, dst])
    assert peek["values"][0][:2] == [9.0, 10.0]
    assert peek["values"][1][:3] == [9.0, 10.0, 99.0]


def test_killed_client_gives_its_blocks_back(gpu_daemon):
    proc = subprocess.Popen([sys.executable, SCRIPT, gpu_daemon.socket, "hold", json.dumps({"n": 4})],
                            stdout=subprocess.PIPE, text=True)
    try:
        assert json.loads(proc.stdout.readline())["holding"] == 4
        with kvpool.Connection(gpu_daemon.socket) as conn:
            assert conn.stats().classes[0].used_blocks == 12
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            assert wait_for(lambda: conn.stats().sequences == 0)
            assert conn.check()[0]
    finally:
        proc.kill()


def test_daemon_exit_frees_its_device_memory(daemon_factory):
    torch.cuda.init()
    free_before, _ = torch.cuda.mem_get_info()
    d = daemon_factory("--backend", "cuda", "--pool-bytes", "4GiB", "--chunk-bytes", "2MiB")
    run_client(d.socket, "write", prompt=[1, 2, 3])  # the first attach allocates the arena
    free_during, _ = torch.cuda.mem_get_info()
    assert free_before - free_during >= 4 << 30
    assert d.stop() == 0
    assert wait_for(lambda: torch.cuda.mem_get_info()[0] >= free_before - (256 << 20), timeout=20)


def test_pool_that_does_not_fit_is_refused_at_start(daemon_factory):
    d = daemon_factory("--backend", "cuda", "--pool-bytes", "100000GiB", start=False)
    out = subprocess.run([sys.executable, "-m", "kvpoold", *d.args], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "does not fit on GPU" in out.stderr


def test_second_layout_on_the_cuda_backend_is_a_clear_error(gpu_daemon):
    a = kvpool.Layout("a", num_layers=1, num_kv_heads=1, head_dim=8, dtype="float16")
    b = kvpool.Layout("b", num_layers=2, num_kv_heads=1, head_dim=8, dtype="float16")
    with kvpool.connect(gpu_daemon.socket, name="a", layout=a):
        with pytest.raises(kvpool.InvalidArgument, match="serves one layout class"):
            kvpool.connect(gpu_daemon.socket, name="b", layout=b)
