"""The transfer layer on the CPU: slots, the disk store (checksums, index, restart), the engine."""

from __future__ import annotations

import errno
import os
import queue

import numpy as np
import pytest
import torch

from kvpoold.core.tiers import Move, MovePlan, Tier
from kvpoold.transfer import Arrivals, CpuCopier, DiskStore, DiskTierError, TransferEngine
from kvpoold.transfer import disk as disk_mod
from kvpoold.transfer.disk_index import MAGIC
from kvpoold.transfer.host import HostStore, aligned_empty
from kvpoold.transfer.slots import SlotAllocator

BB = 8192
GEOM = {"num_layers": 1, "num_kv_heads": 1, "head_dim": 8, "dtype": "float16", "block_size": 16, "block_bytes": BB}


def data(i: int, n: int = BB) -> np.ndarray:
    return np.random.default_rng(i).integers(0, 256, n, dtype=np.uint8)


# -- slots --------------------------------------------------------------------------------------------
def test_slots_hand_out_the_lowest_free_first_and_reuse_exactly():
    s = SlotAllocator(10 * 4096)
    got = [s.alloc(4096) for _ in range(10)]
    assert got == [i * 4096 for i in range(10)] and s.alloc(1) is None
    for off in (8192, 4096, 20480):
        s.free(off)
    assert [s.alloc(4096) for _ in range(3)] == [4096, 8192, 20480]  # a contiguous run again
    s.free(0)
    assert s.alloc(100) == 0 and s.used == 10 * 4096


def test_slots_of_another_size_are_taken_whole_and_keep_their_size():
    s = SlotAllocator(3 * 4096)
    big = s.alloc(8192)
    s.alloc(4096)
    s.free(big)
    assert s.alloc(4096) == big and s.size_of(big) == 8192  # the larger free slot, whole
    s.free(big)
    assert s.alloc(8192) == big


def test_slots_rebuilt_from_a_file():
    s = SlotAllocator(None)
    for off in (0, 3 * 4096, 4 * 4096):
        s.reserve(off, 4096)
    s.seal(4096)
    assert sorted(s.alloc(4096) for _ in range(3)) == [4096, 8192, 5 * 4096]


# -- the disk store -------------------------------------------------------------------------------------
class Loop:
    """Stands for the daemon's event loop: runs what the store's workers post."""

    def __init__(self):
        self.q = queue.SimpleQueue()

    def post(self, fn):
        self.q.put(fn)

    def until(self, cond, limit=10_000):
        while not cond():
            self.q.get(timeout=30)()
            limit -= 1
            assert limit


def open_store(path, loop, capacity=64 * BB, **kw):
    store = DiskStore(str(path), capacity, post=loop.post, **kw)
    gid = store.layout_id(GEOM)
    store.bind(0, gid)
    return store


def write(store, loop, keys):
    done = []
    bufs = {}
    for k in keys:
        buf = aligned_empty(BB)
        buf[:] = data(hash(k[1]) % 1000)
        bufs[k] = buf
        store.write(k, buf, BB, lambda ok, key: done.append(ok))
    store.flush()
    loop.until(lambda: len(done) == len(keys))
    assert all(done)
    return bufs


def read(store, loop, keys):
    out, results = {}, {}
    for k in keys:
        out[k] = aligned_empty(BB)
        store.read(k, out[k], lambda ok, corrupt, k=k: results.__setitem__(k, (ok, corrupt)))
    store.flush()
    loop.until(lambda: len(results) == len(keys))
    return out, results


def close(store, loop):
    store.drain()
    while not loop.q.empty():
        loop.q.get()()
    store.sync()
    store.close()


@pytest.mark.parametrize("direct", [True, False])
def test_disk_round_trip_with_checksums(tmp_path, direct):
    loop = Loop()
    store = open_store(tmp_path, loop, direct=direct)
    keys = [(0, bytes([i]) * 16) for i in range(20)] + [(0, 7), (0, 8)]  # prefix blocks and swap copies
    bufs = write(store, loop, keys)
    out, results = read(store, loop, keys)
    assert all(results[k] == (True, False) for k in keys)
    assert all(np.array_equal(out[k], bufs[k]) for k in keys)
    assert not store.entries  # a read takes the block out (promotion)
    close(store, loop)


