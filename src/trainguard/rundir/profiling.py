"""Profiling on disk: the runtime switch file, per-rank record files, rotation and aging.

Rules from the seed (MindCluster TaskD lightweight profiling):

- records go under ``RUN_DIR/profiling/<rank>/``, in files named by a timestamp (digits only:
  unix milliseconds), one record per line, always appended to the rank's newest file;
- when the newest file exceeds 10 MB a new file is started;
- when the profiling directory reaches its cap, the oldest 20 % of the files (by modification
  time) are deleted — only digit-named files inside rank directories, never anything else.

The switch is ``RUN_DIR/profiling-switch.json``, in the seed's ConfigMap format::

    {"CommunicationOperator": "off", "Step": "on", "SaveCheckpoint": "on", "FP": "on", "DataLoader": "on"}

written by ``trainguard profile`` (atomically) and watched by every agent of the run.
"""

from __future__ import annotations

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
        path = self.current if self.current is not None and runfiles.is_regular(self.current) else self._latest()
        if path is None or path.lstat().st_size > self.rotate_bytes:
            path = self._new_file()
        try:
            fd = runfiles.open_fd(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
        except runfiles.UnsafeFile:  # something not ours took the name: start a file of our own
            path = self._new_file()
            fd = runfiles.open_fd(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
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


def age(profiling_dir: Path, cap_bytes: int) -> AgingResult:
    """If the profiling dir reached ``cap_bytes``, delete the oldest 20 % (at least one) of the
    digit-named files in its rank directories. Other files are never touched."""
    profiling_dir = Path(profiling_dir)
    total = dir_bytes(profiling_dir)
    if total < cap_bytes:
        return AgingResult(total, [])
    files = []
    try:
        rank_dirs = [d for d in profiling_dir.iterdir() if d.is_dir() and d.name.isdigit()]
    except FileNotFoundError:
        return AgingResult(total, [])
    for d in rank_dirs:
        for p in _numbered(d):
            try:
                files.append((p.stat().st_mtime_ns, int(p.name), p))
            except FileNotFoundError:
                pass
    files.sort()
    n = math.ceil(len(files) * AGING_FRACTION)
    deleted = []
    for _, _, p in files[:n]:
        try:
            p.unlink()
            deleted.append(p)
        except FileNotFoundError:
            pass
    return AgingResult(total, deleted)
