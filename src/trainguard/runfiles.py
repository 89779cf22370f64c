"""The one safe way to open a file in a run directory.

A run directory is shared: other users' processes, a careless script or a hostile one can put a
symlink, a FIFO or a device where trainguard expects one of its files. Every file trainguard reads
from a run dir for a user (the dashboard, status, trace), and every file it writes there or for a
user (``trace -o``, the event databases), goes through this module:

- opened with ``O_NOFOLLOW`` (a symlink in the last component is refused, dangling ones included)
  and ``O_NONBLOCK`` (a FIFO cannot block the open), then checked with ``fstat`` to be a regular
  file — the check is on the file that was opened, not on a name that may have changed since;
- written by creating a new file next to the target (``O_CREAT | O_EXCL | O_NOFOLLOW``) and renaming
  it over the target, only when the target is missing or a regular file that is not protected (the
  run's own event databases).

Errors are ``UnsafeFile`` (an ``OSError``), whose message is one line naming the path.
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO


class UnsafeFile(OSError):
    """A path that is not a regular file of its own (a symlink, a FIFO, a device, a directory)."""

    def __str__(self) -> str:  # the one line a command prints, without "[Errno 1]"
        return str(self.strerror)


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a device"),
                       (stat.S_ISBLK, "a device"), (stat.S_ISSOCK, "a socket"), (stat.S_ISLNK, "a symlink")):
        if test(mode):
            return name
    return "not a regular file"


def refuse(path: str | Path, why: str) -> UnsafeFile:
    return UnsafeFile(errno.EPERM, f"{path} is {why}, not a regular file: refused")


def open_fd(path: str | Path, flags: int = os.O_RDONLY, mode: int = 0o600) -> int:
    """An fd of ``path``, a regular file reached without following a symlink; UnsafeFile else.
    Something else at ``path`` is refused before it is opened (opening a device can act on it)."""
    kind = _lkind(path)
    if kind not in ("a regular file", "missing"):
        raise refuse(path, kind)
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, mode)
    except OSError as exc:
        if exc.errno == errno.ELOOP:  # O_NOFOLLOW on a symlink
            raise refuse(path, "a symlink") from None
        if exc.errno in (errno.ENXIO, errno.ENODEV, errno.EISDIR):  # a FIFO without reader, a socket, a dir
            raise refuse(path, _lkind(path)) from None
        raise
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise refuse(path, _kind(st.st_mode))
    os.set_blocking(fd, True)
    return fd


def _lkind(path: str | Path) -> str:
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return "missing"
    except OSError:
        return "not a regular file"
    return "a regular file" if stat.S_ISREG(mode) else _kind(mode)


def open_read(path: str | Path, text: bool = False) -> IO:
    """``path`` opened for reading (binary, or UTF-8 text with bad bytes replaced)."""
    fd = open_fd(path, os.O_RDONLY)
    if text:
        return open(fd, encoding="utf-8", errors="replace")
    return open(fd, "rb")


def read_text(path: str | Path, limit: int = 1 << 20) -> str:
    with open_read(path, text=True) as f:
        return f.read(limit)


def is_regular(path: str | Path) -> bool:
    """Whether ``path`` itself (not what a symlink points to) is a regular file."""
    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except OSError:
        return False


def check_target(path: str | Path, protect: Iterable[str | Path] = ()) -> None:
    """Refuse to replace ``path`` unless it is missing or a regular file that is none of ``protect``."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISREG(st.st_mode):
        raise refuse(path, _kind(st.st_mode))
    for p in protect:
        try:
            other = os.stat(p)
        except OSError:
            continue
        if (other.st_dev, other.st_ino) == (st.st_dev, st.st_ino):
            raise UnsafeFile(errno.EPERM, f"{path} is the run's event database {p}: refused")


@contextmanager
def replace(path: str | Path, protect: Iterable[str | Path] = (), mode: int = 0o600) -> Iterator[IO[bytes]]:
    """A binary file to write that becomes ``path`` when the block ends without error (and is
    removed otherwise). ``path`` must be missing or a regular file none of ``protect`` is."""
    path = Path(path)
    protect = list(protect)
    check_target(path, protect)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = open_fd(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    try:
        with open(fd, "wb") as f:
            yield f
        check_target(path, protect)  # again: it may have been swapped while we wrote
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def create_regular(path: str | Path, mode: int = 0o600) -> None:
    """Make sure ``path`` is a regular file (created empty when missing), reached without a
    symlink: before a library (SQLite) opens it by name."""
    os.close(open_fd(path, os.O_RDWR | os.O_CREAT, mode))


def private_dirs(path: str | Path) -> None:
    """``mkdir -p`` whose every directory it creates is owner-only, whatever the umask (``Path.mkdir``
    gives ``mode`` to the last one only); directories that exist are left as they are."""
    path = Path(path)
    missing = []
    while not path.is_dir() and path != path.parent:
        missing.append(path)
        path = path.parent
    for d in reversed(missing):
        try:
            d.mkdir(mode=0o700)
        except FileExistsError:  # made meanwhile by another process; a file there fails later
            pass


def safe_dir(path: str | Path) -> None:
    """Refuse a directory that is a symlink (its files would be written elsewhere)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISDIR(st.st_mode):
        raise UnsafeFile(errno.EPERM, f"{path} is {_kind(st.st_mode)}, not a directory: refused")
