"""The disk tier's directory and data files: opened safely, replaced atomically, read and written in batches.

Every file is opened relative to the directory's descriptor, never through a
symbolic link, and only if it is a regular file of the daemon's user with one
link (``open_in``); see ``disk`` for why.
"""

from __future__ import annotations

import errno
import os
import stat

import numpy as np

from .slots import SlotAllocator

ALIGN = 4096


class DiskTierError(RuntimeError):
    """The disk tier cannot be used (directory, lock, permissions); the message says why."""


def aligned(view: np.ndarray) -> bool:
    return view.ctypes.data % ALIGN == 0 and view.nbytes % ALIGN == 0


def open_private_dir(path: str) -> int:
    """A descriptor of the directory ``path`` (made, mode 0700, when missing) that only this user can change.

    ``DiskTierError`` (one line) for a symbolic link or a non-directory at
    ``path``, a directory of another user, or one that group or others may
    write to: anyone who can write there can plant links the daemon would follow.
    """
    try:
        os.makedirs(path, mode=0o700, exist_ok=True)
    except FileExistsError:
        pass  # something else than a directory is there: the open below says what
    except OSError as exc:
        raise DiskTierError(f"cannot create the disk tier's directory {path}: {exc.strerror}") from None
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        raise DiskTierError(f"the disk tier's directory {path} {what_is_wrong(exc, path)}: give a directory of "
                            "kvpoold's own") from None
    st = os.fstat(fd)
    why = None
    if st.st_uid != os.geteuid():
        why = (f"belongs to uid {st.st_uid}, not to kvpoold's user (uid {os.geteuid()}): give a directory of "
               "kvpoold's own")
    elif st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        why = (f"is writable by group or others (mode {stat.S_IMODE(st.st_mode):o}): remove their write permission "
               "(chmod go-w) or give another directory")
    elif not os.access(".", os.W_OK | os.X_OK, dir_fd=fd):
        why = "is not writable by this user"
    if why is not None:
        os.close(fd)
        raise DiskTierError(f"the disk tier's directory {path} {why}")
    return fd


def what_is_wrong(exc: OSError, name: str, dir_fd: int | None = None) -> str:
    """Why opening ``name`` (relative to ``dir_fd``) without following a link failed, in words."""
    try:
        mode = os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode
    except OSError:
        mode = 0
    if stat.S_ISLNK(mode):
        return "is a symbolic link"
    if exc.errno == errno.ENOTDIR:
        return "is not a directory"
    return f"cannot be opened: {exc.strerror}"


def open_in(dir_fd: int, where: str, name: str, flags: int, *, create: bool) -> int:
    """Open ``name`` in the tier's directory (``dir_fd``; ``where`` names it in messages), never through a
    symbolic link; ``create``: made, mode 0600, when missing.

    Anything but a regular file of this user with a single link is refused
    (``DiskTierError``): the daemon made none such, so someone else put it there.
    FileNotFoundError when it is missing and not ``create``.
    """
    # O_NOFOLLOW holds with O_CREAT too (a link there fails, dangling or not); O_NONBLOCK: a FIFO cannot hang us
    flags |= os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC | (os.O_CREAT if create else 0)
    path = os.path.join(where, name)
    try:
        fd = os.open(name, flags, 0o600, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno == errno.ENOENT:
            raise
        raise DiskTierError(f"disk tier: {path} {what_is_wrong(exc, name, dir_fd)}; kvpoold made no such file: "
                            "remove it") from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_nlink != 1:
        os.close(fd)
        raise DiskTierError(f"disk tier: {path} is not a file kvpoold made (a regular file of uid {os.geteuid()} "
                            "with one link): remove it")
    if st.st_mode & 0o077:
        os.fchmod(fd, 0o600)  # every tenant's KV: for this user's eyes only
    return fd


def write_atomic(dir_fd: int, name: str, data: bytes) -> None:
    """Replace ``name`` in ``dir_fd`` with ``data``: a fresh temporary file, fsynced, renamed over it."""
    tmp = name + ".tmp"
    try:
        os.unlink(tmp, dir_fd=dir_fd)  # a leftover of a crash; never opened, so never followed
    except FileNotFoundError:
        pass
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dir_fd)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)  # a link at ``name`` is replaced, not followed
    os.fsync(dir_fd)


def pwritev_all(fd: int, bufs: list, offset: int) -> None:
    total = sum(b.nbytes for b in bufs)
    done = os.pwritev(fd, bufs, offset)
    if done == total:
        return
    flat = memoryview(b"".join(bytes(b) for b in bufs))[done:]  # rare: a short write
    pos = offset + done
    while flat:
        n = os.pwrite(fd, flat, pos)
        if n <= 0:
            raise OSError(errno.EIO, "short write")
        flat, pos = flat[n:], pos + n


def preadv_all(fd: int, bufs: list, offset: int) -> None:
    total = sum(b.nbytes for b in bufs)
    done = os.preadv(fd, bufs, offset)
    if done == total:
        return
    pos = 0
    for b in bufs:  # rare: a short read; finish buffer by buffer
        mv = memoryview(b).cast("B")
        if done >= pos + mv.nbytes:
            pos += mv.nbytes
            continue
        got = max(0, done - pos)
        while got < mv.nbytes:
            n = os.preadv(fd, [mv[got:]], offset + pos + got)
            if n <= 0:
                raise OSError(errno.EIO, f"read past the end of the data file at {offset + pos + got}")
            got += n
        pos += mv.nbytes
        done = pos


def vectored(io, f, bufs: list, offset: int) -> None:
    """``io`` (``pwritev_all`` / ``preadv_all``) through O_DIRECT when ``f`` has it and every
    buffer is aligned; buffered when not, or when the kernel refuses this one (EINVAL)."""
    direct = f.dfd is not None and all(aligned(b) for b in bufs)
    try:
        io(f.dfd if direct else f.fd, bufs, offset)
    except OSError as exc:
        if not direct or exc.errno != errno.EINVAL:
            raise
        io(f.fd, bufs, offset)


class DataFile:
    def __init__(self, dir_fd: int, where: str, name: str, stride: int, use_direct: bool) -> None:
        self.path = os.path.join(where, name)
        self.stride = stride
        self.fd = open_in(dir_fd, where, name, os.O_RDWR, create=True)
        self.dfd = None
        if use_direct and hasattr(os, "O_DIRECT"):
            try:
                self.dfd = os.open(name, os.O_RDWR | os.O_DIRECT | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
            except OSError:
                self.dfd = None  # e.g. tmpfs: buffered I/O only
            if self.dfd is not None and not same_file(self.fd, self.dfd):
                os.close(self.dfd)
                self.dfd = None
        self.slots = SlotAllocator(None, ALIGN)

    def close(self) -> None:
        for fd in (self.fd, self.dfd):
            if fd is not None:
                try:
                    os.close(fd)
                except OSError:
                    pass
        self.fd = self.dfd = None


def same_file(a: int, b: int) -> bool:
    sa, sb = os.fstat(a), os.fstat(b)
    return (sa.st_dev, sa.st_ino) == (sb.st_dev, sb.st_ino)
