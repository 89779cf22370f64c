"""Profiling on disk: the runtime switch file, per-rank record files, rotation and aging.

Rules from the seed (MindCluster TaskD lightweight profiling):

- records go under ``RUN_DIR/profiling/<rank>/``, in files named by a timestamp (digits only:
  unix milliseconds), one record per line, always appended to the rank's newest file;
- with ``MINDX_TASK_ID`` set, or a profiling root given (``--profiling-root DIR``), they go to the
  seed's layout instead: ``<root>/<task id>/<rank>/``, the root ``/user/cluster-info/profiling``
  unless given, the task folder ``default_task_id_<timestamp>`` without a task id. The run dir then
  holds ``profiling-location.json`` naming that folder, so its readers (trace, status, dashboard)
  find the records;
- when the newest file exceeds 10 MB a new file is started;
- when the profiling directory (the root, with the seed's layout: every task's folder) reaches its
  cap, the oldest 20 % of the files (by modification time; the fraction is configurable) are
  deleted — only digit-named files inside rank directories, never anything else. Agents sharing
  the directory age it one at a time: the one holding the flock of ``.trainguard-aging.lock`` in
  it does (another takes over when it ends).

The switch is ``RUN_DIR/profiling-switch.json``, in the seed's ConfigMap format::

    {"CommunicationOperator": "off", "Step": "on", "SaveCheckpoint": "on", "FP": "on", "DataLoader": "on"}

written by ``trainguard profile`` (atomically) and watched by every agent of the run.
"""

from __future__ import annotations

import errno
import fcntl
import json
import math
import os
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from trainguard import runfiles
from trainguard.worker.ring import FLAG_BASIC, FLAG_COMM

SWITCH_FILE = "profiling-switch.json"
PROFILING_DIR = "profiling"
ROTATE_BYTES = 10 * 1024 * 1024
AGING_FRACTION = 0.2
DEFAULT_ROOT = "/user/cluster-info/profiling"  # TaskD's folder in the container (seed 002)
TASK_ID_ENV = "MINDX_TASK_ID"
DEFAULT_TASK_PREFIX = "default_task_id_"
LOCATION_FILE = "profiling-location.json"  # in the run dir: where its records are, when not in it
AGING_LOCK = ".trainguard-aging.lock"  # not digit-named: never a rank dir or a record file
BASIC_KEYS = ("Step", "SaveCheckpoint", "FP", "DataLoader")
COMM_KEY = "CommunicationOperator"


# ---- the switch ---------------------------------------------------------------------------------
def switch_dict(flags: int) -> dict[str, str]:
    basic = "on" if flags & FLAG_BASIC else "off"
    d = {COMM_KEY: "on" if flags & FLAG_COMM else "off"}
    d.update({k: basic for k in BASIC_KEYS})
    return d


def flags_from_switch(d: dict) -> int:
    """Switch word from the seed's JSON; raises ValueError on anything the seed does not allow."""
    if not isinstance(d, dict):
        raise ValueError("profiling switch must be a JSON object")
    values = {}
    for key in (*BASIC_KEYS, COMM_KEY):
        v = d.get(key, "off")
        if v not in ("on", "off"):
            raise ValueError(f"profiling switch: {key} must be 'on' or 'off', got {v!r}")
        values[key] = v == "on"
    basic = {values[k] for k in BASIC_KEYS}
    if len(basic) != 1:
        raise ValueError("profiling switch: Step, SaveCheckpoint, FP and DataLoader switch on and off together")
    if values[COMM_KEY] and not values["Step"]:
        raise ValueError("profiling switch: CommunicationOperator can be on only while Step/FP/DataLoader/SaveCheckpoint are on")
    return (FLAG_BASIC if values["Step"] else 0) | (FLAG_COMM if values[COMM_KEY] else 0)


def write_switch(run_dir: Path, flags: int) -> Path:
    flags_from_switch(switch_dict(flags))  # refuse a state the seed forbids (Communication alone)
    path = Path(run_dir) / SWITCH_FILE
    # Replaced by a new regular file: never written through a symlink or into a FIFO (runfiles.py).
    with runfiles.replace(path) as f:
        f.write((json.dumps(switch_dict(flags)) + "\n").encode())
    return path


