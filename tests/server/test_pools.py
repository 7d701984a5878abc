"""One daemon, several pools: a session is bound to the pool of its GPU (kvpoold/server/pools.py).

CI has no GPU, so these run real CPU-backend pools (real shared memory) in one
process and give them the bus ids two GPUs would have; the daemon-level
routing, limits, errors and operator calls are the same code a CUDA daemon
with ``--devices 0,1`` runs.  The gRPC layer is exercised by a real server
on a Unix socket, in a thread of this process.
"""

from __future__ import annotations

import asyncio
import io
import os
import stat
import threading

import numpy as np
import pytest
from rich.console import Console

import kvpool
from kvpool import Connection
from kvpool.handoff import attach_ticket
from kvpool.ipc import DeviceMismatch, open_arena
from kvpool.protocol import kvpool_pb2 as pb
from kvpoold.config import Config
from kvpoold.core import Geometry, WrongState
from kvpoold.ctl import stats_view
from kvpoold.memory.cpu_shm import CpuShmBackend
from kvpoold.server.errors import TooManySessions
from kvpoold.server.handoff import HandoffServer, handoff_path
from kvpoold.server.devices import check_disk_root, disk_dir_for
from kvpoold.server.pools import normalize_bus_id
from kvpoold.server.service import Service
from kvpoold.transfer import DiskStore, DiskTierError
from kvpoold.server.servicer import KVPoolServicer, add_to_server

BUS = ("0000:1A:00.0", "0000:3B:00.0")
LAYOUT = {"model_id": "m", "revision": "", "num_layers": 1, "num_kv_heads": 1, "head_dim": 8,
          "dtype": "float32", "block_size": 4}
GEOMETRY = Geometry(num_layers=1, num_kv_heads=1, head_dim=8, dtype="float32", block_size=4)


def two_pool_service(tmp_path, **config) -> Service:
    cfg = Config(socket=str(tmp_path / "s.sock"), pool_bytes=8 << 20, chunk_bytes=64 << 10, **config)
    service = Service(cfg)
    for device, bus in enumerate(BUS):
        backend = CpuShmBackend(f"pooltest{os.getpid()}d{device}", shm_dir=str(tmp_path))
        service.add_pool(backend, cfg.pool_bytes, device=device, bus_id=bus)
    return service


@pytest.fixture
def service(tmp_path):
    s = two_pool_service(tmp_path)
    yield s
    s.close()


def tokens(*ids) -> np.ndarray:
    return np.asarray(ids, np.uint32)


def create(service, session, prompts):
    """The page tables of new sequences (no tiers here: nothing to wait for)."""
    return [t.info for t in service.session_pool(session.token).create(prompts, no_wait=False)]


def test_a_session_gets_the_pool_of_its_gpu(service):
    a = service.attach("a", "m", GEOMETRY, os.getpid(), BUS[0])
    b = service.attach("b", "m", GEOMETRY, os.getpid(), "0000:3b:00.0")  # the case CUDA prints does not matter
    pool_a, pool_b = service.pool_of(a.session), service.pool_of(b.session)
    assert pool_a.bus_id == BUS[0] and pool_b.bus_id == BUS[1]
    assert a.descriptor.handle != b.descriptor.handle  # each pool its own memory
    assert a.session.id != b.session.id  # one registry: ids unique across pools
    create(service, b.session, [(tokens(*range(9)), "")])
    assert service.owners() == {b.session.id: (1, 0)}
    assert set(pool_a.manager.owners()) == set() and set(pool_b.manager.owners()) == {b.session.id}
    st = {d.bus_id: d for d in service.stats().devices}
    assert st[BUS[1]].sequences == 1 and st[BUS[0]].sequences == 0


