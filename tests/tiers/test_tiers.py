"""The memory hierarchy against a real daemon: demotion, promotion, swapping, the disk tier.

Behaviour only (no timing asserts).  Each test writes blocks whose bytes are
a function of their tokens and checks them byte for byte wherever they come
back from.  The CPU backend runs everywhere; the ``cuda`` variants run with
``scripts/gpu_tests.sh tests/tiers`` on a GPU machine (pinned host memory,
CUDA streams, the gather/scatter kernels).
"""

from __future__ import annotations

import os
import random

import numpy as np
import pytest

import kvpool
from kvpoold.core.hashing import chain_hashes, pack_tokens, root_hash
from kvpoold.transfer.disk_index import MAGIC, REC_BYTES, RECORD
from tierlib import BACKENDS, BLOCK, BS, LAYOUT, check_sequence, prompt, write_sequence


def fill(client, first: int, count: int, blocks: int = 16) -> None:
    """Write prompts ``first .. first+count-1`` and free them: they become cached blocks."""
    for i in range(first, first + count):
        toks = prompt(i, blocks)
        s = client.create_sequence(toks)
        write_sequence(client, s, toks, s.num_cached_tokens // BS)
        client.free(s)


@pytest.mark.parametrize("backend", BACKENDS)
def test_prefix_cache_three_times_the_pool_keeps_every_block(tier_daemon, backend):
    # device 256 blocks, host 256, disk 512: 768 blocks of prompts fit in the tiers, not on the device
    d = tier_daemon(host_blocks=256, disk_blocks=512, backend=backend)
    n = 48  # x 16 blocks = 768 = 3x the pool
    with kvpool.connect(d.socket, name="tiers", layout=LAYOUT) as c:
        fill(c, 0, n)
        st = c.stats()
        assert st.classes[0].demoted_blocks >= 768 - 256
        host, disk = st.tiers
        assert host.blocks == 256 and disk.blocks > 0 and disk.dropped_blocks == 0
        assert c.lookup(prompt(0, 16)) == 16 * BS  # the oldest prompt: on disk, still found
        order = list(range(n))
        random.Random(6).shuffle(order)  # promotions from both lower tiers
        for i in order:
            toks = prompt(i, 16)
            s = c.create_sequence(toks)
            assert s.num_cached_tokens == len(toks), f"prompt {i}: {s.num_cached_tokens} tokens cached"
            check_sequence(c, s, toks)
            c.free(s)
        st = c.stats()
        host, disk = st.tiers
        assert st.classes[0].promoted_blocks >= 768 - 256
        assert host.blocks_out > 0 and disk.blocks_out > 0, "promotions came from both lower tiers"
        assert st.classes[0].lost_blocks == 0 and disk.corrupt_blocks == 0
        assert host.bytes_written > 0 and disk.bytes_written > 0 and disk.bytes_read > 0
        assert c._conn.check()[0]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("tier", ["host", "disk"])
def test_swap_out_and_in_is_byte_exact(tier_daemon, backend, tier):
    d = tier_daemon(host_blocks=512 if tier == "host" else 0, disk_blocks=512 if tier == "disk" else 0,
                    backend=backend)
    with kvpool.connect(d.socket, name="swapper", layout=LAYOUT) as c:
        toks = {i: prompt(500 + i, 5, extra=7) for i in range(8)}  # 5 full blocks and a partial one
        seqs = {}
        for i, t in toks.items():
            seqs[i] = c.create_sequence(t)
            write_sequence(c, seqs[i], t)
        c.extend({seqs[0]: [1, 2, 3]})  # queued locally: swap_out reports it first
        toks[0] = toks[0] + [1, 2, 3]
        write_sequence(c, seqs[0], toks[0], 5)
        out = [seqs[i] for i in range(4)]
        given_back = c.swap_out(out)
        assert given_back == 4 * 6
        assert all(s.swapped and s.block_table.size == 0 for s in out)
        with pytest.raises(kvpool.FailedPrecondition):
            c.extend({out[1]: [9]})
        st = c.stats()
        assert st.classes[0].swapped_sequences == 4
        lower = st.tiers[0] if tier == "host" else st.tiers[1]
        assert lower.pinned_bytes == 4 * 6 * BLOCK
        # fill the device with other data: the swapped blocks' device copies are overwritten or evicted
        fill(c, 1000, 15)
        tables = c.swap_in(out)
        assert [len(t) for t in tables] == [6] * 4
        for i, s in enumerate(out):
            assert not s.swapped and s.num_tokens == len(toks[i]) and s.num_cached_tokens == len(toks[i])
            check_sequence(c, s, toks[i])
        for i in range(4, 8):  # never swapped: untouched
            check_sequence(c, seqs[i], toks[i])
        c.extend({out[1]: [9]})  # live again
        st = c.stats()
        assert st.classes[0].swapped_out_blocks == st.classes[0].swapped_in_blocks == 24
        assert st.classes[0].swapped_sequences == 0
        assert all(t.pinned_bytes == 0 for t in st.tiers)  # the copies were taken back
        assert c._conn.check()[0]


def test_swap_needs_a_tier_and_room(tier_daemon):
    d = tier_daemon(host_blocks=4)
    with kvpool.connect(d.socket, name="swapper", layout=LAYOUT) as c:
        small = c.create_sequence(prompt(1, 2))
        big = c.create_sequence(prompt(2, 8))
        with pytest.raises(kvpool.OutOfBlocks, match="lower-tier"):
            c.swap_out([small, big])  # 10 blocks, the host tier holds 4: nothing happens
        assert not small.swapped and not big.swapped
        c.swap_out(small)
        with pytest.raises(kvpool.FailedPrecondition):
            c.swap_out(small)
        c.free(small)  # a swapped-out sequence can be freed: its copies go
        assert c.stats().tiers[0].pinned_bytes == 0
        assert c._conn.check()[0]
    d2 = tier_daemon()
    with kvpool.connect(d2.socket, name="no-tiers", layout=LAYOUT) as c:
        s = c.create_sequence(prompt(3, 1))
        with pytest.raises(kvpool.FailedPrecondition, match="no host or disk tier"):
            c.swap_out(s)


def test_create_without_waiting_then_wait(tier_daemon):
    d = tier_daemon(disk_blocks=1024)
    with kvpool.connect(d.socket, name="nowait", layout=LAYOUT) as c:
        fill(c, 0, 40)  # 640 blocks: the first prompts went to disk
        assert c.stats().tiers[1].blocks > 0
        toks = prompt(0, 16)
        s = c.create_sequence(toks + [5, 6], wait=False)
        assert s.num_cached_tokens == len(toks)
        assert set(s.arriving) <= set(range(16))
        valid = c.wait([s])
        assert valid == {s.id: len(toks)} and s.arriving == []
        check_sequence(c, s, toks, 16)
        assert c._conn.check()[0]


def test_restart_finds_the_disk_blocks(tier_daemon, tmp_path):
    disk = tmp_path / "tier2"
    d = tier_daemon(disk_blocks=1024, disk_dir=disk)
    with kvpool.connect(d.socket, name="before", layout=LAYOUT) as c:
        fill(c, 0, 24)  # 384 blocks: the first 8 prompts (at least) are on disk now
        on_disk = c.stats().tiers[1].blocks
        assert on_disk >= 128
    assert d.stop() == 0
    assert sorted(os.listdir(disk)) == ["blocks-1.dat", "geometries.json", "index.log", "tiers.lock"]
    d2 = tier_daemon(disk_blocks=1024, disk_dir=disk)
    with kvpool.connect(d2.socket, name="after", layout=LAYOUT) as c:
        assert c.stats().tiers[1].blocks == on_disk  # found again, before anything was asked
        for i in range(4):
            toks = prompt(i, 16)
            s = c.create_sequence(toks)
            assert s.num_cached_tokens == len(toks), f"prompt {i} was not found after the restart"
            check_sequence(c, s, toks)
            c.free(s)
        assert c.create_sequence(prompt(23, 16)).num_cached_tokens == 0  # was on the device: gone
        assert c._conn.check()[0]


def _slot_of(disk_dir, tokens, block: int) -> int:
    """The data file offset of one block, from the daemon's index."""
    digest = chain_hashes(root_hash(LAYOUT.model_id), pack_tokens(tokens), BS)[block]
    data = (disk_dir / "index.log").read_bytes()
    assert data.startswith(MAGIC)
    found = None
    for pos in range(len(MAGIC), len(data) - REC_BYTES + 1, REC_BYTES):
        op, gid, h, offset, nbytes, csum = RECORD.unpack_from(data, pos)
        if h == digest:
            found = offset if op == 1 else None
    assert found is not None, "the block is not in the index"
    return found


def test_corrupted_disk_block_is_detected_and_not_served(tier_daemon, tmp_path):
    disk = tmp_path / "tier2"
    d = tier_daemon(disk_blocks=1024, disk_dir=disk)
    with kvpool.connect(d.socket, name="before", layout=LAYOUT) as c:
        fill(c, 0, 24)
    d.stop()
    toks = prompt(1, 16)
    offset = _slot_of(disk, toks, 2)  # the third block of prompt 1
    with open(disk / "blocks-1.dat", "r+b") as f:
        f.seek(offset + 100)
        byte = f.read(1)
        f.seek(offset + 100)
        f.write(bytes([byte[0] ^ 0xFF]))  # one flipped byte
    d2 = tier_daemon(disk_blocks=1024, disk_dir=disk)
    with kvpool.connect(d2.socket, name="after", layout=LAYOUT) as c:
        assert c.lookup(toks) == len(toks)  # the index still names it: only reading finds out
        s = c.create_sequence(toks)
        assert s.num_cached_tokens == 2 * BS, "the blocks from the bad one on must be recomputed"
        check_sequence(c, s, toks, 2)
        st = c.stats()
        assert st.tiers[1].corrupt_blocks == 1 and st.classes[0].lost_blocks == 1
        write_sequence(c, s, toks, 2)  # the client recomputes from there
        c.free(s)
        s = c.create_sequence(toks)  # the bad copy was dropped; the rewritten block is served
        assert s.num_cached_tokens == len(toks)
        check_sequence(c, s, toks)
        c.free(s)
        other = prompt(2, 16)  # the neighbours are fine
        s = c.create_sequence(other)
        assert s.num_cached_tokens == len(other)
        check_sequence(c, s, other)
        assert c._conn.check()[0]


def test_full_disk_tier_evicts_rather_than_fails(tier_daemon):
    d = tier_daemon(disk_blocks=64)  # the disk holds 4 prompts of 16 blocks
    with kvpool.connect(d.socket, name="filler", layout=LAYOUT) as c:
        fill(c, 0, 40)  # 640 blocks through a 256-block pool and a 64-block disk: nothing fails
        st = c.stats()
        disk = st.tiers[1]
        assert disk.blocks == 64 and disk.used_bytes == disk.capacity_bytes
        assert disk.dropped_blocks == 640 - st.classes[0].cached_blocks - 64  # what the device and disk could not keep
        assert c.lookup(prompt(0, 16)) == 0  # the LRU tail was dropped
        toks = prompt(40 - 256 // 16 - 2, 16)  # demoted late: on disk
        s = c.create_sequence(toks)
        assert s.num_cached_tokens == len(toks)
        check_sequence(c, s, toks)
        assert c._conn.check()[0]


def test_stats_table_shows_the_tiers(tier_daemon):
    from rich.console import Console

    from kvpoold.ctl import stats_table

    d = tier_daemon(host_blocks=64, disk_blocks=64)
    with kvpool.connect(d.socket, name="stats", layout=LAYOUT) as c:
        fill(c, 0, 20)
        s = c.create_sequence(prompt(0, 4, extra=3))
        c.swap_out(s)
        console = Console(record=True, width=200)
        console.print(stats_table(c.stats()))
        text = console.export_text()
    for row in ("promoted (blocks)", "demoted (blocks)", "swapped out / in", "written to tier", "GB/s",
                "host tier", "disk tier"):
        assert row in text, f"{row!r} missing from:\n{text}"


def test_disk_directory_defaults_and_a_clear_error_without_one(daemon_factory, tmp_path, monkeypatch):
    import subprocess
    import sys

    from kvpoold.server.tiers import STATE_DIRECTORY, resolve_disk_dir

    assert resolve_disk_dir("/somewhere") == "/somewhere"
    monkeypatch.setenv("STATE_DIRECTORY", str(tmp_path))  # what systemd sets for StateDirectory=
    assert resolve_disk_dir("") == str(tmp_path)
    monkeypatch.delenv("STATE_DIRECTORY")
    assert resolve_disk_dir("") == (STATE_DIRECTORY if os.path.isdir(STATE_DIRECTORY) else "")
    if os.path.isdir(STATE_DIRECTORY):
        pytest.skip(f"{STATE_DIRECTORY} exists here: it is the default")
    d = daemon_factory("--disk-bytes", "1MiB", start=False)
    out = subprocess.run([sys.executable, "-m", "kvpoold", *d.args], capture_output=True, text=True, timeout=120,
                         env={k: v for k, v in os.environ.items() if k != "STATE_DIRECTORY"})
    assert out.returncode == 2 and "--disk-dir" in out.stderr, out.stderr
