"""Which processes a chaos injection aims at: a rank's worker, a node's agent, a node's whole
process tree — found from the run dir's events (each node's latest ``job_started``), checked to
be the same processes (not reused pids), on this host only."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import psutil

from trainguard.events.summary import JobSummary, NodeState
from trainguard.rundir.readers import read_events
from trainguard.view.stacks_cli import _verified


class TargetError(Exception):
    """The target cannot be found (one clear line for the user)."""


@dataclass(frozen=True)
class Target:
    node: str
    rank: int | None  # None: the node as a whole
    workers: dict[int, int]  # rank -> pid (the node's, or the one rank's)
    agent: int | None  # the node's agent pid, when it runs on this host

    def tree(self) -> list[int]:
        """The agent and every process under it (workers, their children), else the workers."""
        pids = list(self.workers.values()) if self.agent is None else [self.agent]
        out = []
        for pid in pids:
            try:
                p = psutil.Process(pid)
                out += [p.pid, *(c.pid for c in p.children(recursive=True))]
            except psutil.NoSuchProcess:
                continue
        return list(dict.fromkeys(out))


def _agent_of(worker_pid: int) -> int | None:
    """The ``trainguard run`` process a worker descends from."""
    try:
        for p in psutil.Process(worker_pid).parents():
            cmd = p.cmdline()
            if "trainguard" in " ".join(cmd) and "run" in cmd:
                return p.pid
    except psutil.Error:
        return None
    return None


def nodes(run_dir: Path) -> dict[str, NodeState]:
    summary = JobSummary()
    for e in read_events(run_dir):
        summary.apply(e)
    return summary.nodes


def resolve(run_dir: Path, *, rank: int | None = None, node: str | None = None) -> Target:
    """The running target: ``rank`` (its node found from the events) or ``node``."""
    known = nodes(run_dir)
    if rank is not None:
        state = next((s for s in known.values() if rank in s.pids), None)
        if state is None:
            raise TargetError(f"no running rank {rank} in {run_dir} (ranks: {sorted(r for s in known.values() for r in s.pids)})")
    else:
        state = known.get(node or "")
        if state is None:
            raise TargetError(f"no node {node!r} in {run_dir} (nodes: {', '.join(sorted(known)) or 'none'})")
    pids = _verified(state)
    if not pids:
        raise TargetError(f"node {state.node}'s workers are not running on this host (chaos acts on local processes)")
    agent = _agent_of(next(iter(pids.values())))
    workers = {rank: pids[rank]} if rank is not None else pids
    return Target(state.node, rank, workers, agent)
