"""Read a run directory back: its events (SQLite), its span records (profiling files) and its hang
reports. Read-only and incremental, so a live view can poll it cheaply while the job writes."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from trainguard.events.model import Event
from trainguard.events.store import RunEvents, event_dbs
from trainguard.rundir.profiling import PROFILING_DIR

HANG_GLOB = "hang-*.txt"


class NotARunDir(Exception):
    """The path has no event database: not a run directory (or nothing was recorded yet)."""


@dataclass(frozen=True)
class Span:
    """One span record of one rank (times in unix seconds)."""

    rank: int
    kind: str  # Step, FP, DataLoader, Communication, SaveCheckpoint, User
    name: str
    step: int  # the recorder's step number: counts from 1 in every worker process
    start: float
    end: float

    @property
    def duration(self) -> float:
        return self.end - self.start


def check_run_dir(path: str | Path) -> Path:
    run_dir = Path(path)
    if run_dir.suffix == ".db":
        run_dir = run_dir.parent
        if run_dir.name == "events":  # RUN_DIR/events/<node>.db
            run_dir = run_dir.parent
    if not run_dir.is_dir():
        raise NotARunDir(f"{run_dir} is not a directory: not a trainguard run directory")
    dbs = event_dbs(run_dir)
    if not dbs:
        raise NotARunDir(f"no events.db or events/*.db in {run_dir}: not a trainguard run directory")
    reader = RunEvents(run_dir)
    try:
        reader.read(kinds=["job_started"])  # opens every database: is any of them one?
    finally:
        reader.close()
    if len(reader.problems) == len(dbs):  # none can be read: an error, not an empty view
        db, why = next(iter(reader.problems.items()))
        raise NotARunDir(f"cannot read {db}: {why}")
    return run_dir


class EventTail:
    """New events of a run since the last call: every node's, merged (see events/store.py).
    ``skip_nodes``: nodes whose events are not read (an agent tailing the other nodes)."""

    def __init__(self, run_dir: Path, skip_nodes: set[str] | frozenset[str] = frozenset()) -> None:
        self.run_dir = Path(run_dir)
        self._events = RunEvents(self.run_dir, skip_nodes)

    def read(self) -> list[Event]:
        return self._events.read()

    def close(self) -> None:
        self._events.close()


def read_events(run_dir: Path) -> list[Event]:
    tail = EventTail(run_dir)
    try:
        return tail.read()
    finally:
        tail.close()


def parse_span(line: str) -> Span | None:
    """One profiling record line (see monitors/profiling/monitor.py), None when it is not one."""
    try:
        d = json.loads(line)
        return Span(int(d["rank"]), str(d["kind"]), str(d.get("name") or d["kind"]), int(d["step"]),
                    int(d["start_ns"]) / 1e9, int(d["end_ns"]) / 1e9)
    except (ValueError, KeyError, TypeError):
        return None


def _rank_dirs(profiling: Path) -> list[Path]:
    try:
        return sorted((d for d in profiling.iterdir() if d.is_dir() and d.name.isdigit()), key=lambda d: int(d.name))
    except FileNotFoundError:
        return []


def _record_files(rank_dir: Path) -> list[Path]:
    try:
        return sorted((p for p in rank_dir.iterdir() if p.name.isdigit()), key=lambda p: int(p.name))
    except FileNotFoundError:
        return []


class SpanTail:
    """New span records of every rank since the last call.

    Follows the agent's files as they grow, rotate and age (a deleted file is forgotten). Only whole
    lines are consumed; the partial last line of a file being written is read next time.
    ``start_bytes``: on the first read, skip all but the last N bytes of each rank's newest file (a
    live view does not need a week of history); None reads everything. Files that appear later are
    read whole. ``ranks``: only these ranks."""

    def __init__(self, run_dir: Path, start_bytes: int | None = None, ranks: set[int] | None = None,
                 max_bytes_per_read: int = 64 << 20) -> None:
        self.profiling = Path(run_dir) / PROFILING_DIR
        self.start_bytes = start_bytes
        self.ranks = ranks
        self.max_bytes = max_bytes_per_read
        self._offsets: dict[Path, int] = {}
        self._primed = False

    def read(self) -> list[Span]:
        skip = None if self._primed else self.start_bytes
        self._primed = True
        spans: list[Span] = []
        budget = self.max_bytes
        seen: set[Path] = set()
        for rank_dir in _rank_dirs(self.profiling):
            if self.ranks is not None and int(rank_dir.name) not in self.ranks:
                continue
            files = _record_files(rank_dir)
            for i, path in enumerate(files):
                seen.add(path)
                if path not in self._offsets:
                    # With a start window only the tail of the newest file is read at first.
                    if skip is None:
                        self._offsets[path] = 0
                    elif i < len(files) - 1:
                        self._offsets[path] = _size(path)
                    else:
                        start = max(0, _size(path) - skip)
                        self._offsets[path] = _next_line(path, start) if start else 0
                if budget <= 0:
                    continue
                got, used = self._read_file(path, budget)
                spans += got
                budget -= used
        for gone in set(self._offsets) - seen:
            del self._offsets[gone]
        return spans

    def _read_file(self, path: Path, budget: int) -> tuple[list[Span], int]:
        offset = self._offsets[path]
        try:
            with open(path, "rb") as f:
                f.seek(offset)
                data = f.read(max(0, min(budget, os.fstat(f.fileno()).st_size - offset)))
        except FileNotFoundError:
            return [], 0
        end = data.rfind(b"\n")
        if end < 0:
            return [], 0
        chunk = data[: end + 1]
        self._offsets[path] = offset + len(chunk)
        spans = [s for s in (parse_span(ln) for ln in chunk.decode(errors="replace").splitlines()) if s is not None]
        return spans, len(chunk)


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0


def _next_line(path: Path, offset: int) -> int:
    """The first line start at or after ``offset`` (so a tail never begins mid-record)."""
    with open(path, "rb") as f:
        f.seek(offset - 1)
        if f.read(1) == b"\n":
            return offset
        f.readline()
        return f.tell()


def hang_reports(run_dir: Path) -> list[Path]:
    return sorted(Path(run_dir).glob(HANG_GLOB), key=lambda p: (p.stat().st_mtime, p.name))


def read_report(run_dir: Path, name: str, limit: int = 256 << 10) -> str | None:
    """A hang report by file name; None for anything that is not one of this run's reports."""
    if os.sep in name or name.startswith(".") or not Path(name).match(HANG_GLOB):
        return None
    path = Path(run_dir) / name
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read(limit)
    except (FileNotFoundError, IsADirectoryError):
        return None
