"""Which processes a chaos injection aims at: a rank's worker, a node's agent, a node's whole
process tree — found from the run dir's events (each node's latest ``job_started``), checked to
be the same processes on this very machine (probes/identity.py: not another node's pids, not
reused ones) before anything is signalled."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import psutil

from trainguard.events.summary import JobSummary, NodeState
from trainguard.probes import identity
from trainguard.rundir.readers import read_events


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
    why = identity.why_not(state.identity, state.pids)
    if why is not None:  # another node's pid, or a reused one: never signalled
        raise TargetError(f"node {state.node}'s workers cannot be acted on from here: {why} "
                          "(chaos acts on this host's processes; run it on the node)")
    pids = dict(state.pids)
    agent = state.identity.get("agent_pid")
    workers = {rank: pids[rank]} if rank is not None else pids
    return Target(state.node, rank, workers, agent if isinstance(agent, int) else None)


@dataclass(frozen=True)
class NodeCheckTarget:
    """A node's agent that runs the node check, verified on this machine, and its node-check
    process still running (None when the newest one ended)."""

    node: str
    agent: int
    agent_created: float
    pid: int | None


def nodecheck_target(run_dir: Path, node: str) -> NodeCheckTarget:
    """From ``node``'s newest ``nodecheck_started`` event, checked like a worker: on this machine,
    the agent that recorded it still running, the process started at the recorded moment under it."""
    started = [e for e in read_events(run_dir) if e.kind == "nodecheck_started" and e.node == node]
    if not started:
        raise TargetError(f"node {node!r} has started no node-check process in {run_dir} (is --node-check on?)")
    ev = started[-1].evidence
    ident, pid = ev.get("identity"), ev.get("pid")
    why = identity.why_not(ident, {})
    if why is not None:
        raise TargetError(f"node {node}'s node check cannot be acted on from here: {why}")
    running = pid if isinstance(pid, int) and identity.why_not(ident, {0: pid}) is None else None
    return NodeCheckTarget(node, int(ident["agent_pid"]), float(ident["agent_created"]), running)


def nodecheck_processes(agent: int) -> list[int]:
    """The node-check processes the agent runs now: its descendants running the benchmark module."""
    try:
        kids = psutil.Process(agent).children(recursive=True)
    except psutil.Error:
        return []
    out = []
    for k in kids:
        try:
            if "trainguard.checks.bench" in k.cmdline():
                out.append(k.pid)
        except psutil.Error:
            continue
    return out
