"""The daemon's socket paths and the lock files beside them, safe where other users can write.

A socket may live in a directory others can write to (``/tmp``, sticky and
world-writable): whatever is at a socket path or a lock path when the daemon
starts may have been put there by someone else.  So the daemon

* removes only a socket at a socket path (``clear_stale_socket``: a stale one
  of a daemon that is gone); a regular file, a directory, a symbolic link or
  anything else there stops the start with one line;
* opens its lock file without following a link, and uses it only if it is a
  regular file of its own user with one link: it truncates nothing that is
  not its own, and never prints what another user wrote there (``SocketLock``);
* changes the mode and group of a socket it bound, and removes it at the end,
  only through the socket it bound (``BoundSocket``), never through a link
  that replaced it meanwhile.

Every refusal is ``PathRefused``, whose message is the one line the daemon
prints before it exits with 2.
"""

from __future__ import annotations

import fcntl
import os
import stat

from .logsafe import printable


class PathRefused(RuntimeError):
    """A socket or lock path the daemon will not use; the message says why and what to do."""


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISREG, "a regular file"), (stat.S_ISDIR, "a directory"),
                       (stat.S_ISLNK, "a symbolic link"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return name
    return "a device or other special file"


def ensure_directory(path: str, what: str) -> None:
    """Make the directory of ``path`` (``what`` names the path in messages) when it is missing."""
    directory = os.path.dirname(path) or "."
    try:
        os.makedirs(directory, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        raise PathRefused(f"the directory of {what} {path} is not a directory: choose another path") from None
    except OSError as exc:
        raise PathRefused(f"cannot create the directory of {what} {path}: {exc.strerror}") from None


def clear_stale_socket(path: str, what: str) -> None:
    """Remove a socket at ``path`` (the caller holds its lock: nobody serves it); refuse anything else there.

    ``what`` names the path in the message (``--socket``, ``the side socket``...).
    """
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    except NotADirectoryError:
        raise PathRefused(f"the directory of {what} {path} is not a directory: choose another path") from None
    if not stat.S_ISSOCK(st.st_mode):
        raise PathRefused(f"{what} {path} is {_kind(st.st_mode)}, not a socket: remove it or choose another path")
    os.unlink(path)


class BoundSocket:
    """A socket file this daemon bound: its mode, group and removal go through it, never through a name
    that someone replaced by a link meanwhile."""

    def __init__(self, path: str, what: str) -> None:
        """Right after binding ``path``: remember which file it is."""
        self.path, self.what = path, what
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            st = None
        if st is None or not stat.S_ISSOCK(st.st_mode):
            raise PathRefused(f"{what} {path} was removed or replaced as it was made: choose a directory only "
                              "this user can write to")
        self._id = (st.st_dev, st.st_ino)

    def _ours(self) -> int | None:
        """An O_PATH descriptor of ``path`` if it still is the socket bound, else None."""
        try:
            fd = os.open(self.path, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            return None
        st = os.fstat(fd)
        if (st.st_dev, st.st_ino) != self._id:
            os.close(fd)
            return None
        return fd

    def set_access(self, mode: int, gid: int | None = None) -> None:
        """chmod (and chgrp to ``gid``) the socket bound; ``PathRefused`` if it is no longer at its path."""
        fd = self._ours()
        if fd is None:
            raise PathRefused(f"{self.what} {self.path} was replaced after it was made: choose a directory only "
                              "this user can write to")
        try:
            # an O_PATH descriptor takes no fchmod; its /proc link reaches this very inode, not a name
            via = f"/proc/self/fd/{fd}"
            if gid is not None:
                os.chown(via, -1, gid)
            os.chmod(via, mode)
        finally:
            os.close(fd)

    def remove(self) -> None:
        """Unlink the path if it still is the socket bound (else leave whatever is there alone)."""
        fd = self._ours()
        if fd is None:
            return
        os.close(fd)
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass


class SocketLock:
    """An exclusive lock beside the socket: one daemon per socket path."""

    def __init__(self, socket_path: str) -> None:
        self.path = socket_path + ".lock"
        self._fd: int | None = None

    def acquire(self) -> None:
        ensure_directory(self.path, "the lock file")
        fd = self._open()
        try:
            self._check(fd)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                owner = printable(os.pread(fd, 32, 0).strip(), limit=32) or "unknown"
                raise PathRefused(f"another kvpoold (pid {owner}) is already serving {self.path[:-5]}; "
                                  "stop it first or choose another --socket") from None
        except BaseException:
            os.close(fd)
            raise
        os.ftruncate(fd, 0)  # only now: a file of our own, locked by us
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd = fd

    def _open(self) -> int:
        flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC  # O_NONBLOCK: not hung by a FIFO
        try:
            return os.open(self.path, flags, 0o644)
        except OSError as exc:
            try:
                mode = os.lstat(self.path).st_mode
            except OSError:
                mode = stat.S_IFREG
            if not stat.S_ISREG(mode):  # a link, a directory...: what is there, not the errno it gave
                raise PathRefused(f"lock file {self.path} is {_kind(mode)}: remove it or choose another "
                                  "--socket") from None
            raise PathRefused(f"cannot open lock file {self.path}: {exc.strerror}") from None

    def _check(self, fd: int) -> None:
        """Refuse a lock file this daemon's user did not make: another user's, a link to another file."""
        st = os.fstat(fd)
        why = None
        if not stat.S_ISREG(st.st_mode):
            why = f"is {_kind(st.st_mode)}"
        elif st.st_uid != os.geteuid():
            why = f"belongs to uid {st.st_uid}, not to this user (uid {os.geteuid()})"
        elif st.st_nlink != 1:
            why = "has other links (a hard link to another file)"
        if why is not None:
            raise PathRefused(f"lock file {self.path} {why}: remove it or choose another --socket")

    def release(self) -> None:
        """Unlock, and remove the lock file if its path still names it."""
        if self._fd is None:
            return
        try:
            st, mine = os.lstat(self.path), os.fstat(self._fd)
            if (st.st_dev, st.st_ino) == (mine.st_dev, mine.st_ino):
                os.unlink(self.path)
        except FileNotFoundError:
            pass
        os.close(self._fd)
        self._fd = None
