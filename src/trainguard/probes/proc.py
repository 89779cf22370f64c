"""Per-worker activity from /proc: I/O counters and CPU time of a process and all its children.

One ``ProcSample`` sums a worker's own counters and those of every descendant (DataLoader
workers, compile sub-processes), because a job that only moves data in a child is still moving.
Reading never raises: a process that vanished or cannot be read gives ``alive=False`` or
``io=None`` and the caller decides what that means.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import psutil

# The /proc/<pid>/io fields we watch. rchar/wchar count every read()/write() (sockets and pipes
# included, which is how gloo traffic and log lines show up); read_bytes/write_bytes the storage.
IO_FIELDS = ("rchar", "wchar", "syscr", "syscw", "read_bytes", "write_bytes")


@dataclass(frozen=True)
class ProcSample:
    """Cumulative activity of one worker (process tree) at one moment."""

    rank: int
    pid: int
    time: float  # unix seconds, taken by the caller
    alive: bool
    state: str  # /proc state letter of the worker itself (R S D T t Z X), "" when gone
    io: tuple[int, ...] | None  # IO_FIELDS summed over the tree; None when unreadable
    cpu: float  # user + system seconds of the tree, reaped children included
    children: int = 0
    child_states: tuple[str, ...] = ()
    tree: tuple[int, ...] = ()  # the worker's pid and its descendants'
    net: int | None = None  # bytes its tree's TCP sockets moved, outside the job (probes.waits.net_bytes)
    own_cpu: float = 0.0  # user + system seconds of the worker process alone (``cpu`` less its children's)


def read_io(pid: int) -> tuple[int, ...] | None:
    """The IO_FIELDS of /proc/<pid>/io, or None when the file cannot be read (gone, no permission)."""
    try:
        with open(f"/proc/{pid}/io", encoding="ascii") as f:
            text = f.read()
    except OSError:
        return None
    values: dict[str, int] = {}
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key in IO_FIELDS:
            try:
                values[key] = int(value)
            except ValueError:
                return None
    if len(values) != len(IO_FIELDS):
        return None
    return tuple(values[k] for k in IO_FIELDS)


def read_state(pid: int) -> str:
    """The state letter from /proc/<pid>/stat ('T' = stopped, 'Z' = zombie), "" when gone."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            text = f.read()
    except OSError:
        return ""
    # The command name is in parentheses and may itself contain spaces or ')'.
    rest = text.rpartition(")")[2].split()
    return rest[0] if rest else ""


def _add(total: tuple[int, ...] | None, part: tuple[int, ...] | None) -> tuple[int, ...] | None:
    if total is None or part is None:
        return total if part is None else part
    return tuple(a + b for a, b in zip(total, part, strict=True))


def sample(rank: int, pid: int, now: float) -> ProcSample:
    """Read one worker's tree. Cheap: a handful of small /proc files per process."""
    try:
        proc = psutil.Process(pid)
        times = proc.cpu_times()
        children = proc.children(recursive=True)
    except (psutil.NoSuchProcess, psutil.ZombieProcess):
        state = read_state(pid)
        return ProcSample(rank, pid, now, alive=False, state=state, io=None, cpu=0.0)
    except psutil.AccessDenied:
        return ProcSample(rank, pid, now, alive=True, state=read_state(pid), io=None, cpu=0.0)
    # children_* hold the times of reaped children, so a DataLoader worker that exits does not
    # make the total go backwards.
    own = times.user + times.system
    cpu = own + times.children_user + times.children_system
    io = read_io(pid)
    child_states = []
    for child in children:
        try:
            ct = child.cpu_times()
        except psutil.Error:
            continue
        cpu += ct.user + ct.system
        io = _add(io, read_io(child.pid))
        child_states.append(read_state(child.pid))
    return ProcSample(
        rank,
        pid,
        now,
        alive=True,
        state=read_state(pid),
        io=io,
        cpu=cpu,
        children=len(children),
        child_states=tuple(child_states),
        tree=(pid, *(c.pid for c in children)),
        own_cpu=own,
    )


def sample_workers(pids: dict[int, int], now: float) -> dict[int, ProcSample]:
    """global rank -> sample, for every worker of this node (``probes.waits.with_net`` adds the
    bytes each tree's sockets moved: socket reads do not show in /proc/<pid>/io)."""
    return {rank: sample(rank, pid, now) for rank, pid in sorted(pids.items())}


def cpu_count() -> int:
    return os.cpu_count() or 1
