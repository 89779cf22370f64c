"""Which processes a run dir's pids really are, before anyone signals or inspects them.

A pid in the events is only a number: the rank may run on another node (whose pids mean nothing
here), or it ended and the kernel gave its number to an unrelated process. So the agent records,
with every ``job_started``, who it is and when each worker started (``record``); a command that
is about to signal (``chaos``) or dump (``stacks``) a rank checks (``why_not``) that the pid is on
this very machine (same boot), started at the recorded moment (pid + start time name one process
for the machine's life), and descends from the agent that recorded it.
"""

from __future__ import annotations

import os
from typing import Any

import psutil

BOOT_ID = "/proc/sys/kernel/random/boot_id"
_SAME_START_S = 0.05  # start times are in clock ticks (10 ms): the same process reads the same value


def boot_id() -> str:
    """This machine's current boot (distinct per host and per boot); "" when unknown."""
    try:
        with open(BOOT_ID) as f:
            return f.read().strip()
    except OSError:
        return ""


def _created(pid: int) -> float | None:
    try:
        return psutil.Process(pid).create_time()
    except (psutil.Error, OSError):
        return None


def record(workers: dict[int, int]) -> dict[str, Any]:
    """What the agent writes into ``job_started`` (rank -> pid of its workers)."""
    me = os.getpid()
    return {
        "boot_id": boot_id(),
        "agent_pid": me,
        "agent_created": _created(me),
        "created": {str(rank): _created(pid) for rank, pid in workers.items()},
    }


def _same_start(pid: int, recorded: Any) -> bool:
    now = _created(pid)
    return now is not None and isinstance(recorded, int | float) and abs(now - float(recorded)) <= _SAME_START_S


def why_not(identity: Any, pids: dict[int, int]) -> str | None:
    """Why the ``pids`` (rank -> pid) of a node's ``job_started`` are not that node's running
    workers here (None: they are). ``identity``: what ``record`` wrote into that event."""
    if not isinstance(identity, dict) or not identity.get("boot_id"):
        return "its agent recorded no process identity (an older trainguard), so its pids cannot be verified"
    if identity["boot_id"] != boot_id():
        return "it runs on another machine (or this one rebooted since)"
    agent = identity.get("agent_pid")
    if not isinstance(agent, int) or not _same_start(agent, identity.get("agent_created")):
        return "its agent is no longer running here"
    created = identity.get("created") if isinstance(identity.get("created"), dict) else {}
    for rank, pid in sorted(pids.items()):
        if not _same_start(pid, created.get(str(rank))):
            return f"rank {rank}'s worker (pid {pid}) has ended; the pid is not that worker any more"
        try:
            parents = {p.pid for p in psutil.Process(pid).parents()}
        except (psutil.Error, OSError):
            return f"rank {rank}'s worker (pid {pid}) has ended"
        if agent not in parents:
            return f"pid {pid} does not descend from the job's agent (pid {agent}): not rank {rank}'s worker"
    return None
