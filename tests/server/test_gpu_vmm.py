"""The elastic GPU pool (CUDA VMM): several models of several geometries on one daemon's GPU memory.

Run on a machine with an NVIDIA GPU:  bash scripts/gpu_tests.sh tests/server/test_gpu_vmm.py
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import kvpool
from procs import BIG, SMALL, VMM_SCRIPT, Proc, assert_no_gpu_process, wait_for

torch = pytest.importorskip("torch")
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

HERE = Path(__file__).resolve().parent
MiB = 1 << 20


def device_stats(socket: str):
    with kvpool.Connection(socket) as conn:
        (dev,) = conn.stats().devices
    return dev


def admin(d):
    return kvpool.Connection(os.path.join(d.dir, "kvpoold-admin.sock"))


@pytest.fixture
def vmm_daemon(daemon_factory):
    def start(pool: str = "64MiB", *extra: str):
        return daemon_factory("--backend", "cuda", "--cuda-memory", "vmm", "--chunk-bytes", "2MiB", "--pool-bytes", pool,
                              *extra)

    return start


def test_three_geometries_generate_through_kvpool_hf_on_one_pool(vmm_daemon):
    d = vmm_daemon("2GiB")
    specs = [dict(kv_heads=8, head_dim=128, dtype="bfloat16"), dict(kv_heads=2, head_dim=64, dtype="float16"),
             dict(kv_heads=1, head_dim=256, dtype="float32")]
    procs = [subprocess.Popen([sys.executable, str(HERE / "vmm_model_proc.py"), d.socket,
                               json.dumps({**s, "seed": i, "rounds": 2})],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i, s in enumerate(specs)]
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=400)
        assert p.returncode == 0, err[-4000:]
        outs.append(json.loads(out.strip().splitlines()[-1]))
    for o in outs:
        print(o)
        assert o["ok"], o
    dev = device_stats(d.socket)
    assert dev.memory == "vmm" and len(dev.classes) == 3
    assert all(c.reserved_bytes >= 2 << 30 for c in dev.classes)  # each class can grow to the whole pool


def test_a_class_that_frees_gives_its_chunks_to_another_while_both_run(vmm_daemon):
    d = vmm_daemon("64MiB", "--release-after-seconds", "3600")
    big, small = Proc(d.socket, BIG, seed=1), Proc(d.socket, SMALL, seed=2)
    try:
        assert big("fill", n=25, tokens=256)["held"] == 25  # 50 of the pool's 64 MiB
        big_mapped = {c.block_bytes: c.mapped_bytes for c in device_stats(d.socket).classes}[128 * 1024]
        assert big_mapped >= 50 * MiB
        r = small("fill", n=10, tokens=512)  # 20 MiB: more than is left
        assert "OutOfBlocks" in r.get("error", ""), r
        assert big("free", count=15)["held"] == 10  # their blocks stay cached
        assert small("fill", n=10, tokens=512)["held"] == 10  # takes the freed (cached) chunks
        assert big("verify")["bad"] == [] and small("verify")["bad"] == []
        assert big("fill", n=1, tokens=16)["held"] == 11  # both keep running
        assert big("verify")["bad"] == [] and small("verify")["bad"] == []
        st = device_stats(d.socket)
        assert st.physical_bytes <= 64 * MiB + st.draining_bytes
        assert sum(c.mapped_bytes for c in st.classes) <= 64 * MiB
        mapped = {c.block_bytes: c.mapped_bytes for c in st.classes}
        assert mapped[128 * 1024] < big_mapped and mapped[64 * 1024] >= 20 * MiB  # the chunks moved
    finally:
        big.quit()
        small.quit()


def test_chunks_leave_a_process_only_between_two_of_its_client_calls(vmm_daemon):
    """The watch thread's sync waits for the call in progress: an answer from before a reply applied could
    unmap a chunk that left the class and came back under kernels about to use its blocks."""
    d = vmm_daemon("64MiB", "--release-after-seconds", "3600")
    small = Proc(d.socket, SMALL, seed=2)
    try:
        with kvpool.connect(d.socket, name="mine", layout=kvpool.Layout(**BIG), device=0) as mine:
            mine.kv_cache()
            seqs = mine.create_sequences([[n * 1000 + t for t in range(256)] for n in range(25)])  # 50 MiB
            mine.mark_written(seqs)
            mine.free(seqs)  # cached: the next class may take their chunks
            arena = mine._mapping.arena
            before = arena.mapped()
            with mine._lock:  # a call in progress
                assert small("fill", n=10, tokens=512)["held"] == 10  # evicts mine's cached blocks
                assert wait_for(lambda: device_stats(d.socket).draining_bytes > 0, timeout=30)
                assert not wait_for(lambda: arena.mapped() != before, timeout=2.0)
            assert wait_for(lambda: device_stats(d.socket).draining_bytes == 0, timeout=30)
            after = arena.mapped()
            assert len(after) < len(before) and all(before.get(i) == c for i, c in after.items())
            again = mine.create_sequence(list(range(64)))  # the class grows again: its chunks are mapped first
            kv = mine.kv_cache()
            kv[again.block_table.tolist()] = 3
            torch.cuda.synchronize()
            assert bool((kv[again.block_table.tolist()] == 3).all())
        assert small("verify")["bad"] == []
    finally:
        small.quit()


def test_client_killed_while_mapping_leaves_the_daemon_whole(vmm_daemon):
    d = vmm_daemon("1GiB", "--grace-seconds", "0.5")
    filler = Proc(d.socket, BIG, seed=3)
    try:
        filler("fill", n=300, tokens=256)  # 4800 blocks: 300 chunks for a newcomer to map
        for delay in (0.0, 0.02, 0.05):
            p = subprocess.Popen([sys.executable, VMM_SCRIPT, d.socket,
                                  json.dumps({"layout": BIG, "seed": 9})],
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            wait_for(lambda: len(kvpool.Connection(d.socket).clients()) >= 2, timeout=60)
            time.sleep(delay)
            p.send_signal(signal.SIGKILL)
            p.wait(timeout=30)
        assert wait_for(lambda: len(kvpool.Connection(d.socket).clients()) == 1, timeout=30)
        assert wait_for(lambda: device_stats(d.socket).draining_bytes == 0, timeout=30)
        assert filler("verify")["bad"] == []
        with kvpool.Connection(d.socket) as conn:
            ok, detail = conn.check()
        assert ok, detail
        late = Proc(d.socket, BIG, seed=4)  # the daemon still hands chunks out
        assert late("fill", n=2, tokens=64)["held"] == 2 and late("verify")["bad"] == []
        late.quit()
    finally:
        filler.quit()


def test_resize_down_and_up_under_load(vmm_daemon):
    d = vmm_daemon("256MiB", "--release-after-seconds", "3600")
    a, b = Proc(d.socket, BIG, seed=5), Proc(d.socket, SMALL, seed=6)
    try:
        a("fill", n=40, tokens=256)  # 80 MiB held
        b("fill", n=20, tokens=256)  # 20 MiB held
        with admin(d) as conn:
            (r,) = conn.resize(64 * MiB)
        assert not r["met"] and r["pool_bytes"] >= 100 * MiB  # held blocks stop the shrink
        st = device_stats(d.socket)
        assert st.pool_bytes == r["pool_bytes"] and st.physical_bytes <= r["pool_bytes"] + st.draining_bytes
        assert a("verify")["bad"] == [] and b("verify")["bad"] == []
        a("free", count=40)
        b("free", count=20)
        with admin(d) as conn:
            (r,) = conn.resize(64 * MiB)  # cached blocks are evicted: now it fits
        assert r["met"] and r["pool_bytes"] == 64 * MiB
        assert wait_for(lambda: device_stats(d.socket).physical_bytes <= 64 * MiB, timeout=20)
        assert "OutOfBlocks" in a("fill", n=80, tokens=256).get("error", "")  # 160 MiB: the ceiling holds
        with admin(d) as conn:
            (r,) = conn.resize(256 * MiB)
        assert r["met"]
        assert a("fill", n=40, tokens=256)["held"] >= 40 and a("verify")["bad"] == []
        assert b("fill", n=4, tokens=256)["held"] == 4 and b("verify")["bad"] == []
        with admin(d) as conn, pytest.raises(kvpool.InvalidArgument, match="pool_bytes must be between"):
            conn.resize(1 << 50)
    finally:
        a.quit()
        b.quit()


def test_empty_slabs_go_back_to_the_gpu_after_release_after_seconds(vmm_daemon):
    d = vmm_daemon("256MiB", "--release-after-seconds", "1")
    p = Proc(d.socket, BIG, seed=7)
    p("fill", n=20, tokens=256)
    assert device_stats(d.socket).physical_bytes >= 40 * MiB
    p.quit()
    with admin(d) as conn:
        conn.evict()
    assert wait_for(lambda: device_stats(d.socket).physical_bytes == 0, timeout=20)
    st = device_stats(d.socket)
    assert st.freed_bytes >= 40 * MiB and all(c.mapped_bytes == 0 for c in st.classes)


def test_daemon_exit_leaves_no_device_memory(vmm_daemon):
    torch.cuda.init()
    free_before, _ = torch.cuda.mem_get_info()
    d = vmm_daemon("4GiB")
    procs = [Proc(d.socket, BIG, seed=10), Proc(d.socket, SMALL, seed=11)]
    procs[0]("fill", n=200, tokens=256)
    procs[1]("fill", n=100, tokens=256)
    free_during, _ = torch.cuda.mem_get_info()
    assert free_before - free_during >= 400 * MiB  # the chunks were created as needed
    for p in procs:
        p.quit()
    pid = d.proc.pid
    assert d.stop() == 0
    assert wait_for(lambda: torch.cuda.mem_get_info()[0] >= free_before - 64 * MiB, timeout=30)
    assert_no_gpu_process(pid)


def test_legacy_ipc_still_serves_one_class(daemon_factory):
    d = daemon_factory("--backend", "cuda", "--cuda-memory", "ipc", "--chunk-bytes", "2MiB", "--pool-bytes", "256MiB")
    a = kvpool.Layout("a", num_layers=1, num_kv_heads=1, head_dim=8, dtype="float16")
    b = kvpool.Layout("b", num_layers=2, num_kv_heads=1, head_dim=8, dtype="float16")
    with kvpool.connect(d.socket, name="a", layout=a):
        with pytest.raises(kvpool.InvalidArgument, match="serves one layout class"):
            kvpool.connect(d.socket, name="b", layout=b)
    assert device_stats(d.socket).memory == "ipc"


def test_many_geometries_attach_one_after_another(vmm_daemon):
    """The refusal the legacy pool gave ('serves one layout class per device') is gone."""
    d = vmm_daemon("256MiB")
    shapes = [("qwen3", 2, 2, 128, "float32"), ("mistral", 2, 8, 128, "bfloat16"),
              ("gemma", 2, 4, 256, "bfloat16"), ("llama", 2, 8, 64, "float16")]
    for name, layers, heads, dim, dtype in shapes:
        lay = kvpool.Layout(name, num_layers=layers, num_kv_heads=heads, head_dim=dim, dtype=dtype)
        with kvpool.connect(d.socket, name=name, layout=lay, device=0) as c:
            seq = c.create_sequence(list(range(40)))
            kv = c.kv_cache()
            kv[seq.block_table.tolist()] = 1
            torch.cuda.synchronize()
            assert bool((kv[seq.block_table.tolist()] == 1).all())


def test_tiers_and_swaps_on_vmm_memory_are_byte_exact(vmm_daemon, tmp_path):
    """Demotion to the host tier, promotion back, swap-out and swap-in: the daemon's copies on VMM chunks."""
    d = vmm_daemon("8MiB", "--host-bytes", "16MiB")
    lay = kvpool.Layout(**BIG)  # 128 KiB blocks: 64 fit the pool
    with kvpool.connect(d.socket, name="tiers", layout=lay, device=0) as c:
        kv = c.kv_cache()
        flat = kv.view(kv.shape[0], -1)

        def fill(seq, base):
            for i, b in enumerate(seq.block_table.tolist()):
                flat[b] = (torch.arange(flat.shape[1], device="cuda") % 251 + base + i).to(flat.dtype)
            torch.cuda.synchronize()

        def check(seq, base):
            c.wait([seq])
            for i, b in enumerate(seq.block_table.tolist()):
                want = (torch.arange(flat.shape[1], device="cuda") % 251 + base + i).to(flat.dtype)
                assert torch.equal(flat[b], want), f"block {i} of the sequence lost its bytes"

        prompts = [[n * 1000 + t for t in range(16 * 8)] for n in range(12)]  # 96 blocks: 1.5x the pool
        for n, p in enumerate(prompts):
            s = c.create_sequence(p)
            fill(s, n)
            c.free(s)  # cached, then demoted to the host tier as the pool fills
        assert c.stats().classes[0].demoted_blocks > 0
        again = c.create_sequence(prompts[0])  # the oldest prompt comes back from the host tier
        assert again.num_cached_tokens == 16 * 8
        check(again, 0)
        c.free(again)
        keep = c.create_sequence([7] * 100)
        fill(keep, 50)
        c.mark_written(keep)
        c.swap_out(keep)
        (table,) = c.swap_in(keep)
        check(keep, 50)