def test_corrupt_block_is_reported_and_dropped(tmp_path):
    loop = Loop()
    store = open_store(tmp_path, loop)
    keys = [(0, bytes([i]) * 16) for i in range(3)]
    write(store, loop, keys)
    victim = store.entries[keys[1]]
    with open(store.files[victim.gid].path, "r+b") as f:
        f.seek(victim.offset + 17)
        b = f.read(1)
        f.seek(victim.offset + 17)
        f.write(bytes([b[0] ^ 1]))
    os.posix_fadvise(store.files[victim.gid].fd, 0, 0, os.POSIX_FADV_DONTNEED)
    _, results = read(store, loop, keys)
    assert results[keys[1]] == (False, True) and results[keys[0]][0] and results[keys[2]][0]
    assert store.corrupt == 1
    close(store, loop)


def test_index_survives_a_restart_and_a_torn_tail(tmp_path):
    loop = Loop()
    store = open_store(tmp_path, loop)
    keys = [(0, bytes([i]) * 16) for i in range(10)]
    bufs = write(store, loop, keys)
    assert store.drop(keys[3])
    read(store, loop, [keys[4]])  # promoted: gone from the index too
    write(store, loop, [(0, 99)])  # a swap copy: never indexed
    close(store, loop)
    with open(tmp_path / "index.log", "ab") as f:
        f.write(b"\x01torn record")  # a crash in the middle of an append
    loop = Loop()
    store = DiskStore(str(tmp_path), 64 * BB, post=loop.post)
    (gid,) = store.geoms
    found = store.found[gid]
    survivors = [k for i, k in enumerate(keys) if i not in (3, 4)]
    assert list(found) == [k[1] for k in survivors]  # oldest first
    store.bind(0, gid)
    for k in survivors:
        store.adopt(0, k[1])
    assert store.reject_found() == 0
    out, results = read(store, loop, survivors)
    assert all(results[k] == (True, False) for k in survivors)
    assert all(np.array_equal(out[k], bufs[k]) for k in survivors)
    # the freed slots are reused, not appended
    write(store, loop, [(0, b"n" * 16)])
    assert store.entries[(0, b"n" * 16)].offset < 10 * BB
    close(store, loop)
    assert (tmp_path / "index.log").read_bytes().startswith(MAGIC)


def test_one_daemon_per_disk_directory(tmp_path):
    loop = Loop()
    store = open_store(tmp_path, loop)
    with pytest.raises(DiskTierError, match="another kvpoold"):
        DiskStore(str(tmp_path), BB, post=loop.post)
    close(store, loop)
    DiskStore(str(tmp_path), BB, post=loop.post).close()  # free again


def test_failed_write_is_reported(tmp_path, monkeypatch):
    loop = Loop()
    store = open_store(tmp_path, loop)

    def full(fd, bufs, offset):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(disk_mod, "pwritev_all", full)
    done = []
    store.write((0, b"x" * 16), aligned_empty(BB), BB, lambda ok, key: done.append((ok, key)))
    store.flush()
    loop.until(lambda: done)
    assert done == [(False, (0, b"x" * 16))] and (0, b"x" * 16) not in store and store.lost == 1
    close(store, loop)


# -- the engine ------------------------------------------------------------------------------------------
def engine_with_pool(tmp_path, host_blocks, disk_blocks, staging=None, blocks=64):
    eng = TransferEngine(host_bytes=host_blocks * BB, disk_dir=str(tmp_path / "d") if disk_blocks else None,
                         disk_bytes=disk_blocks * BB, staging_bytes=staging)
    pool = torch.zeros(blocks, BB, dtype=torch.uint8)
    eng.add_class(0, BB, pool)
    if eng.disk is not None:
        eng.disk.bind(0, eng.disk.layout_id(GEOM))
    return eng, pool.numpy()