def read_switch(run_dir: Path) -> int | None:
    """Switch word from the run's switch file; None when there is none. Raises ValueError if bad
    (not JSON, or not a regular file: a FIFO there must not block the agent's thread)."""
    path = Path(run_dir) / SWITCH_FILE
    try:
        text = runfiles.read_text(path, 1 << 16)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise ValueError(str(exc)) from None
    try:
        return flags_from_switch(json.loads(text))
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not JSON: {exc}") from None
    except (AttributeError, TypeError) as exc:  # JSON, but not an object of switches
        raise ValueError(f"{path}: not a profiling switch: {exc}") from None


# ---- record files -------------------------------------------------------------------------------
def _numbered(rank_dir: Path) -> list[Path]:
    try:
        return [p for p in rank_dir.iterdir() if p.name.isdigit() and runfiles.is_regular(p)]
    except FileNotFoundError:
        return []


class RankFileWriter:
    """Appends lines to ``<profiling>/<rank>/<timestamp ms>``, starting a new file past the limit."""

    def __init__(self, profiling_dir: Path, rank: int, rotate_bytes: int = ROTATE_BYTES) -> None:
        self.dir = Path(profiling_dir) / str(rank)
        self.rotate_bytes = rotate_bytes
        self.current: Path | None = None

    def _latest(self) -> Path | None:
        files = _numbered(self.dir)
        return max(files, key=lambda p: int(p.name)) if files else None

    def _new_file(self) -> Path:
        stamp = int(time.time() * 1000)
        latest = self._latest()
        if latest is not None and int(latest.name) >= stamp:
            stamp = int(latest.name) + 1  # names stay unique and increasing
        return self.dir / str(stamp)

    def append(self, lines: Iterable[str]) -> int:
        data = "".join(line + "\n" for line in lines).encode()
        if not data:
            return 0
        runfiles.private_dirs(self.dir)
        runfiles.safe_dir(self.dir)  # a symlink in its place would send the records elsewhere
        path = self.current if self.current is not None and runfiles.is_regular(self.current) else self._latest()
        if path is None or path.lstat().st_size > self.rotate_bytes:
            path = self._new_file()
        try:
            fd = runfiles.open_fd(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        except runfiles.UnsafeFile:  # something not ours took the name: start a file of our own
            path = self._new_file()
            fd = runfiles.open_fd(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        with open(fd, "ab") as f:
            f.write(data)
        self.current = path
        return len(data)


@dataclass(frozen=True)
class AgingResult:
    total_bytes: int
    deleted: list[Path]


def dir_bytes(profiling_dir: Path) -> int:
    total = 0
    for root, _dirs, files in os.walk(profiling_dir):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_size
            except FileNotFoundError:
                pass
    return total


def _aged_rank_dirs(profiling_dir: Path, nested: bool) -> list[Path]:
    """The rank dirs aging looks in: ``<dir>/<rank>``, or with the seed's layout ``<root>/<task>/<rank>``
    for every task folder. Symlinks are not followed."""
    tops = [profiling_dir]
    if nested:
        try:
            tops = [d for d in profiling_dir.iterdir() if d.is_dir() and not d.is_symlink()]
        except OSError:
            return []
    found: list[Path] = []
    for top in tops:
        try:
            found += [d for d in top.iterdir() if d.is_dir() and d.name.isdigit() and not d.is_symlink()]
        except OSError:
            continue
    return found


def age(profiling_dir: Path, cap_bytes: int, fraction: float = AGING_FRACTION, nested: bool = False) -> AgingResult:
    """If the profiling dir reached ``cap_bytes``, delete the oldest ``fraction`` (at least one) of
    the digit-named files in its rank directories (``nested``: in every task folder's rank
    directories). Other files are never touched."""
    profiling_dir = Path(profiling_dir)
    total = dir_bytes(profiling_dir)
    if total < cap_bytes:
        return AgingResult(total, [])
    files = []
    for d in _aged_rank_dirs(profiling_dir, nested):
        for p in _numbered(d):
            try:
                files.append((p.stat().st_mtime_ns, int(p.name), p))
            except FileNotFoundError:
                pass
    files.sort()
    n = math.ceil(len(files) * fraction)
    deleted = []
    for _, _, p in files[:n]:
        try:
            p.unlink()
            deleted.append(p)
        except FileNotFoundError:
            pass
    return AgingResult(total, deleted)


class AgingLock:
    """The right to age one profiling directory, among the agents that share it: an exclusive
    flock of a private lock file in it, taken without waiting and kept until ``release`` (or the
    agent's death: the kernel drops the lock, and the next agent that tries takes over)."""

    def __init__(self, profiling_dir: Path) -> None:
        self.path = Path(profiling_dir) / AGING_LOCK
        self._fd: int | None = None

    def held(self) -> bool:
        """True when this agent holds the lock (taken now if free)."""
        if self._fd is not None:
            return True
        try:
            fd = runfiles.open_fd(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        except OSError:
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(fd)
            if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise
            return False
        self._fd = fd
        return True

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


# ---- where the records go -----------------------------------------------------------------------
def task_id_problem(task_id: str) -> str | None:
    """Why a task id cannot name a folder (it is one path component under the root), None if it can."""
    if task_id in (".", "..") or "/" in task_id or "\0" in task_id or len(task_id.encode()) > 255:
        return f"{TASK_ID_ENV}={task_id!r} cannot be a folder name (one path component, at most 255 bytes)"
    return None


@dataclass(frozen=True)
class ProfilingPlace:
    """Where one agent writes its ranks' record folders, and what its cap and aging cover."""

    data: Path  # <data>/<rank>/<timestamp>
    aging_root: Path  # RUN_DIR/profiling, or the seed's root with every task's folder
    nested: bool  # aging_root holds task folders (the seed's layout)


def place(run_dir: Path, root: str = "", task_id: str = "", now: float | None = None) -> ProfilingPlace:
    """The seed's layout when a task id or a root is given, else RUN_DIR/profiling. Without a task
    id the folder is ``default_task_id_<timestamp>``; an agent of a run whose run dir already names
    one under the same root (another node, or this one before a restart) joins it."""
    if not root and not task_id:
        return ProfilingPlace(Path(run_dir) / PROFILING_DIR, Path(run_dir) / PROFILING_DIR, False)
    base = Path(root or DEFAULT_ROOT)
    name = task_id
    if not name:
        known = data_dir(run_dir)
        if known.parent == base and known.name.startswith(DEFAULT_TASK_PREFIX):
            name = known.name
        else:
            name = DEFAULT_TASK_PREFIX + time.strftime("%Y%m%d%H%M%S", time.localtime(now))
    return ProfilingPlace(base / name, base, True)


def prepare(run_dir: Path, where: ProfilingPlace) -> None:
    """Make the task folder (private; a symlink there is refused) and record it in the run dir, or
    remove an old record when the records stay in the run dir."""
    location = Path(run_dir) / LOCATION_FILE
    if not where.nested:
        if runfiles.is_regular(location):
            location.unlink()
        return
    where.aging_root.mkdir(mode=0o700, parents=True, exist_ok=True)  # an existing one (a mount) is kept as it is
    where.data.mkdir(mode=0o700, exist_ok=True)
    runfiles.safe_dir(where.data)
    with runfiles.replace(location, mode=0o600) as f:
        f.write((json.dumps({"dir": str(where.data.absolute())}) + "\n").encode())


def data_dir(run_dir: Path) -> Path:
    """Where a run's record folders are: the folder its location file names, else RUN_DIR/profiling."""
    try:
        d = json.loads(runfiles.read_text(Path(run_dir) / LOCATION_FILE, 1 << 16)).get("dir")
    except (OSError, ValueError, AttributeError):
        return Path(run_dir) / PROFILING_DIR
    return Path(d) if isinstance(d, str) and d else Path(run_dir) / PROFILING_DIR
