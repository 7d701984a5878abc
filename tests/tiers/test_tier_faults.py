"""Faults in the tiers: disk writes and reads that fail, a disk that fills up, a block corrupted
while the daemon runs.

Against a real daemon.  Failing I/O comes from the failpoints of
``kvpoold/faults.py`` (``KVPOOLD_FAILPOINTS``), except the full disk, which is
real: the daemon runs under a file-size limit (RLIMIT_FSIZE) smaller than its
``--disk-bytes``, so the kernel refuses writes past it (EFBIG), as a full file
system refuses them (ENOSPC) — no root needed.  In every case the daemon keeps
serving, the blocks that live sequences hold are byte-exact afterwards, the
failed copies are counted in ``stats`` and the self-check passes.
"""

from __future__ import annotations

import contextlib
import resource
import time

import kvpool
from test_tiers import _slot_of, fill
from tierlib import BLOCK, BS, LAYOUT, check_sequence, prompt, write_sequence


def start(daemon_factory, tmp_path, *, failpoints: str = "", host: int = 0, disk: int = 1024, pool: int = 64,
          run: bool = True):
    args = ["--pool-bytes", str(pool * BLOCK), "--chunk-bytes", "64KiB", "--host-bytes", str(host * BLOCK),
            "--disk-bytes", str(disk * BLOCK), "--disk-dir", str(tmp_path / "disk")]
    return daemon_factory(*args, start=run, env={"KVPOOLD_FAILPOINTS": failpoints})


def hold(c, n: int = 4):
    """``n`` live sequences with written KV (3 full blocks and a partial one each)."""
    out = []
    for i in range(n):
        toks = prompt(300 + i, 3, extra=5)
        s = c.create_sequence(toks)
        write_sequence(c, s, toks)
        out.append((s, toks))
    return out


def recompute_then_full_hit(c, s, toks, from_block: int) -> None:
    """The client rewrites what the daemon said is missing (blocks ``from_block`` on); then a
    fresh sequence of the prompt is a full prefix hit, byte-exact."""
    write_sequence(c, s, toks, from_block)
    c.free(s)
    s = c.create_sequence(toks)
    assert s.num_cached_tokens == len(toks)
    check_sequence(c, s, toks)
    c.free(s)