def test_engine_moves_bytes_down_and_back_up(tmp_path):
    eng, rows = engine_with_pool(tmp_path, host_blocks=4, disk_blocks=16)
    for b in range(8):
        rows[b] = data(b)
    keys = [(0, bytes([b]) * 16) for b in range(8)]
    # 4 to the host, 4 to disk directly; then 2 host blocks pushed to disk
    moves = [Move(keys[b], Tier.DEVICE, Tier.HOST if b < 4 else Tier.DISK, b, BB) for b in range(8)]
    moves += [Move(keys[0], Tier.HOST, Tier.DISK, -1, BB), Move(keys[1], Tier.HOST, Tier.DISK, -1, BB)]
    assert eng.submit(moves) == []
    rows[:8] = 0  # the device blocks are reused: the copies were taken before submit returned
    back = [Move(keys[b], Tier.HOST if b in (2, 3) else Tier.DISK, Tier.DEVICE, 20 + b, BB) for b in range(8)]
    arrivals = eng.submit(back)
    assert eng.wait(arrivals) and all(a.ok for a in arrivals)
    for b in range(8):
        assert np.array_equal(rows[20 + b], data(b)), f"block {b}"
    eng.drain()
    assert not eng.host.entries and not eng.disk.entries
    assert eng.host.slots.used == 0
    eng.close()


def test_engine_waits_for_staging_instead_of_failing(tmp_path):
    # no host tier, room for 2 blocks of staging: 30 demotions to disk in one call
    eng, rows = engine_with_pool(tmp_path, host_blocks=0, disk_blocks=64, staging=2 * BB)
    for b in range(30):
        rows[b] = data(100 + b)
    keys = [(0, 1000 + b) for b in range(30)]
    eng.submit([Move(keys[b], Tier.DEVICE, Tier.DISK, b, BB) for b in range(30)])
    rows[:30] = 0
    arrivals = eng.submit([Move(keys[b], Tier.DISK, Tier.DEVICE, 32 + b, BB) for b in range(30)])
    assert eng.wait(arrivals) and all(a.ok for a in arrivals)
    assert all(np.array_equal(rows[32 + b], data(100 + b)) for b in range(30))
    eng.close()


def test_engine_reports_a_missing_copy_as_a_failed_arrival(tmp_path):
    eng, rows = engine_with_pool(tmp_path, host_blocks=4, disk_blocks=4)
    lost = []
    eng.on_lost = lost.append
    arrivals = eng.submit([Move((0, b"?" * 16), Tier.HOST, Tier.DEVICE, 3, BB),
                           Move((0, b"!" * 16), Tier.DISK, Tier.DEVICE, 4, BB)])
    (batch,) = arrivals  # one batch per class
    assert eng.wait(arrivals) and batch.done and not batch.ok
    assert batch.blocks.tolist() == [3, 4] and batch.state.tolist() == [Arrivals.LOST, Arrivals.LOST]
    eng.submit([Move((0, b"?" * 16), Tier.HOST, Tier.DISK, -1, BB)])  # nothing on the host to push
    assert lost == [(0, b"?" * 16)]
    eng.close()


def test_host_slot_is_freed_only_after_its_last_copy(tmp_path):
    host = HostStore(2 * 4096, 0)
    (a,) = host.alloc_many(4096, 1)
    host.put_many(["k"], [a])
    assert host.pop_many(["k", "gone"]) == [a, -1]  # a copy owns the slot now
    assert len(host.alloc_many(4096, 2)) == 1  # a is not free while the copy runs
    host.free_many([a])  # the copy is done
    assert host.alloc_many(4096, 2) == [a]
    with pytest.raises(KeyError):
        host.free_many([a, a])  # a second free fails loudly


# -- batches -------------------------------------------------------------------------------------------
def test_slots_in_batches_are_ascending_and_reused_whole():
    s = SlotAllocator(8 * 4096)
    a = s.alloc_many(4096, 5)
    assert a == [i * 4096 for i in range(5)]
    s.free_many([3 * 4096, 4096])
    b = s.alloc_many(4096, 5)  # the freed ones first, lowest first, then fresh space, then nothing
    assert b == [4096, 3 * 4096, 5 * 4096, 6 * 4096, 7 * 4096] and s.used == 8 * 4096
    assert s.alloc_many(4096, 1) == [] and s.alloc(1) is None
    s.free_many(a[:1] + b)
    assert s.alloc(4096) == 0 and s.used == 3 * 4096  # single and batch calls share one free list
    with pytest.raises(KeyError):
        s.free_many([4096])  # freed already


