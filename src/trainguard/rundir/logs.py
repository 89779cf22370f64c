"""Read the workers' logs of a run back: every attempt's ``logs/attempt-<n>/rank-<r>.log`` (written
by spawn/logs.py: ``2026-11-21T09:30:01.123456 [rank1]: <text>``, local time to the µs), merged by
time, each line with its node, rank and attempt.

The node of a rank file comes from the ``job_started`` events of the run (each agent's database
names the ranks it started in each attempt): several nodes may share one run dir, and the file
names carry the rank only. A rank no event names reads node "?".
"""

from __future__ import annotations

import heapq
import os
import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

LOGS_DIR = "logs"
_ATTEMPT = re.compile(r"^attempt-(\d+)$")
_RANK_FILE = re.compile(r"^rank-(\d+)\.log$")
_LINE = re.compile(r"^(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{6}) (?:\[rank\d+\]: )?(.*)$", re.DOTALL)
UNKNOWN_NODE = "?"


@dataclass(frozen=True)
class RankLogFile:
    attempt: int
    rank: int
    path: Path


@dataclass(frozen=True, order=True)
class LogLine:
    time: datetime
    attempt: int
    rank: int
    node: str = field(compare=False)
    text: str = field(compare=False)

    def format(self) -> str:
        return f"{self.time.isoformat(timespec='microseconds')} [{self.node}/rank{self.rank}/attempt{self.attempt}] {self.text}"


@dataclass(frozen=True)
class LogFilter:
    """Which lines to keep; None or empty: no condition."""

    ranks: frozenset[int] = frozenset()
    nodes: frozenset[str] = frozenset()
    attempts: frozenset[int] = frozenset()
    since: datetime | None = None
    until: datetime | None = None
    grep: Callable[[str], bool] | None = None

    def wants_file(self, f: RankLogFile, node: str) -> bool:
        return ((not self.ranks or f.rank in self.ranks) and (not self.attempts or f.attempt in self.attempts)
                and (not self.nodes or node in self.nodes))

    def wants_line(self, line: LogLine) -> bool:
        if self.since is not None and line.time < self.since:
            return False
        if self.until is not None and line.time > self.until:
            return False
        return self.grep is None or self.grep(line.text)


def rank_log_files(run_dir: Path) -> list[RankLogFile]:
    """Every rank log of every attempt, in (attempt, rank) order. Symlinks are not followed: a
    reader never opens a file the agent did not write."""
    found: list[RankLogFile] = []
    root = run_dir / LOGS_DIR
    try:
        attempts = list(os.scandir(root))
    except OSError:
        return []
    for entry in attempts:
        m = _ATTEMPT.match(entry.name)
        if not m or not entry.is_dir(follow_symlinks=False):
            continue
        try:
            files = list(os.scandir(entry.path))
        except OSError:
            continue
        for f in files:
            r = _RANK_FILE.match(f.name)
            if r and f.is_file(follow_symlinks=False):
                found.append(RankLogFile(int(m.group(1)), int(r.group(1)), Path(f.path)))
    return sorted(found, key=lambda f: (f.attempt, f.rank))


def rank_nodes(run_dir: Path) -> dict[tuple[int, int], str]:
    """(attempt, rank) -> the node whose agent started that rank, from the run's job_started events."""
    from trainguard.events.store import RunEvents

    reader = RunEvents(run_dir)
    try:
        events = reader.read(kinds=["job_started"])
    finally:
        reader.close()
    nodes: dict[tuple[int, int], str] = {}
    for e in events:
        attempt, pids = e.evidence.get("attempt"), e.evidence.get("pids")
        if not isinstance(attempt, int) or not isinstance(pids, dict):
            continue
        for rank in pids:
            if str(rank).isdigit():
                nodes[(attempt, int(rank))] = e.node
    return nodes


def parse_lines(lines: Iterable[str], attempt: int, rank: int, node: str) -> Iterator[LogLine]:
    """The lines of one rank log. A line without a time stamp (never written by the pump; a file
    edited by hand) keeps the time of the line before it so the merge keeps it in place."""
    last = datetime.min
    for raw in lines:
        text = raw.rstrip("\n").rstrip("\r")
        m = _LINE.match(text)
        if m:
            try:
                last = datetime.fromisoformat(m.group(1))
                text = m.group(2)
            except ValueError:
                pass
        yield LogLine(last, attempt, rank, node, text)


def _read_file(f: RankLogFile, node: str, keep: LogFilter) -> Iterator[LogLine]:
    try:
        fd = os.open(f.path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return
    with open(fd, encoding="utf-8", errors="replace", newline="\n") as fh:
        for line in parse_lines(fh, f.attempt, f.rank, node):
            if keep.wants_line(line):
                yield line


def merged_lines(run_dir: Path, keep: LogFilter) -> Iterator[LogLine]:
    """Every kept line of every rank log of the run, merged by time (ties: attempt, then rank)."""
    nodes = rank_nodes(run_dir)
    streams = []
    for f in rank_log_files(run_dir):
        node = nodes.get((f.attempt, f.rank), UNKNOWN_NODE)
        if keep.wants_file(f, node):
            streams.append(_read_file(f, node, keep))
    return heapq.merge(*streams)


class LogTail:
    """New complete lines of the run's rank logs since the last call (``--follow``): new attempts'
    files are picked up as they appear; a line still being written waits for its end."""

    def __init__(self, run_dir: Path, keep: LogFilter) -> None:
        self.run_dir, self.keep = run_dir, keep
        self._offsets: dict[Path, int] = {}
        self._nodes: dict[tuple[int, int], str] = {}

    def read(self) -> list[LogLine]:
        files = rank_log_files(self.run_dir)
        if any((f.attempt, f.rank) not in self._nodes for f in files):
            self._nodes = rank_nodes(self.run_dir)
        new: list[LogLine] = []
        for f in files:
            node = self._nodes.get((f.attempt, f.rank), UNKNOWN_NODE)
            if self.keep.wants_file(f, node):
                new += [ln for ln in parse_lines(self._new_lines(f.path), f.attempt, f.rank, node) if self.keep.wants_line(ln)]
        return sorted(new)

    def _new_lines(self, path: Path) -> list[str]:
        start = self._offsets.get(path, 0)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        except OSError:
            return []
        with open(fd, "rb") as fh:
            fh.seek(start)
            data = fh.read()
        end = data.rfind(b"\n") + 1
        self._offsets[path] = start + end
        return data[:end].decode("utf-8", errors="replace").splitlines(keepends=True)

