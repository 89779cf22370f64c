"""Read a run directory back: its events (SQLite), its span records (profiling files) and its hang
reports. Read-only and incremental, so a live view can poll it cheaply while the job writes."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from trainguard import runfiles
from trainguard.events.model import Event
from trainguard.events.store import READ_RETRY_S, RunEvents, event_dbs
from trainguard.rundir.profiling import data_dir

HANG_GLOB = "hang-*.txt"
MAX_RANK = 1 << 24  # more ranks than any job has: a larger one is a damaged record
MAX_TIME = 1e11  # unix seconds (year 5138): a later time is a damaged record


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

    def __init__(self, run_dir: Path, skip_nodes: set[str] | frozenset[str] = frozenset(),
                 wait_s: float = READ_RETRY_S) -> None:
        self.run_dir = Path(run_dir)
        self._events = RunEvents(self.run_dir, skip_nodes, wait_s)

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
        span = Span(int(d["rank"]), str(d["kind"]), str(d.get("name") or d["kind"]), int(d["step"]),
                    int(d["start_ns"]) / 1e9, int(d["end_ns"]) / 1e9)
    except (ValueError, KeyError, TypeError, AttributeError, OverflowError):
        return None
    # A damaged record (a rank or time out of any range) is not a span: it would break every view.
    if not (0 <= span.rank < MAX_RANK and 0 <= span.start <= span.end < MAX_TIME and math.isfinite(span.end)):
        return None
    return span


def _rank_dirs(profiling: Path) -> list[Path]:
    try:
        return sorted((d for d in profiling.iterdir() if d.is_dir() and d.name.isdigit() and not d.is_symlink()),
                      key=lambda d: int(d.name))
    except OSError:  # missing, or not a directory
        return []


def _record_files(rank_dir: Path) -> list[Path]:
    """A rank's record files, oldest first: regular files only (a FIFO would block a reader)."""
    try:
        return sorted((p for p in rank_dir.iterdir() if p.name.isdigit() and runfiles.is_regular(p)),
                      key=lambda p: int(p.name))
    except OSError:
        return []


def iter_spans(run_dir: Path, chunk: int = 1 << 20) -> Iterator[Span]:
    """Every span record of the run, file by file, without holding more than ``chunk`` bytes of a
    file at once (``trace`` of a run dir with gigabytes of records)."""
    for rank_dir in _rank_dirs(data_dir(Path(run_dir))):
        for path in _record_files(rank_dir):
            try:
                f = runfiles.open_read(path)
            except OSError:
                continue
            with f:
                rest = b""
                while data := f.read(chunk):
                    lines = (rest + data).split(b"\n")
                    rest = lines.pop()
                    for ln in lines:
                        if (span := parse_span(ln.decode(errors="replace"))) is not None:
                            yield span


class SpanTail:
    """New span records of every rank since the last call.

    Follows the agent's files as they grow, rotate and age (a deleted file is forgotten). Only whole
    lines are consumed; the partial last line of a file being written is read next time.
    ``start_bytes``: on the first read, skip all but the last N bytes of each rank's newest file (a
    live view does not need a week of history); None reads everything. Files that appear later are
    read whole. ``ranks``: only these ranks."""

    def __init__(self, run_dir: Path, start_bytes: int | None = None, ranks: set[int] | None = None,
                 max_bytes_per_read: int = 64 << 20) -> None:
        self.run_dir = Path(run_dir)  # its records' folder is looked up on every read: the agent may name it later
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
        for rank_dir in _rank_dirs(data_dir(self.run_dir)):
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
            with runfiles.open_read(path) as f:
                f.seek(offset)
                data = f.read(max(0, min(budget, os.fstat(f.fileno()).st_size - offset)))
        except OSError:  # gone, or no longer a regular file
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
        return path.lstat().st_size
    except OSError:
        return 0


def _next_line(path: Path, offset: int) -> int:
    """The first line start at or after ``offset`` (so a tail never begins mid-record)."""
    try:
        with runfiles.open_read(path) as f:
            f.seek(offset - 1)
            if f.read(1) == b"\n":
                return offset
            f.readline()
            return f.tell()
    except OSError:
        return offset


def hang_reports(run_dir: Path) -> list[tuple[Path, float]]:
    """This run's hang reports with their mtimes, oldest first: regular files only (a symlink,
    dangling or not, is no report of this run)."""
    found = []
    for p in Path(run_dir).glob(HANG_GLOB):
        try:
            st = p.lstat()
        except OSError:
            continue
        if runfiles.is_regular(p):
            found.append((p, st.st_mtime))
    return sorted(found, key=lambda x: (x[1], x[0].name))


def read_report(run_dir: Path, name: str, limit: int = 256 << 10) -> str | None:
    """A hang report by file name; None for anything that is not one of this run's reports
    (another name, a symlink, a FIFO, a directory)."""
    if os.sep in name or "/" in name or name.startswith(".") or not Path(name).match(HANG_GLOB):
        return None
    try:
        return runfiles.read_text(Path(run_dir) / name, limit)
    except (OSError, ValueError):
        return None