class _Later:
    """The event of a copy that is done (the engine still waits for it on its watcher thread)."""

    def __init__(self):
        self.waited = False

    def synchronize(self):
        self.waited = True


class EventCopier(CpuCopier):
    """The CPU copier behind the GPU's interface: each copy returns an event, completions come through the
    engine's watcher thread, as with ``CudaCopier``."""

    def __init__(self):
        self.events = []

    def to_host(self, rows, ids, host, offsets):
        super().to_host(rows, ids, host, offsets)
        self.events.append(_Later())
        return self.events[-1]

    def to_device(self, rows, ids, host, offsets):
        super().to_device(rows, ids, host, offsets)
        self.events.append(_Later())
        return self.events[-1]


@pytest.mark.parametrize("copier", [None, EventCopier], ids=["cpu", "events"])
def test_engine_batch_has_one_completion_and_a_state_per_block(tmp_path, copier):
    eng = TransferEngine(host_bytes=8 * BB, disk_dir=str(tmp_path / "d"), disk_bytes=16 * BB,
                         copier=copier() if copier else None)
    pool = np.zeros((64, BB), np.uint8)
    eng.add_class(0, BB, pool)
    eng.disk.bind(0, eng.disk.layout_id(GEOM))
    for b in range(6):
        pool[b] = data(b)
    keys = [(0, 500 + b) for b in range(6)]
    plan = MovePlan()
    for b in range(6):
        plan.add(keys[b], int(Tier.DEVICE), int(Tier.HOST if b < 4 else Tier.DISK), b, BB)
    assert eng.submit(plan) == []
    assert eng.host.slots.used == 4 * BB + 2 * BB  # 4 keyed slots, 2 staging slots under disk writes
    pool[:6] = 0
    back = MovePlan()
    for b in range(6):
        back.add(keys[b], int(Tier.HOST if b < 4 else Tier.DISK), int(Tier.DEVICE), 10 + b, BB)
    back.add((0, 999), int(Tier.HOST), int(Tier.DEVICE), 30, BB)  # not there: lost, at once
    (batch,) = eng.submit(back)
    seen = []
    batch.waiters.append(seen.append)
    assert batch.state[-1] == Arrivals.LOST
    assert eng.wait([batch]) and batch.done and not batch.ok and seen == [batch]  # one completion
    assert batch.state.tolist() == [Arrivals.OK] * 6 + [Arrivals.LOST]
    assert all(np.array_equal(pool[10 + b], data(b)) for b in range(6))
    eng.drain()
    assert eng.host.slots.used == 0 and not eng.host.entries  # every slot back once its copy was done
    if copier:
        assert eng.copier.events and all(e.waited for e in eng.copier.events)
    eng.close()


def test_a_key_pushed_on_in_the_same_call_is_copied_out_first(tmp_path):
    # the core plans DEVICE->HOST then HOST->DISK for the same key when the host fills in one call
    eng, rows = engine_with_pool(tmp_path, host_blocks=2, disk_blocks=8)
    for b in range(3):
        rows[b] = data(40 + b)
    k = [(0, bytes([b]) * 16) for b in range(3)]
    plan = MovePlan()
    plan.add(k[0], int(Tier.DEVICE), int(Tier.HOST), 0, BB)
    plan.add(k[1], int(Tier.DEVICE), int(Tier.HOST), 1, BB)
    plan.add(k[0], int(Tier.HOST), int(Tier.DISK), -1, BB)
    plan.add(k[2], int(Tier.DEVICE), int(Tier.HOST), 2, BB)
    eng.submit(plan)
    rows[:3] = 0
    assert k[0] in eng.disk and k[1] in eng.host and k[2] in eng.host
    back = [Move(k[0], Tier.DISK, Tier.DEVICE, 7, BB), Move(k[1], Tier.HOST, Tier.DEVICE, 8, BB),
            Move(k[2], Tier.HOST, Tier.DEVICE, 9, BB)]
    arrivals = eng.submit(back)
    assert eng.wait(arrivals) and all(a.ok for a in arrivals)
    assert all(np.array_equal(rows[7 + b], data(40 + b)) for b in range(3))
    eng.close()


