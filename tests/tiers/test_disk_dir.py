"""The disk tier's directory is the daemon's alone, and nothing planted in it is followed.

The tier holds every tenant's KV and the daemon runs as root: a ``--disk-dir``
another user owns or may write to, or a symbolic (or hard) link put where the
tier keeps a file, would make it overwrite files it does not own or write the
KV where others can read it.  Real daemons, real files, a real second user
(uid 65534) owning a directory.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

import kvpool
from tierlib import LAYOUT, prompt, write_sequence

OTHER_UID = 65534
TIER_FILES = ["blocks-1.dat", "geometries.json", "index.log", "tiers.lock"]


def _start_fails(tier_daemon, disk: Path) -> str:
    """Start a daemon with its disk tier in ``disk``: it must stop at once with exit 2 and one line; the line."""
    return tier_daemon(disk_blocks=64, disk_dir=disk, start=False).start_refused()


def _fill_the_disk_tier(d) -> None:
    """Blocks in every file of the tier: prompts written until some were demoted to disk."""
    with kvpool.connect(d.socket, name="filler", layout=LAYOUT) as c:
        for i in range(12):
            toks = prompt(i, 16)
            s = c.create_sequence(toks)
            write_sequence(c, s, toks)
            c.mark_written(s)
            c.free(s)
        assert c.stats().tiers[-1].blocks > 0


@pytest.fixture
def precious(tmp_path) -> Path:
    """A file of root's, outside the tier, that a link planted in the tier points to."""
    p = tmp_path / "precious"
    p.write_bytes(b"root's own\n")
    p.chmod(0o644)
    return p


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give a directory to another user")
def test_a_directory_of_another_user_is_refused_before_anything_is_written_in_it(tier_daemon, tmp_path):
    disk = tmp_path / "theirs"
    disk.mkdir(mode=0o700)
    os.chown(disk, OTHER_UID, OTHER_UID)
    line = _start_fails(tier_daemon, disk)
    assert f"{disk} belongs to uid {OTHER_UID}, not to kvpoold's user" in line
    assert os.listdir(disk) == []


@pytest.mark.parametrize("mode", [0o777, 0o1777, 0o770, 0o702])
def test_a_directory_group_or_others_may_write_to_is_refused(tier_daemon, tmp_path, mode):
    disk = tmp_path / "open"
    disk.mkdir()
    disk.chmod(mode)
    line = _start_fails(tier_daemon, disk)
    assert f"{disk} is writable by group or others (mode {mode:o})" in line
    assert os.listdir(disk) == []


def test_a_symbolic_link_as_the_directory_is_refused(tier_daemon, tmp_path):
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    (tmp_path / "link").symlink_to(real)
    assert "is a symbolic link" in _start_fails(tier_daemon, tmp_path / "link")
    assert os.listdir(real) == []


@pytest.mark.parametrize("name", TIER_FILES)
@pytest.mark.parametrize("link", ["symbolic", "hard"])
def test_a_link_planted_at_a_tier_file_is_not_followed(tier_daemon, tmp_path, precious, name, link):
    disk = tmp_path / "disk"
    d = tier_daemon(host_blocks=0, disk_blocks=1024, pool_blocks=128, disk_dir=disk)
    _fill_the_disk_tier(d)  # every file of the tier exists (the data file's layout is in geometries.json)
    assert d.stop() == 0
    assert sorted(os.listdir(disk)) == TIER_FILES
    (disk / name).unlink()
    if link == "symbolic":
        (disk / name).symlink_to(precious)
    else:
        os.link(precious, disk / name)
    line = _start_fails(tier_daemon, disk)
    assert f"{disk / name} " in line and "remove it" in line
    assert precious.read_bytes() == b"root's own\n" and stat.S_IMODE(precious.stat().st_mode) == 0o644


@pytest.mark.parametrize("name", ["index.log.tmp", "geometries.json.tmp"])
def test_a_link_planted_at_a_temporary_file_is_replaced_not_followed(tier_daemon, tmp_path, precious, name):
    disk = tmp_path / "disk"
    disk.mkdir(mode=0o700)
    (disk / name).symlink_to(precious)
    d = tier_daemon(host_blocks=0, disk_blocks=1024, pool_blocks=128, disk_dir=disk)
    _fill_the_disk_tier(d)  # a new layout: geometries.json is written; the start compacted index.log
    assert d.stop() == 0
    assert precious.read_bytes() == b"root's own\n"
    assert not (disk / name).exists() and not (disk / name).is_symlink()


def test_the_tier_makes_its_files_private_whatever_the_umask(tier_daemon, tmp_path):
    disk = tmp_path / "fresh"
    old = os.umask(0)  # the daemon inherits it
    try:
        d = tier_daemon(host_blocks=0, disk_blocks=1024, pool_blocks=128, disk_dir=disk)
    finally:
        os.umask(old)
    _fill_the_disk_tier(d)
    assert d.stop() == 0
    assert stat.S_IMODE(disk.stat().st_mode) == 0o700
    for name in TIER_FILES:
        assert stat.S_IMODE((disk / name).stat().st_mode) == 0o600, name
    # a file of the tier that others could read (copied in, restored from a backup) is closed to them
    for name in TIER_FILES:
        (disk / name).chmod(0o644)
    d = tier_daemon(host_blocks=0, disk_blocks=1024, pool_blocks=128, disk_dir=disk)
    with kvpool.connect(d.socket, name="after", layout=LAYOUT) as c:
        assert c.stats().tiers[-1].blocks > 0  # the blocks were found again
    assert d.stop() == 0
    for name in TIER_FILES:
        assert stat.S_IMODE((disk / name).stat().st_mode) == 0o600, name
