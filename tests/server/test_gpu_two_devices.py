"""One kvpoold serving two GPUs (``--backend cuda --devices 0,1``): a pool per GPU, clients on each,
on the elastic pool (CUDA VMM) and on the legacy IPC allocation; on VMM, models of two
geometries on each GPU, chunks moving between classes on each GPU alone, a resize of one GPU.

Run on a machine with two NVIDIA GPUs:  bash scripts/gpu_tests.sh tests/server
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

import kvpool
from procs import (
    BIG,
    SMALL,
    Proc,
    assert_no_gpu_process,
    check_second_process_reads_first_process_blocks,
    run_client,
    run_client_failing,
    wait_for,
)

torch = pytest.importorskip("torch")
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.device_count() < 2,
                       reason="needs two CUDA GPUs (one daemon serving --devices 0,1)"),
]

MiB, GiB = 1 << 20, 1 << 30


def bus_ids() -> list[str]:
    """PCI bus ids of this process's GPUs 0 and 1, as the daemon names them."""
    from kvpool.ipc.cuda import bus_id

    return [bus_id(0), bus_id(1)]


@pytest.fixture(params=["vmm", "ipc"])
def two_gpus(daemon_factory, request):
    return daemon_factory("--backend", "cuda", "--devices", "0,1", "--cuda-memory", request.param,
                          "--pool-bytes", "1GiB", "--chunk-bytes", "2MiB")


def test_each_gpu_has_its_own_pool_shared_by_the_processes_on_it(two_gpus):
    buses = bus_ids()
    for dev in (0, 1):
        prompt = [10 * dev + t for t in range(100, 114)]
        check_second_process_reads_first_process_blocks(two_gpus.socket, prompt=prompt, device=dev)
        peek = run_client(two_gpus.socket, "peek", blocks=[0], device=dev)
        assert peek["device"] == f"cuda:{dev}" and peek["bus_id"] == buses[dev]  # the pool is on that GPU
    with kvpool.Connection(two_gpus.socket) as conn:
        st = conn.stats()
    assert [(d.device, d.bus_id) for d in st.devices] == [(0, buses[0]), (1, buses[1])]
    assert all(d.pool_bytes == GiB and d.classes[0].cached_blocks == 3 for d in st.devices)
    assert st.pool_bytes == 2 * GiB


def test_a_prefix_cached_on_one_gpu_is_no_hit_on_the_other(two_gpus):
    prompt = list(range(200, 214))
    run_client(two_gpus.socket, "write", prompt=prompt, free=True, device=0)
    assert run_client(two_gpus.socket, "read", prompt=prompt, device=1)["cached"] == 0
    assert run_client(two_gpus.socket, "read", prompt=prompt, device=0)["cached"] == 12


def test_cuda_visible_devices_picks_the_pool_by_bus_id(two_gpus):
    """A process that sees only GPU 1 (as its cuda:0) and uses it through torch gets GPU 1's pool."""
    buses = bus_ids()
    env = {"CUDA_VISIBLE_DEVICES": "1"}
    b = check_second_process_reads_first_process_blocks(two_gpus.socket, prompt=list(range(300, 314)),
                                                        env=env, init_cuda=True)
    peek = run_client(two_gpus.socket, "peek", blocks=b["table"][:1], env=env, init_cuda=True)
    assert peek["device"] == "cuda:0" and peek["bus_id"] == buses[1]
    assert peek["values"][0] == [300.0, 301.0, 302.0, 303.0]
    with kvpool.Connection(two_gpus.socket) as conn:
        st = conn.stats()
    assert st.devices[1].classes[0].cached_blocks == 3 and not st.devices[0].classes


def test_a_client_naming_no_gpu_is_refused_with_the_devices_served(two_gpus):
    err = run_client_failing(two_gpus.socket, "peek", blocks=[0], env={"CUDA_VISIBLE_DEVICES": ""})
    assert "FailedPrecondition" in err and "serves several GPUs" in err and "cuda:1" in err


def test_a_client_on_a_gpu_the_daemon_does_not_serve(daemon_factory):
    d = daemon_factory("--backend", "cuda", "--devices", "0", "--pool-bytes", "256MiB", "--chunk-bytes", "2MiB")
    layout = kvpool.Layout("other-gpu", num_layers=1, num_kv_heads=1, head_dim=8, dtype="float16")
    with pytest.raises(kvpool.FailedPrecondition, match=f"{bus_ids()[1]}.*it serves cuda:0 \\({bus_ids()[0]}\\)"):
        kvpool.connect(d.socket, name="gpu1", layout=layout, device=1)
    with kvpool.Connection(d.socket) as conn:
        assert conn.stats().clients == 0