class LazyCopier(CpuCopier):
    """Copies that happen only when their event is waited for, as a DMA is only known done then: bytes
    read before the engine waited for the copy would be stale."""

    def __init__(self):
        self.calls = []  # (direction, blocks) per call

    def _later(self, fn, rows, ids, host, offsets, way):
        self.calls.append((way, len(ids)))
        args = (rows, np.array(ids), host, np.array(offsets))

        class Event:
            done = False

            def synchronize(self):
                if not self.done:
                    self.done = True
                    fn(*args)

        return Event()

    def to_host(self, rows, ids, host, offsets):
        return self._later(CpuCopier.to_host, rows, ids, host, offsets, "out")

    def to_device(self, rows, ids, host, offsets):
        return self._later(CpuCopier.to_device, rows, ids, host, offsets, "in")


def test_batches_are_copied_in_pieces_with_one_completion(tmp_path):
    eng = TransferEngine(host_bytes=16 * BB, staging_bytes=0, copier=LazyCopier(), pipeline_blocks=3)
    pool = np.zeros((64, BB), np.uint8)
    eng.add_class(0, BB, pool)
    for b in range(10):
        pool[b] = data(300 + b)
    keys = [(0, 700 + b) for b in range(10)]
    out = MovePlan()
    for b in range(10):
        out.add(keys[b], int(Tier.DEVICE), int(Tier.HOST), b, BB)
    assert eng.submit(out) == []
    assert eng.copier.calls == [("out", 3), ("out", 3), ("out", 3), ("out", 1)]  # pieces of 3 blocks
    pool[:10] = 0  # every piece was copied before submit returned
    back = MovePlan()
    for b in range(10):
        back.add(keys[b] if b != 4 else (0, 999), int(Tier.HOST), int(Tier.DEVICE), 20 + b, BB)
    (batch,) = eng.submit(back)
    assert eng.copier.calls[4:] == [("in", 3), ("in", 2), ("in", 3), ("in", 1)]  # the missing key: not copied
    seen = []
    batch.waiters.append(seen.append)
    assert eng.wait([batch]) and seen == [batch]  # one completion for the batch
    assert batch.state.tolist() == [Arrivals.OK] * 4 + [Arrivals.LOST] + [Arrivals.OK] * 5
    assert all(np.array_equal(pool[20 + b], data(300 + b)) for b in range(10) if b != 4)
    eng.drain()
    assert eng.host.slots.used == BB and list(eng.host.entries) == [keys[4]]  # the one not promoted
    eng.close()


def test_piece_copies_finish_before_disk_writes_read_their_slots(tmp_path):
    # host room for 2 blocks, pieces of 1 block, 6 swap-outs to disk: the third piece finds no slot,
    # and the disk writes of the first two (which free slots) must not start before their copies are done
    eng = TransferEngine(host_bytes=0, staging_bytes=2 * BB, disk_dir=str(tmp_path / "d"), disk_bytes=16 * BB,
                         copier=LazyCopier(), pipeline_blocks=1)
    pool = np.zeros((64, BB), np.uint8)
    eng.add_class(0, BB, pool)
    eng.disk.bind(0, eng.disk.layout_id(GEOM))
    for b in range(6):
        pool[b] = data(400 + b)
    keys = [(0, 800 + b) for b in range(6)]
    eng.submit([Move(keys[b], Tier.DEVICE, Tier.DISK, b, BB) for b in range(6)])
    pool[:6] = 0
    arrivals = eng.submit([Move(keys[b], Tier.DISK, Tier.DEVICE, 30 + b, BB) for b in range(6)])
    assert eng.wait(arrivals) and all(a.ok for a in arrivals)
    assert all(np.array_equal(pool[30 + b], data(400 + b)) for b in range(6))
    assert eng.disk.corrupt == 0
    eng.close()


def test_pipeline_blocks_must_be_positive():
    with pytest.raises(ValueError, match="pipeline_blocks"):
        TransferEngine(pipeline_blocks=0)