def test_bytes_written_in_one_pool_are_read_from_its_mapping_only(service):
    a = service.attach("a", "m", GEOMETRY, os.getpid(), BUS[0])
    b = service.attach("b", "m", GEOMETRY, os.getpid(), BUS[1])
    (sa,) = create(service, a.session, [(tokens(1, 2, 3), "")])
    (sb,) = create(service, b.session, [(tokens(1, 2, 3), "")])
    def mapping(r):  # as a client does with the memfd the side socket hands it
        arena = service.pool_of(r.session).arenas[r.session.class_id]
        return open_arena(r.descriptor, fd=os.dup(arena.fileno()))

    ma, mb = mapping(a), mapping(b)
    try:
        view_a = np.asarray(ma.as_tensor("float32", (a.num_blocks, a.block_bytes // 4)))
        view_b = np.asarray(mb.as_tensor("float32", (b.num_blocks, b.block_bytes // 4)))
        view_a[sa.block_table[0], :] = 7.0
        view_b[sb.block_table[0], :] = 9.0
        again = np.asarray(mapping(a).as_tensor("float32", (a.num_blocks, a.block_bytes // 4)))
        assert again[sa.block_table[0], 0] == 7.0  # another mapping of pool A sees A's bytes
        assert view_b[sb.block_table[0], 0] == 9.0
    finally:
        ma.close()
        mb.close()


def test_prefix_cache_is_per_pool(service):
    a = service.attach("a", "m", GEOMETRY, os.getpid(), BUS[0])
    b = service.attach("b", "m", GEOMETRY, os.getpid(), BUS[1])
    prompt = tokens(*range(20, 29))
    (s,) = create(service, a.session, [(prompt, "")])
    service.pool_of(a.session).manager.mark_written(a.session.id, [s.seq_id])
    assert service.session_pool(a.session.token).lookup(prompt, "").num_cached_tokens == 8
    # those bytes are on the other GPU
    assert service.session_pool(b.session.token).lookup(prompt, "").num_cached_tokens == 0


def test_a_gpu_not_served_is_refused_naming_the_devices_and_changes_nothing(service):
    with pytest.raises(DeviceMismatch, match=r"0000:AF:00.0.*cuda:0 \(0000:1A:00.0\), cuda:1 \(0000:3B:00.0\)"):
        service.attach("x", "m", GEOMETRY, os.getpid(), "0000:af:00.0")
    with pytest.raises(DeviceMismatch, match="serves several GPUs .* named none"):
        service.attach("x", "m", GEOMETRY, os.getpid(), "")
    assert len(service.sessions) == 0
    assert all(not pool.manager.classes and not pool.arenas for pool in service.pools)
    assert service.check()[0]


def test_one_pool_takes_a_client_that_names_no_gpu(tmp_path):
    cfg = Config(socket=str(tmp_path / "s.sock"), pool_bytes=4 << 20, chunk_bytes=64 << 10)
    service = Service(cfg)
    try:
        service.add_pool(CpuShmBackend(f"pooltest{os.getpid()}one", shm_dir=str(tmp_path)), cfg.pool_bytes,
                         device=0, bus_id=BUS[0])
        a = service.attach("a", "m", GEOMETRY, os.getpid(), "")
        assert service.pool_of(a.session) is service.pools.pools[0]
        with pytest.raises(DeviceMismatch, match="does not serve; it serves cuda:0"):
            service.attach("b", "m", GEOMETRY, os.getpid(), BUS[1])
    finally:
        service.close()


def test_max_sessions_counts_every_pool(tmp_path):
    service = two_pool_service(tmp_path, max_sessions=3)
    try:
        for bus in (BUS[0], BUS[1], BUS[1]):
            service.attach("c", "m", GEOMETRY, os.getpid(), bus)
        with pytest.raises(TooManySessions):
            service.attach("d", "m", GEOMETRY, os.getpid(), BUS[0])
        assert [pool.sessions for pool in service.pools] == [1, 2]
    finally:
        service.close()


def test_drop_reset_evict_and_check_act_on_every_pool(service):
    sessions = [service.attach(f"c{i}", "m", GEOMETRY, os.getpid(), BUS[i % 2]).session for i in range(4)]
    for s in sessions:
        (info,) = create(service, s, [(tokens(*range(100 + s.id, 109 + s.id)), "")])
        service.pool_of(s).manager.mark_written(s.id, [info.seq_id])
    ok, detail = service.check()
    assert ok and "4 sessions, 4 sequences in 2 pools" in detail
    released = service.session_pool(sessions[0].token).detach()  # routed to pool 0
    assert released > 0 and service.pools.pools[0].sessions == 1
    assert service.reset()[0] == 3
    assert len(service.sessions) == 0 and service.live_sequences == 0
    for st in service.stats().devices:
        assert st.sequences == 0 and sum(c.cached_blocks for c in st.classes) == 0  # reset evicted both
    assert service.check()[0]


def test_evict_by_class_reaches_every_pool_with_that_class(service):
    for bus in BUS:
        s = service.attach("e", "m", GEOMETRY, os.getpid(), bus).session
        (info,) = create(service, s, [(tokens(*range(9)), "")])
        service.pool_of(s).manager.mark_written(s.id, [info.seq_id])
        service.session_pool(s.token).detach()  # two full blocks stay cached
    assert service.evict(0, 3) == 3  # oldest first, pool by pool, within the limit
    assert service.evict(0, None) == 1
    with pytest.raises(Exception, match="class"):
        service.evict(5, None)


def memfd(fd: int) -> bool:
    try:
        return os.readlink(f"/proc/self/fd/{fd}").startswith("/memfd:kvpool-")
    except FileNotFoundError:
        return False


def test_shutdown_refuses_attaches_and_close_removes_every_pools_memory(tmp_path):
    service = two_pool_service(tmp_path)
    for bus in BUS:
        service.attach("a", "m", GEOMETRY, os.getpid(), bus)
    fds = [a.fileno() for p in service.pools for a in p.arenas.values()]
    assert len(fds) == 2 and all(memfd(fd) for fd in fds)  # one anonymous arena per pool
    service.closing = True
    with pytest.raises(WrongState):
        service.attach("late", "m", GEOMETRY, os.getpid(), BUS[0])
    service.close()
    assert not any(memfd(fd) for fd in fds)  # closed: the kernel frees the memory with the last mapping


def test_reload_reaches_every_pool(service):
    from dataclasses import replace

    service.config = replace(service.config, max_reserve_blocks=7, max_blocks_per_session=3)
    for pool in service.pools:
        assert pool.manager.max_reserve_blocks == 7 and pool.quotas.limit == 3


def test_disk_tier_directory_per_pool(tmp_path):
    cfg = Config(disk_dir=str(tmp_path), disk_bytes=1 << 30)
    assert disk_dir_for(cfg, 1, 1) == str(tmp_path)  # one pool: --disk-dir itself, as before
    assert disk_dir_for(cfg, 0, 2) == str(tmp_path / "gpu0")
    assert disk_dir_for(cfg, 1, 2) == str(tmp_path / "gpu1")  # kvpoold@1 uses the same directory


def test_several_pools_keep_their_disk_tiers_in_directories_of_the_daemon_alone(tmp_path):
    base = tmp_path / "tiers"
    cfg = Config(disk_dir=str(base), disk_bytes=1 << 30)
    old = os.umask(0)
    try:
        check_disk_root(cfg, 2)  # made before any gpuN in it
        for device in (0, 1):
            DiskStore(disk_dir_for(cfg, device, 2), 1 << 20, post=lambda fn: None).close()
    finally:
        os.umask(old)
    assert [stat.S_IMODE(p.stat().st_mode) for p in (base, base / "gpu0", base / "gpu1")] == [0o700] * 3
    base.chmod(0o777)  # anyone could swap a gpuN directory for a link
    with pytest.raises(DiskTierError, match=f"{base} is writable by group or others"):
        check_disk_root(cfg, 2)


def test_bus_ids_are_compared_in_one_form():
    assert normalize_bus_id("3b:00.0") == normalize_bus_id(" 0000:3B:00.0 ") == "0000:3B:00.0"


# -- over gRPC: the servicer is a thin adapter ----------------------------------------------------------------


@pytest.fixture
def served(tmp_path):
    """The two-pool service behind a real gRPC server on a Unix socket (its event loop in a thread)."""
    service = two_pool_service(tmp_path)
    path = str(tmp_path / "pools.sock")
    loop = asyncio.new_event_loop()
    ready, stop = threading.Event(), None

    async def main():
        nonlocal stop
        stop = asyncio.Event()
        server = __import__("grpc").aio.server()
        add_to_server(KVPoolServicer(service, asyncio.Event(), admin=True), server)
        server.add_insecure_port("unix://" + path)
        await server.start()
        handoff = HandoffServer(handoff_path(path), 0o600, service.tickets)  # attach tickets
        await handoff.start(None)
        ready.set()
        await stop.wait()
        await server.stop(None)
        await handoff.stop()

    thread = threading.Thread(target=loop.run_until_complete, args=(main(),), daemon=True)
    thread.start()
    assert ready.wait(30)
    yield path
    loop.call_soon_threadsafe(stop.set)
    thread.join(30)
    loop.close()
    service.close()


def attach(conn: Connection, bus: str):
    lay = pb.Layout(**{k: v for k, v in LAYOUT.items()})
    return conn.call("Attach", pb.AttachRequest(name="g", pid=os.getpid(), layout=lay, device_bus_id=bus,
                                                attach_ticket=attach_ticket(conn.address)))


def test_attach_and_stats_over_grpc(served):
    with Connection(served) as conn:
        a = attach(conn, BUS[1])
        prompt = pb.Prompt(tokens=tokens(*range(9)).tobytes())
        conn.call("Create", pb.CreateRequest(session=a.session, prompts=[prompt]))
        with pytest.raises(kvpool.FailedPrecondition, match="serves cuda:0 .*cuda:1"):
            attach(conn, "0000:99:00.0")
        st = conn.stats()
        assert [(d.index, d.device, d.bus_id) for d in st.devices] == [(0, 0, BUS[0]), (1, 1, BUS[1])]
        assert [(d.clients, d.sequences) for d in st.devices] == [(0, 0), (1, 1)]
        assert st.pool_bytes == sum(d.pool_bytes for d in st.devices) == 2 * (8 << 20)
        assert st.sequences == 1 and st.clients == 1
        assert st.devices[1].classes[0].models == ("m",) and not st.devices[0].classes
        assert st.classes == st.devices[0].classes + st.devices[1].classes  # the totals list every pool's
        assert st.to_dict()["devices"][1]["classes"][0]["hit_rate"] == 0.0
        (client,) = conn.clients()
        assert client.device == f"cuda:1 ({BUS[1]})"
        assert conn.check()[0]
        text = _render(st)
        assert "pools (one per GPU)" in text and "cuda:1 · class 0" in text and BUS[1] in text


def _render(st) -> str:
    console = Console(width=250, file=io.StringIO())
    console.print(stats_view(st))
    return console.file.getvalue()