def test_ctl_stats_and_check_show_both_pools(two_gpus):
    run_client(two_gpus.socket, "write", prompt=list(range(9)), free=True, device=1)
    out = subprocess.run([sys.executable, "-m", "kvpoold.ctl", "--socket", two_gpus.socket, "stats"],
                         capture_output=True, text=True, timeout=60, env={**os.environ, "COLUMNS": "250"})
    assert out.returncode == 0, out.stderr
    for word in ("pools (one per GPU)", "cuda:0", "cuda:1 · class 0", *bus_ids()):
        assert word in out.stdout
    ok = subprocess.run([sys.executable, "-m", "kvpoold.ctl", "--socket", two_gpus.socket, "check"],
                        capture_output=True, text=True, timeout=60)
    assert ok.returncode == 0 and "in 2 pools" in ok.stdout


def test_daemon_exit_frees_the_memory_of_both_gpus(daemon_factory):
    torch.cuda.init()
    before = [torch.cuda.mem_get_info(i)[0] for i in (0, 1)]
    d = daemon_factory("--backend", "cuda", "--devices", "0,1", "--cuda-memory", "ipc", "--pool-bytes", "4GiB",
                       "--chunk-bytes", "2MiB")
    for dev in (0, 1):
        run_client(d.socket, "write", prompt=[1, 2, 3], device=dev)  # the first attach allocates the arena
    during = [torch.cuda.mem_get_info(i)[0] for i in (0, 1)]
    assert all(b - x >= 4 * GiB for b, x in zip(before, during))
    assert d.stop() == 0
    assert wait_for(lambda: all(torch.cuda.mem_get_info(i)[0] >= before[i] - (256 << 20) for i in (0, 1)),
                    timeout=20)


