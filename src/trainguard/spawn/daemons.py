"""Processes a worker left running: daemons that outlive their worker's group holding its output.

A worker's script may start a daemon in a session of its own (``subprocess.Popen(...,
start_new_session=True)`` without redirects, a double fork with ``os.setsid()``): it inherits the
worker's stdout/stderr, the agent's killpg of the worker's group does not reach it, and the pipe
the agent's log pump reads never ends while it lives. The agent stops waiting for those pipes
(spawn/logs.py ``Pumps.stop``) and names the processes that hold them, found in /proc by the
pipes' inodes. They are not killed, as torchrun does not kill them: the job's end is the workers'
end, and what else a user's script started is the user's.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import psutil

from trainguard.events import EventBus, Severity

STREAMS = {"out": "stdout", "err": "stderr"}


@dataclass(frozen=True)
class Daemon:
    pid: int
    cmdline: tuple[str, ...]
    session: int
    started: float  # psutil's create_time: with the pid, which process it was
    rank: int  # the global rank whose worker's output it holds: the worker that started it
    local_rank: int
    worker_pid: int
    streams: tuple[str, ...]  # "stdout", "stderr"

    def to_dict(self) -> dict:
        return {"pid": self.pid, "cmdline": list(self.cmdline), "session": self.session, "started": self.started,
                "rank": self.rank, "local_rank": self.local_rank, "worker_pid": self.worker_pid,
                "streams": list(self.streams)}  # fmt: skip


def pipe_holders(inodes: set[int], skip: set[int]) -> dict[int, set[int]]:
    """pid -> the pipes among ``inodes`` it has open (any end), every process of /proc this agent
    may read but those in ``skip``."""
    wanted = {f"pipe:[{i}]": i for i in inodes}
    found: dict[int, set[int]] = {}
    try:
        pids = [int(p) for p in os.listdir("/proc") if p.isdigit()]
    except OSError:
        return found
    for pid in pids:
        if pid in skip:
            continue
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:  # gone, or not ours to read
            continue
        for fd in fds:
            try:
                ino = wanted.get(os.readlink(f"/proc/{pid}/fd/{fd}"))
            except OSError:
                continue
            if ino is not None:
                found.setdefault(pid, set()).add(ino)
    return found


def find(held: dict[int, tuple[int, int, dict[str, int]]]) -> list[Daemon]:
    """The processes holding workers' pipes open after their groups were killed. ``held``: local
    rank -> (global rank, worker pid, stream -> pipe inode) of the pipes still open. A process of
    the worker's own group is left out: it was killed and is on its way out."""
    owner = {ino: (lr, name) for lr, (_r, _p, pipes) in held.items() for name, ino in pipes.items()}
    out = []
    for pid, inos in sorted(pipe_holders(set(owner), {os.getpid()}).items()):
        lr = owner[min(inos)][0]
        rank, worker_pid, _pipes = held[lr]
        try:
            p = psutil.Process(pid)
            if os.getpgid(pid) == worker_pid:
                continue
            cmdline, session, started = tuple(p.cmdline()), os.getsid(pid), p.create_time()
        except (psutil.Error, OSError):
            continue
        names = {owner[i][1] for i in inos if owner[i][0] == lr}
        streams = tuple(STREAMS[n] for n in STREAMS if n in names)
        out.append(Daemon(pid, cmdline, session, started, rank, lr, worker_pid, streams))
    return out


def report(bus: EventBus, daemons: list[Daemon], attempt: int) -> None:
    """One ``worker_daemon_left`` (a warning) per process a worker left running."""
    for d in daemons:
        bus.emit(
            "worker_daemon_left",
            f"rank {d.rank} left a process running after its worker ended: pid {d.pid} "
            f"({' '.join(d.cmdline)[:200] or '?'}), session {d.session}, holding the worker's {'/'.join(d.streams)}; "
            "not killed (torchrun leaves it too): it outlives the job; what it writes while the agent runs goes to the agent log",
            severity=Severity.WARNING,
            rank=d.rank,
            evidence={**d.to_dict(), "attempt": attempt, "killed": False},
        )