def test_slots_taken_in_pieces_are_the_lowest_free_ones():
    s = SlotAllocator(64 * 4096)
    s.alloc_many(4096, 64)
    freed = [o * 4096 for o in np.random.default_rng(5).permutation(64)[:40].tolist()]
    s.free_many(freed[:20])
    s.free_many(freed[20:])  # a heap, not in order
    low = sorted(freed)
    # a batch taken in pieces of 4: each piece is the lowest left
    got = [s.alloc_many(4096, 4) for _ in range(3)]
    assert got == [low[0:4], low[4:8], low[8:12]]
    s.free_many([low[1], low[5]])  # frees between pieces: still the lowest first
    assert s.alloc_many(4096, 3) == [low[1], low[5], low[12]]
    s.free(low[0])
    assert s.alloc(4096) == low[0] and s.alloc_many(4096, 2) == low[13:15]
    assert s.used == (64 - 40 + 15) * 4096  # 15 of the 40 freed slots taken again


def test_a_bad_batch_free_frees_nothing_and_arrays_are_accepted():
    s = SlotAllocator(8 * 4096)
    a = s.alloc_array(4096, 4)
    assert a.tolist() == [0, 4096, 8192, 12288]
    with pytest.raises(KeyError):
        s.free_many([0, 8192, 0])  # twice in one call
    with pytest.raises(KeyError):
        s.free_many(np.array([4096, 7 * 4096]))  # one never handed out
    assert s.used == 4 * 4096 and s.size_of(0) == 4096  # nothing was freed by either
    s.free_many(a[1:3])
    s.free(a[0])
    assert s.used == 4096 and s.alloc_many(4096, 4) == [0, 4096, 8192, 4 * 4096]


def test_an_unbounded_allocator_grows_and_reuses_the_lowest():
    s = SlotAllocator(None)
    got = s.alloc_array(8192, 5000)  # past the first size array: it grows with the file
    assert got.tolist() == list(range(0, 5000 * 8192, 8192)) and s.top == 5000 * 8192
    s.free_many(got[::2])
    assert s.alloc_many(8192, 3) == [0, 2 * 8192, 4 * 8192] and s.size_of(4999 * 8192) == 8192


def test_slots_mixed_single_and_batch_calls_take_the_lowest_free():
    # against a plain set of free offsets: every call takes the lowest free slots, then fresh space
    import random

    rng = random.Random(11)
    cap = 300
    s = SlotAllocator(cap * 4096)
    free: set[int] = set()
    top = 0
    used: list[int] = []
    for _ in range(2000):
        op = rng.random()
        if op < 0.3:
            n = rng.randint(1, 40)
            got = s.alloc_many(4096, n)
            want = sorted(free)[:n]
            fresh = min(n - len(want), cap - top)
            want += [(top + i) * 4096 for i in range(fresh)]
            top += fresh
            assert got == want
            free -= set(want)
            used += got
        elif op < 0.5:
            off = s.alloc(4096)
            want = min(free) if free else (top * 4096 if top < cap else None)
            if want is not None and not free:
                top += 1
            assert off == want
            if off is not None:
                free.discard(off)
                used.append(off)
        elif used:
            rng.shuffle(used)
            k = rng.randint(1, min(30, len(used)))
            gone, used = used[:k], used[k:]
            if k == 1 and rng.random() < 0.5:
                s.free(gone[0])
            else:
                s.free_many(np.asarray(gone) if rng.random() < 0.5 else gone)
            free |= set(gone)
        assert s.used == len(used) * 4096


def test_demotions_to_a_full_host_tier_are_reported_lost_and_the_rest_kept(tmp_path):
    # room for 2 blocks on the host and no copy in flight to free one: 5 demotions to the host in one call
    eng, rows = engine_with_pool(tmp_path, host_blocks=2, disk_blocks=0, staging=0)
    lost = []
    eng.on_lost = lost.append
    for b in range(5):
        rows[b] = data(200 + b)
    keys = [(0, bytes([50 + b]) * 16) for b in range(5)]
    eng.submit([Move(keys[b], Tier.DEVICE, Tier.HOST, b, BB) for b in range(5)])
    kept = [k for k in keys if k in eng.host]
    assert len(kept) == 2 and sorted(lost + kept) == sorted(keys)
    rows[:5] = 0
    arrivals = eng.submit([Move(k, Tier.HOST, Tier.DEVICE, 10 + i, BB) for i, k in enumerate(kept)])
    assert eng.wait(arrivals) and all(a.ok for a in arrivals)
    for i, k in enumerate(kept):
        assert np.array_equal(rows[10 + i], data(200 + keys.index(k)))
    eng.close()