def test_a_pool_that_does_not_fit_on_one_gpu_stops_the_start(daemon_factory):
    d = daemon_factory("--backend", "cuda", "--devices", "0,1", "--pool-bytes", "100000GiB", start=False)
    out = subprocess.run([sys.executable, "-m", "kvpoold", *d.args], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "does not fit on GPU 0" in out.stderr
    d2 = daemon_factory("--backend", "cuda", "--devices", "0,7", start=False)
    out = subprocess.run([sys.executable, "-m", "kvpoold", *d2.args], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "GPU 7" in out.stderr and "does not exist" in out.stderr


# -- the elastic pool (CUDA VMM) on each GPU -------------------------------------------------


@pytest.fixture
def vmm_two_gpus(daemon_factory):
    def start(pool: str = "64MiB", *extra: str):
        return daemon_factory("--backend", "cuda", "--devices", "0,1", "--cuda-memory", "vmm", "--chunk-bytes", "2MiB",
                              "--pool-bytes", pool, "--release-after-seconds", "3600", *extra)

    return start


def pools(socket: str):
    with kvpool.Connection(socket) as conn:
        return conn.stats().devices


def mapped(dev, block_bytes: int) -> int:
    return {c.block_bytes: c.mapped_bytes for c in dev.classes}.get(block_bytes, 0)


def test_two_geometries_on_each_gpu_keep_their_bytes(vmm_two_gpus):
    d = vmm_two_gpus("256MiB")
    procs = [Proc(d.socket, layout, seed=10 * dev + i, device=dev)
             for dev in (0, 1) for i, layout in enumerate((BIG, SMALL))]
    try:
        for p in procs:
            assert p("fill", n=10, tokens=256)["held"] == 10
        for p in procs:
            assert p("verify")["bad"] == []
        devs = pools(d.socket)
        assert [x.device for x in devs] == [0, 1]
        for x in devs:
            assert x.memory == "vmm" and len(x.classes) == 2
            assert mapped(x, 128 * 1024) >= 20 * MiB and mapped(x, 64 * 1024) >= 10 * MiB
        with kvpool.Connection(d.socket) as conn:
            ok, detail = conn.check()
        assert ok, detail
    finally:
        for p in procs:
            p.quit()


def test_chunks_move_between_classes_on_one_gpu_and_the_other_keeps_its_own(vmm_two_gpus):
    d = vmm_two_gpus("64MiB")
    big0, small0 = Proc(d.socket, BIG, seed=1, device=0), Proc(d.socket, SMALL, seed=2, device=0)
    big1, small1 = Proc(d.socket, BIG, seed=3, device=1), Proc(d.socket, SMALL, seed=4, device=1)
    try:
        assert big0("fill", n=25, tokens=256)["held"] == 25  # 50 of GPU 0's 64 MiB
        assert big1("fill", n=25, tokens=256)["held"] == 25  # and of GPU 1's
        held1 = mapped(pools(d.socket)[1], 128 * 1024)
        assert "OutOfBlocks" in small0("fill", n=10, tokens=512).get("error", "")  # 20 MiB: more than is left
        assert big0("free", count=15)["held"] == 10  # their blocks stay cached, on GPU 0 only
        assert small0("fill", n=10, tokens=512)["held"] == 10  # GPU 0's small class takes them
        # GPU 0's freed chunks are not GPU 1's: its small class still finds no room.
        assert "OutOfBlocks" in small1("fill", n=10, tokens=512).get("error", "")
        dev0, dev1 = pools(d.socket)
        assert mapped(dev0, 64 * 1024) >= 20 * MiB and mapped(dev0, 128 * 1024) < held1
        assert mapped(dev1, 128 * 1024) == held1 and mapped(dev1, 64 * 1024) < 20 * MiB
        for x in (dev0, dev1):
            assert sum(c.mapped_bytes for c in x.classes) <= 64 * MiB
        for p in (big0, small0, big1):
            assert p("verify")["bad"] == []
    finally:
        for p in (big0, small0, big1, small1):
            p.quit()


def test_a_resize_of_one_gpu_leaves_the_other_untouched(vmm_two_gpus):
    d = vmm_two_gpus("256MiB")
    a0, a1 = Proc(d.socket, BIG, seed=5, device=0), Proc(d.socket, BIG, seed=6, device=1)
    try:
        a0("fill", n=20, tokens=256)  # 40 MiB held on each GPU
        a1("fill", n=20, tokens=256)
        a1("free", count=20)  # GPU 1's blocks only cached: a shrink may evict them
        before0 = pools(d.socket)[0]
        with kvpool.Connection(os.path.join(d.dir, "kvpoold-admin.sock")) as conn:
            (r,) = conn.resize(32 * MiB, device=1)
        assert r["device"] == 1 and r["met"] and r["pool_bytes"] == 32 * MiB
        dev0, dev1 = pools(d.socket)
        assert dev1.pool_bytes == 32 * MiB
        assert wait_for(lambda: pools(d.socket)[1].physical_bytes <= 32 * MiB, timeout=20)
        assert dev0.pool_bytes == before0.pool_bytes == 256 * MiB
        assert mapped(dev0, 128 * 1024) == mapped(before0, 128 * 1024)
        assert a0("verify")["bad"] == []
        assert "OutOfBlocks" in a1("fill", n=20, tokens=256).get("error", "")  # 40 MiB: past GPU 1's ceiling
        assert a0("fill", n=20, tokens=256)["held"] == 40 and a0("verify")["bad"] == []  # GPU 0 still has 256
    finally:
        a0.quit()
        a1.quit()


def test_daemon_exit_leaves_no_device_memory_on_either_gpu(vmm_two_gpus):
    torch.cuda.init()
    before = [torch.cuda.mem_get_info(i)[0] for i in (0, 1)]
    d = vmm_two_gpus("4GiB")
    procs = [Proc(d.socket, layout, seed=20 + 2 * dev + i, device=dev)
             for dev in (0, 1) for i, layout in enumerate((BIG, SMALL))]
    for p in procs:
        p("fill", n=100, tokens=256)
    during = [torch.cuda.mem_get_info(i)[0] for i in (0, 1)]
    assert all(b - x >= 200 * MiB for b, x in zip(before, during))  # chunks created on both GPUs
    for p in procs:
        p.quit()
    pid = d.proc.pid
    assert d.stop() == 0
    assert wait_for(lambda: all(torch.cuda.mem_get_info(i)[0] >= before[i] - 64 * MiB for i in (0, 1)), timeout=30)
    assert_no_gpu_process(pid)