def still_served(c, d, held) -> None:
    """The held sequences are intact and usable, cached prompts come back right, the self-check passes."""
    for s, toks in held:
        check_sequence(c, s, toks)
    s, toks = held[0]
    c.extend({s: [7]})
    c.flush()
    for i in range(6):  # whatever is still cached is byte-exact
        t = prompt(i, 16)
        s = c.create_sequence(t)
        check_sequence(c, s, t, s.num_cached_tokens // BS)
        c.free(s)
    ok, detail = c._conn.check()
    assert ok, detail
    assert d.proc.poll() is None and "Traceback" not in d.output()


def test_failed_disk_writes_drop_only_cached_copies(daemon_factory, tmp_path):
    d = start(daemon_factory, tmp_path, failpoints="disk.write=EIO:after=2")
    with kvpool.connect(d.socket, name="w", layout=LAYOUT) as c:
        held = hold(c)
        fill(c, 0, 12)  # 192 blocks through a 64-block pool: demotions to disk, most of whose writes fail
        disk = c.stats().tiers[1]
        assert disk.failed_writes > 0 and disk.dropped_blocks >= disk.failed_writes
        assert disk.blocks + disk.dropped_blocks <= disk.blocks_in  # the failed copies are not counted as present
        still_served(c, d, held)
    assert "writing" in d.output() and "failpoint disk.write" in d.output()


def test_failed_disk_read_is_recomputed(daemon_factory, tmp_path):
    d = start(daemon_factory, tmp_path, failpoints="disk.read=EIO:times=1")
    with kvpool.connect(d.socket, name="r", layout=LAYOUT) as c:
        held = hold(c)
        fill(c, 0, 12)
        toks = prompt(0, 16)
        assert c.lookup(toks) == len(toks)  # on disk
        s = c.create_sequence(toks)
        assert s.num_cached_tokens < len(toks), "the failed read must not be served"
        st = c.stats()
        assert st.tiers[1].failed_reads >= 1 and st.classes[0].lost_blocks >= 1
        check_sequence(c, s, toks, s.num_cached_tokens // BS)
        recompute_then_full_hit(c, s, toks, s.num_cached_tokens // BS)  # the client recomputes from there
        still_served(c, d, held)


def test_swap_out_to_a_failing_disk_reports_the_loss(daemon_factory, tmp_path):
    d = start(daemon_factory, tmp_path, failpoints="disk.write=ENOSPC")
    with kvpool.connect(d.socket, name="s", layout=LAYOUT) as c:
        held = hold(c, 6)
        out = [s for s, _ in held[:2]]
        assert c.swap_out(out) == 8
        fill(c, 1000, 3)  # the swapped blocks' device copies (cached, full ones) are overwritten
        c.swap_in(out)  # the sequences survive; their copies did not: 0 tokens of KV came back
        assert [s.num_cached_tokens for s in out] == [0, 0]
        assert [len(s.block_table) for s in out] == [4, 4]
        st = c.stats()
        assert st.tiers[1].failed_writes >= 8 and st.classes[0].lost_blocks >= 8
        assert st.classes[0].swapped_sequences == 0 and st.tiers[1].pinned_bytes == 0
        for s, toks in held[:2]:
            write_sequence(c, s, toks)  # recomputed
        still_served(c, d, held)


@contextlib.contextmanager
def file_size_limit(nbytes: int):
    """Processes started inside inherit a soft RLIMIT_FSIZE of ``nbytes`` (Python ignores SIGXFSZ: EFBIG)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))


def test_disk_that_fills_up(daemon_factory, tmp_path):
    room = 96  # blocks the "file system" holds; --disk-bytes claims 1024
    d = start(daemon_factory, tmp_path, disk=1024, run=False)
    with file_size_limit(room * BLOCK):
        d.start()
    with kvpool.connect(d.socket, name="full", layout=LAYOUT) as c:
        held = hold(c)
        fill(c, 0, 16)  # 256 blocks through a 64-block pool: more than the disk can take
        disk = c.stats().tiers[1]
        assert disk.failed_writes > 0, "writes past the end of the room must fail"
        assert 0 < disk.blocks <= room
        still_served(c, d, held)
        fill(c, 100, 4)  # and it keeps going
        still_served(c, d, held)
    assert "File too large" in d.output()


def _logged_slot(disk_dir, tokens, block: int, timeout: float = 30.0) -> int:
    """``_slot_of`` once the daemon's background disk write has logged the block: a lookup
    counts a block on its way to disk before its index record is appended."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return _slot_of(disk_dir, tokens, block)
        except AssertionError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def test_block_corrupted_while_running(daemon_factory, tmp_path):
    d = start(daemon_factory, tmp_path)
    with kvpool.connect(d.socket, name="c", layout=LAYOUT) as c:
        held = hold(c)
        fill(c, 0, 12)
        toks = prompt(1, 16)
        assert c.lookup(toks) == len(toks)
        offset = _logged_slot(tmp_path / "disk", toks, 2)
        with open(tmp_path / "disk" / "blocks-1.dat", "r+b") as f:
            f.seek(offset + 7)
            byte = f.read(1)
            f.seek(offset + 7)
            f.write(bytes([byte[0] ^ 0x55]))
        s = c.create_sequence(toks)
        assert s.num_cached_tokens == 2 * BS
        check_sequence(c, s, toks, 2)
        st = c.stats()
        assert st.tiers[1].corrupt_blocks == 1 and st.classes[0].lost_blocks == 1
        recompute_then_full_hit(c, s, toks, 2)  # the client recomputes what it was told is missing
        still_served(c, d, held)
