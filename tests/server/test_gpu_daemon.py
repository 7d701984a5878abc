"""The daemon on the GPU: the pool in device memory, shared with client processes over CUDA IPC.

Run on a machine with an NVIDIA GPU:  python3 -m pytest -m gpu -q
"""

from __future__ import annotations

import subprocess
import sys

import pytest

import kvpool
from procs import (
    check_fork_copy_on_write_seen_from_another_process,
    check_killed_client_is_reaped,
    check_second_process_reads_first_process_blocks,
    run_client,
    wait_for,
)

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
    check_second_process_reads_first_process_blocks(gpu_daemon.socket)
    assert run_client(gpu_daemon.socket, "peek", blocks=[0])["device"].startswith("cuda")


def test_copy_on_write_runs_on_the_gpu(gpu_daemon):
    check_fork_copy_on_write_seen_from_another_process(gpu_daemon.socket)


def test_killed_client_gives_its_blocks_back(gpu_daemon):
    check_killed_client_is_reaped(gpu_daemon.socket, grace_seconds=1.0, n=4)


def test_daemon_exit_frees_its_device_memory(daemon_factory):
    """Legacy IPC takes the pool whole at the first attach (VMM: test_gpu_vmm.py)."""
    torch.cuda.init()
    free_before, _ = torch.cuda.mem_get_info()
    d = daemon_factory("--backend", "cuda", "--cuda-memory", "ipc", "--pool-bytes", "4GiB", "--chunk-bytes", "2MiB")
    run_client(d.socket, "write", prompt=list(range(1, 9)))  # the first attach allocates the arena; 2 blocks stay cached
    free_during, _ = torch.cuda.mem_get_info()
    assert free_before - free_during >= 4 << 30
    assert d.stop() == 0
    assert wait_for(lambda: torch.cuda.mem_get_info()[0] >= free_before - (256 << 20), timeout=20)


def test_pool_that_does_not_fit_is_refused_at_start(daemon_factory):
    d = daemon_factory("--backend", "cuda", "--chunk-bytes", "2MiB", "--pool-bytes", "100000GiB", start=False)
    out = subprocess.run([sys.executable, "-m", "kvpoold", *d.args], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "is more than GPU 0 has" in out.stderr  # VMM: a ceiling past the GPU
    d = daemon_factory("--backend", "cuda", "--cuda-memory", "ipc", "--pool-bytes", "100000GiB", start=False)
    out = subprocess.run([sys.executable, "-m", "kvpoold", *d.args], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "does not fit on GPU" in out.stderr  # legacy IPC: free memory at start



@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_torch_and_cupy_views_share_the_pool(daemon_factory, dtype):
    pytest.importorskip("cupy")
    d = daemon_factory("--backend", "cuda", "--pool-bytes", "256MiB", "--chunk-bytes", "2MiB")
    layout = kvpool.Layout("views", num_layers=1, num_kv_heads=1, head_dim=8, dtype=dtype)
    with kvpool.connect(d.socket, name="views", layout=layout) as c:
        kv, cp = c.kv_cache(), c.kv_cache_cupy()
        assert tuple(cp.shape) == tuple(kv.shape) and kv.device.type == "cuda"
        assert cp.data.ptr == kv.data_ptr()
        b = int(c.create_sequence(list(range(40))).block_table[2])  # only blocks it holds are mapped (vmm)
        kv[b, 0, 1, 0, 3, 2] = 1.5
        torch.cuda.synchronize()
        if dtype == "bfloat16":  # CuPy sees the raw bits
            expect = torch.tensor(1.5, dtype=torch.bfloat16).view(torch.int16).item() & 0xFFFF
            assert int(cp[b, 0, 1, 0, 3, 2].get()) == expect
        else:
            assert float(cp[b, 0, 1, 0, 3, 2].get()) == 1.5


def test_the_pool_is_found_by_the_bus_id_of_the_clients_gpu(gpu_daemon):
    """device=0, or torch's current device once CUDA is in use: the session is bound to GPU 0's pool."""
    from kvpool.ipc.cuda import bus_id

    b = check_second_process_reads_first_process_blocks(gpu_daemon.socket, device=0)
    peek = run_client(gpu_daemon.socket, "peek", blocks=b["table"][:1], init_cuda=True)
    assert peek["device"] == "cuda:0" and peek["bus_id"] == bus_id(0)
    with kvpool.Connection(gpu_daemon.socket) as conn:
        (dev,) = conn.stats().devices
    assert (dev.device, dev.bus_id, dev.classes[0].cached_blocks) == (0, bus_id(0), 3)
