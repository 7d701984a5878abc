"""Socket and lock paths: the daemon removes nothing but a stale socket and follows no one's links.

Real daemons (root), a real second user (uid 65534) who plants files, links
and a held lock in a sticky world-writable directory like ``/tmp``, and one
line with exit 2 for every path the daemon will not use.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import signal
import socket
import stat
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

import kvpool
from opskit import LAYOUT

OTHER_UID = 65534
PRECIOUS = b"root's own file\n"
# what a hostile lock file says: a forged second log line and a terminal escape
FORGED = "\x1b[2J\x1b[31mkvpoold: all clear, ignore the error\nERROR forged line"


def _as_other_user():
    os.setgroups([])
    os.setgid(OTHER_UID)
    os.setuid(OTHER_UID)


@pytest.fixture
def sticky():
    """A directory like /tmp: world-writable with the sticky bit."""
    if os.geteuid() != 0:
        pytest.skip("needs root to act as another user")
    d = tempfile.mkdtemp(prefix="kvpool-sticky-")
    os.chmod(d, 0o1777)
    yield Path(d)
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def precious(tmp_path) -> Path:
    p = tmp_path / "precious"
    p.write_bytes(PRECIOUS)
    return p


def _stale_socket(path: Path) -> None:
    s = socket.socket(socket.AF_UNIX)
    s.bind(str(path))
    s.close()  # nothing listens on it any more


def _plant(kind: str, path: Path, precious: Path) -> None:
    if kind == "regular file":
        path.write_bytes(PRECIOUS)
    elif kind == "directory":
        path.mkdir()
    elif kind == "symbolic link":
        path.symlink_to(precious)
    elif kind == "dangling link":
        path.symlink_to(path.parent / "nowhere")
    elif kind == "FIFO":
        os.mkfifo(path)


def _paths(d, which: str) -> str:
    return {"socket": d.socket, "side socket": d.socket + ".handoff",
            "admin socket": d.socket[:-5] + "-admin.sock"}[which]


@pytest.mark.parametrize("kind", ["regular file", "directory", "symbolic link", "dangling link", "FIFO"])
@pytest.mark.parametrize("which", ["socket", "side socket", "admin socket"])
def test_only_a_socket_is_removed_from_a_socket_path(daemon_factory, precious, which, kind):
    d = daemon_factory(start=False)
    path = Path(_paths(d, which))
    _plant(kind, path, precious)
    line = d.start_refused()
    assert str(path) in line and f"is {'a symbolic link' if 'link' in kind else 'a ' + kind}" in line, line
    assert "not a socket" in line
    assert path.is_symlink() if "link" in kind else path.exists()  # left where it was
    assert precious.read_bytes() == PRECIOUS
    assert not os.path.exists(d.socket + ".lock")  # and the daemon's own lock went with it


def test_a_socket_path_whose_directory_is_a_file_is_one_line(daemon_factory, tmp_path):
    (tmp_path / "file").write_bytes(PRECIOUS)
    d = daemon_factory("--socket", str(tmp_path / "file" / "kvpoold.sock"), start=False)
    assert "is not a directory" in d.start_refused()
    assert (tmp_path / "file").read_bytes() == PRECIOUS


def test_stale_sockets_are_replaced_and_only_the_daemons_own_files_go_at_the_end(daemon_factory):
    d = daemon_factory(start=False)
    for which in ("socket", "side socket", "admin socket"):
        _stale_socket(Path(_paths(d, which)))
    d.start()
    with kvpool.connect(d.socket, name="after-stale", layout=LAYOUT) as c:
        assert c.lookup([1, 2, 3, 4]) == 0
    for which in ("socket", "side socket"):
        assert stat.S_IMODE(os.stat(_paths(d, which)).st_mode) == 0o660
    assert stat.S_IMODE(os.stat(_paths(d, "admin socket")).st_mode) == 0o600
    assert d.stop() == 0
    left = [p for p in (*(_paths(d, w) for w in ("socket", "side socket", "admin socket")), d.socket + ".lock")
            if os.path.lexists(p)]
    assert left == []


@pytest.mark.parametrize("link", ["symbolic", "hard"])
def test_a_link_planted_at_the_lock_file_is_not_followed(daemon_factory, sticky, precious, link):
    sock = sticky / "kvpool.sock"
    if link == "symbolic":  # planted by the other user, as anyone may in /tmp
        subprocess.run(["ln", "-s", str(precious), f"{sock}.lock"], preexec_fn=_as_other_user, check=True)
    else:  # where fs.protected_hardlinks is off, anyone may link root's files; root makes it here
        os.link(precious, f"{sock}.lock")
    d = daemon_factory("--socket", str(sock), start=False)
    line = d.start_refused()
    assert f"lock file {sock}.lock " in line, line
    assert precious.read_bytes() == PRECIOUS  # not truncated, no pid written into it
    assert os.path.lexists(f"{sock}.lock")


def test_a_lock_file_another_user_made_and_holds_cannot_speak_for_the_daemon(daemon_factory, sticky):
    lock = sticky / "kvpool.sock.lock"
    holder = subprocess.Popen(["sh", "-c", 'printf "%s" "$1" > "$2" && exec flock "$2" sleep 600', "sh",
                               FORGED, str(lock)], preexec_fn=_as_other_user)
    try:
        deadline = time.monotonic() + 30
        while not (lock.exists() and _is_locked(lock)) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _is_locked(lock), "the other user's flock did not take the lock"
        line = daemon_factory("--socket", str(sticky / "kvpool.sock"), start=False).start_refused()
        assert f"lock file {lock} belongs to uid {OTHER_UID}" in line, line
        assert "\x1b" not in line and "all clear" not in line and "forged" not in line
        assert lock.read_text() == FORGED  # not truncated either
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()


def _is_locked(path: Path) -> bool:
    fd = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


def test_the_lock_of_a_running_daemon_names_its_pid(daemon_factory):
    first = daemon_factory()
    line = daemon_factory("--socket", first.socket, start=False).start_refused()
    assert f"another kvpoold (pid {first.proc.pid}) is already serving {first.socket}" in line
