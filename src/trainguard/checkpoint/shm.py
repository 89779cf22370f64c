"""Shared-memory slots: one file in a tmpfs directory (``/dev/shm/...``) holds one rank's snapshot.

Handshake: the agent creates the directory and passes it to workers (``TRAINGUARD_CKPT_SHM_DIR``).
A worker creates its own slot files there, ``rank-<global rank>.slot0/1/2`` (three: it never
writes the slot of its newest complete snapshot, nor the one the agent pins; client.NSLOTS says
why), sized when it first saves. The files outlive the worker (a SIGKILL leaves them intact: the bytes are already in the page
cache) and the agent removes the whole directory when it closes, so the agent owns cleanup.

Slot layout: a 4 KiB header page, the JSON manifest at ``manifest_off``, the tensor bytes at
``data_off``. Consistency without locks: the worker sets ``state=WRITING`` before touching a slot
and ``state=COMPLETE`` (with a new ``seq``) after the last byte is in place. The agent pins the slot
it persists (the worker then leaves it alone) and checks that ``(state, seq)`` is unchanged after
reading — a seqlock, so even a race with the pin cannot produce a torn checkpoint on disk.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import mmap
import os
import shutil
import stat
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

MAGIC = b"TGCKSLT1"
VERSION = 1
HEADER_SIZE = 4096
# magic, version, state, seq, step, manifest_off, manifest_len, data_off, data_len, time, rank, world
_HDR = struct.Struct("<8sIIQqQQQQdii")
_STATE = struct.Struct("<I")
_STATE_OFF = 12
_PIN = struct.Struct("<Q")
_PIN_OFF = 512  # written by the agent only; the worker never writes this field
EMPTY, WRITING, COMPLETE = 0, 1, 2
_GROW_QUANTUM = 1 << 20


@dataclass(frozen=True)
class SlotHeader:
    state: int
    seq: int
    step: int
    manifest_off: int
    manifest_len: int
    data_off: int
    data_len: int
    time: float
    rank: int
    world: int
    pin: int

    @property
    def complete(self) -> bool:
        return self.state == COMPLETE


def slot_path(shm_dir: Path, rank: int, index: int) -> Path:
    return Path(shm_dir) / f"rank-{rank:05d}.slot{index}"


def parse_slot_name(name: str) -> tuple[int, int] | None:
    """'rank-00003.slot1' -> (3, 1)"""
    if not name.startswith("rank-") or ".slot" not in name:
        return None
    rank, _, index = name[5:].partition(".slot")
    if not (rank.isdigit() and index.isdigit()):
        return None
    return int(rank), int(index)


def slot_files(directory: Path) -> list[tuple[Path, int]]:
    """(path, rank) of every slot file in ``directory``, by name ([] when it cannot be listed)."""
    try:
        names = sorted(os.listdir(directory))
    except OSError:
        return []
    return [(Path(directory) / n, parsed[0]) for n in names if (parsed := parse_slot_name(n)) is not None]


def read_header(path: Path) -> SlotHeader | None:
    """The header of the slot file at ``path``; None when it is gone, unreadable or no slot."""
    try:
        slot = Slot.open(path)
    except (OSError, ValueError):
        return None
    try:
        return slot.header()
    finally:
        slot.close()


def payload_offsets(manifest_len: int) -> tuple[int, int]:
    """(manifest_off, data_off) for a manifest of this size."""
    data_off = HEADER_SIZE + (manifest_len + HEADER_SIZE - 1) // HEADER_SIZE * HEADER_SIZE
    return HEADER_SIZE, data_off


class Slot:
    """One mapped slot file. The worker creates/grows/writes it; the agent opens it to read and pin."""

    def __init__(self, path: Path, fd: int, populate: bool) -> None:
        self.path = path
        self._fd = fd
        self._populate = populate
        self._mm: mmap.mmap | None = None
        self.size = 0
        self._map()

    @classmethod
    def create(cls, path: Path, size: int) -> Slot:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            _allocate(fd, max(size, HEADER_SIZE))
            return cls(path, fd, populate=True)
        except BaseException:
            os.close(fd)
            raise

    @classmethod
    def open(cls, path: Path, populate: bool = False) -> Slot:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)  # a planted link is no slot
        try:
            return cls(path, fd, populate=populate)
        except BaseException:
            os.close(fd)
            raise

    def _map(self) -> None:
        size = os.fstat(self._fd).st_size
        if size < HEADER_SIZE:
            raise OSError(errno.EINVAL, f"slot {self.path} is too small ({size} bytes)")
        flags = mmap.MAP_SHARED | (getattr(mmap, "MAP_POPULATE", 0) if self._populate else 0)
        self._mm = mmap.mmap(self._fd, size, flags=flags)
        self.size = size

    @property
    def mm(self) -> mmap.mmap:
        assert self._mm is not None, "slot is closed"
        return self._mm

    def grow(self, size: int) -> bool:
        """Make the file at least ``size`` bytes (ENOSPC raised here, never as SIGBUS later).
        Returns True when the mapping changed (callers drop views of the old one first)."""
        if size <= self.size:
            return False
        size = (size + _GROW_QUANTUM - 1) // _GROW_QUANTUM * _GROW_QUANTUM
        _allocate(self._fd, size)
        self.mm.close()
        self._map()
        return True

    def refresh(self) -> bool:
        """Remap when another process grew the file. True when remapped."""
        if os.fstat(self._fd).st_size == self.size:
            return False
        self.mm.close()
        self._map()
        return True

    def is_file(self, path: Path) -> bool:
        """True while ``path`` still names the file this slot maps (not removed or replaced)."""
        try:
            return os.stat(path).st_ino == os.fstat(self._fd).st_ino
        except OSError:
            return False

    def header(self) -> SlotHeader | None:
        fields = _HDR.unpack_from(self.mm, 0)
        if fields[0] != MAGIC or fields[1] != VERSION:
            return None
        (pin,) = _PIN.unpack_from(self.mm, _PIN_OFF)
        return SlotHeader(*fields[2:], pin=pin)

    def begin_write(self, seq: int) -> None:
        # state first: from here on a reader must not trust the slot's bytes.
        _STATE.pack_into(self.mm, _STATE_OFF, WRITING)
        _HDR.pack_into(self.mm, 0, MAGIC, VERSION, WRITING, seq, -1, 0, 0, 0, 0, 0.0, -1, 0)

    def publish(self, seq: int, step: int, manifest_len: int, data_len: int, rank: int, world: int) -> None:
        manifest_off, data_off = payload_offsets(manifest_len)
        _HDR.pack_into(self.mm, 0, MAGIC, VERSION, WRITING, seq, step, manifest_off, manifest_len,
                       data_off, data_len, time.time(), rank, world)
        _STATE.pack_into(self.mm, _STATE_OFF, COMPLETE)  # last store: the snapshot is now valid

    def set_pin(self, seq: int) -> None:
        _PIN.pack_into(self.mm, _PIN_OFF, seq)

    def close(self) -> None:
        if self._mm is not None:
            self._mm.close()
            self._mm = None
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


class SlotCache:
    """The slot files of one directory kept open and mapped across a reader's passes (the agent's
    persister and replication sender poll every few ms: one open + mmap per file per pass would be
    most of their idle cost). A file removed or replaced since is reopened."""

    def __init__(self, directory: Path) -> None:
        self.dir = Path(directory)
        self._slots: dict[str, Slot] = {}

    def get(self, name: str) -> Slot | None:
        slot = self._slots.get(name)
        if slot is not None and not slot.is_file(self.dir / name):  # removed, or a new file
            self.drop(name)
            slot = None
        try:
            if slot is None:
                slot = Slot.open(self.dir / name)
                self._slots[name] = slot
            else:
                slot.refresh()
        except (OSError, ValueError) as exc:  # a worker is creating it right now: next pass
            log.debug("slot %s not readable yet: %s", name, exc)
            return None
        return slot

    def drop(self, name: str) -> None:
        slot = self._slots.pop(name, None)
        if slot is not None:
            slot.close()

    def close(self) -> None:
        for name in list(self._slots):
            self.drop(name)


def _allocate(fd: int, size: int) -> None:
    old = os.fstat(fd).st_size
    if old < size:
        os.ftruncate(fd, size)
    try:
        # Reserve the pages now: writing a tmpfs mapping past its free space would be a SIGBUS.
        os.posix_fallocate(fd, 0, size)
    except OSError as exc:
        if exc.errno in (errno.EOPNOTSUPP, errno.EINVAL):
            return
        if old < size:
            os.ftruncate(fd, old)  # leave no sparse tail that a later write could fault on
        raise


DIR_PREFIX = "trainguard-ckpt-"
_OWNER = ".owner"
_INFO = "owner.json"  # where the owner persists to: a later process rescues orphaned snapshots there
_INFO_MAX = 64 << 10
_owner_fds: dict[Path, int] = {}
_refusals_said: set[Path] = set()  # one warning per refused directory and process
log = logging.getLogger(__name__)

# on_orphan(dir): rescue what a dead owner left; False (or raising RescueRefused) keeps the
# directory where it is (not ours to remove: another job's), anything else lets it be removed.
OnOrphan = Callable[[Path], "bool | None"]
OnRefused = Callable[[Path, str], None]  # on_refused(dir, why): a directory not ours to rescue or remove


class RescueRefused(Exception):
    """Raised by an on_orphan callback: the orphan's snapshots are not this process's to persist
    (another job's); the directory is left where it is and reported as refused."""


def make_shm_dir(root: Path, info: dict[str, Any] | None = None, on_orphan: OnOrphan | None = None,
                 on_refused: OnRefused | None = None) -> Path:
    """A fresh private directory for one agent's (or one local process's) slots. The creating
    process holds an flock on ``.owner`` inside it for as long as it lives, so any later process
    can tell (across PID namespaces too) that the directory is orphaned. ``info`` (e.g. the
    checkpoint dir) is kept in the directory for whoever finds it orphaned; ``on_orphan(dir)`` is
    called for each orphaned directory of ours found on the way, before it is removed; and
    ``on_refused(dir, why)`` for one that looks orphaned but is not ours (see ``remove_stale_dirs``)."""
    remove_stale_dirs(root, on_orphan, on_refused)
    path = Path(root) / f"{DIR_PREFIX}{os.getpid()}-{os.urandom(4).hex()}"
    path.mkdir(mode=0o700)
    # Locked before it gets its name: whoever can open ``.owner`` finds it locked while we live.
    lock = os.open(path / f"{_OWNER}.tmp", os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    os.rename(path / f"{_OWNER}.tmp", path / _OWNER)
    _owner_fds[path] = lock
    if info is not None:
        tmp = path / f".{_INFO}.tmp"
        out = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        with open(out, "wb") as f:
            f.write(json.dumps(info).encode())
        os.replace(tmp, path / _INFO)
    return path


def read_dir_info(path: Path) -> dict[str, Any]:
    """The ``info`` a directory's owner left ({} when none, unreadable or a symlink)."""
    try:
        fd = os.open(Path(path) / _INFO, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        with open(fd, "rb") as f:
            info = json.loads(f.read(_INFO_MAX))
    except (OSError, ValueError, RecursionError):
        return {}
    return info if isinstance(info, dict) else {}


def owner_pid(path: Path) -> int | None:
    pid = Path(path).name[len(DIR_PREFIX) :].partition("-")[0]
    return int(pid) if pid.isdigit() else None


def release_shm_dir(path: Path) -> None:
    """Remove a directory made by ``make_shm_dir`` (the agent's cleanup)."""
    shutil.rmtree(path, ignore_errors=True)
    fd = _owner_fds.pop(Path(path), None)
    if fd is not None:
        os.close(fd)


def remove_stale_dirs(root: Path, on_orphan: OnOrphan | None = None, on_refused: OnRefused | None = None) -> list[Path]:
    """Remove slot directories whose owner process is gone (an agent killed with SIGKILL), after
    ``on_orphan(dir)`` (persisting the snapshots the dead owner held). The orphan's lock is held
    meanwhile, so two processes starting at once never both rescue or remove it.

    Only a real directory of this user's, not writable by group or others, counts: any local user
    can create ``trainguard-ckpt-*`` in /dev/shm, and a planted one would otherwise decide where
    this process writes checkpoints, what it prunes and what its workers resume from. Any other
    directory whose owner pid is gone is left as it is, with ``on_refused(dir, why)`` (default: one
    warning line) once per process."""
    removed = []
    try:
        names = os.listdir(root)
    except OSError:
        return removed
    for name in names:
        path = Path(root) / name
        if not name.startswith(DIR_PREFIX) or path in _owner_fds:
            continue
        claim = _claim_orphan(path)
        if isinstance(claim, str):
            _refused(path, claim, on_refused)
            continue
        if claim is None:
            continue
        try:
            keep = False
            if on_orphan is not None:
                try:
                    keep = on_orphan(path) is False
                except RescueRefused as exc:
                    _refused(path, str(exc), on_refused)
                    keep = True
                except Exception as exc:  # a failed rescue is reported by the callback; clean up anyway
                    log.warning("checkpoint: rescuing snapshots from %s failed: %s", path, exc)
            if not keep:
                shutil.rmtree(path, ignore_errors=True)
                removed.append(path)
        finally:
            if claim >= 0:
                os.close(claim)
    return removed


def _refused(path: Path, why: str, on_refused: OnRefused | None) -> None:
    if path in _refusals_said:
        return
    _refusals_said.add(path)
    if on_refused is not None:
        on_refused(path, why)
    else:
        log.warning("checkpoint: refused to rescue %s: %s; left as it is", path, why)


def _claim_orphan(path: Path) -> int | str | None:
    """The orphan's lock (an fd to close after removing it; -1 for a directory without one); None
    when the directory is alive (or gone); why not, for an orphan that is not ours to touch."""
    try:
        dfd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError as exc:  # a symlink (ELOOP), a file (ENOTDIR), another user's 0700 dir (EACCES)
        return _foreign(path, exc)
    try:
        st = os.fstat(dfd)  # of what was opened: no lstat-then-open race
        why = _not_ours(st)
        if why is not None:
            return why if _pid_gone(path) else None
        try:
            fd = os.open(_OWNER, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dfd)
        except FileNotFoundError:
            # Not made by make_shm_dir (or still being made): fall back to the PID in the name.
            return -1 if _pid_gone(path) else None
        except OSError as exc:
            return f"its {_OWNER} cannot be opened safely ({exc.strerror or exc})" if _pid_gone(path) else None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return None  # its owner holds the lock: alive
        return fd
    finally:
        os.close(dfd)


def _not_ours(st: os.stat_result) -> str | None:
    if st.st_uid != os.geteuid():
        return f"owned by uid {st.st_uid}, not us (uid {os.geteuid()})"
    if st.st_mode & 0o022:
        return f"writable by group or others (mode {stat.S_IMODE(st.st_mode):04o})"
    return None


def _foreign(path: Path, exc: OSError) -> str | None:
    """Why a directory that cannot be opened as ours is refused (None: it looks alive)."""
    if not _pid_gone(path):
        return None
    try:
        st = os.lstat(path)  # for the message only: the directory is refused either way
    except OSError:
        return None
    if stat.S_ISLNK(st.st_mode):
        return "a symlink, not a directory"
    if not stat.S_ISDIR(st.st_mode):
        return "not a directory"
    return _not_ours(st) or f"cannot be opened ({exc.strerror or exc})"


def _pid_gone(path: Path) -> bool:
    pid = owner_pid(path)
    return pid is None or not psutil.pid_exists(pid)
