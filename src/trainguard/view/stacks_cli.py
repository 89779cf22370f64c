"""`trainguard stacks RUN_DIR`: every rank's Python stacks, now — one command to all workers.

Ranks of this host are dumped directly with py-spy: their pids come from each node's latest
``job_started`` event, checked to be the same processes on this same machine (probes/identity.py). Ranks of
other nodes are asked for through a request file in the run directory, which every agent watches
and answers into (see rundir/stack_requests.py); that needs the run directory on a filesystem the
nodes share. Dumps never pause a worker.
"""

from __future__ import annotations

import argparse
import json
import shutil
import socket
import sys
import time
from typing import Any

from trainguard.events.summary import JobSummary, NodeState
from trainguard.options import node_name, seconds
from trainguard.probes import identity, stacks
from trainguard.rundir import stack_requests as req
from trainguard.rundir.readers import NotARunDir, check_run_dir, read_events

LIVE = ("starting", "running", "recovering", "restarting")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir", help="the job's run directory")
    p.add_argument("--timeout", type=seconds, default=30.0, help="seconds to wait for other nodes' agents (default 30)")
    p.add_argument("--node-name", action="append", default=None, metavar="NAME", type=node_name,
                   help="this host's node name when the job ran with --node-name (repeatable); default: the hostname")
    p.add_argument("--via-agents", action="store_true", help="ask every node's agent, this host's too (no local py-spy)")
    p.add_argument("--json", action="store_true", help="one JSON object per rank")


def _verified(node: NodeState) -> dict[int, int] | None:
    """rank -> pid when every pid is, on this machine, the worker the event named (not another
    node's pid, not a reused one: probes/identity.py); else None."""
    return None if identity.why_not(node.identity, node.pids) else dict(node.pids)


def _local_names(args: argparse.Namespace) -> set[str]:
    if args.node_name:
        return set(args.node_name)
    host = socket.gethostname()
    return {host, host.split(".")[0]}


def _ask_agents(run_dir, nodes: list[str], timeout: float) -> tuple[dict[str, dict[str, Any]], list[str]]:
    d = req.write_request(run_dir, nodes)
    deadline = time.monotonic() + timeout
    try:
        while True:
            answers = req.read_answers(d)
            missing = [n for n in nodes if n not in answers]
            if not missing or time.monotonic() > deadline:
                return answers, missing
            time.sleep(0.2)
    finally:
        shutil.rmtree(d, ignore_errors=True)


def main(args: argparse.Namespace) -> int:
    try:
        run_dir = check_run_dir(args.run_dir)
    except NotARunDir as exc:
        print(f"trainguard stacks: error: {exc}", file=sys.stderr)
        return 2
    summary = JobSummary()
    for e in read_events(run_dir):
        summary.apply(e)
    live = {n.node: n for n in summary.nodes.values() if n.state in LIVE and n.pids}
    if not live:
        print(f"trainguard stacks: no running workers in {run_dir} (job {summary.state})", file=sys.stderr)
        return 1
    here = set() if args.via_agents else _local_names(args)
    results: list[tuple[str, dict[str, Any]]] = []  # (node, dump dict)
    remote = sorted(n for n in live if n not in here)
    for name in sorted(set(live) & here):
        pids = _verified(live[name])
        if pids is None:  # the workers changed since the event: let the agent answer
            remote.append(name)
            continue
        results += [(name, stacks.to_dict(d)) for d in stacks.dump_all(pids).values()]
    problems = []
    if remote:
        try:
            answers, missing = _ask_agents(run_dir, remote, args.timeout)
        except OSError as exc:  # a read-only run dir, or stacks/ is not a directory
            print(f"trainguard stacks: error: cannot ask the agents through {run_dir / req.STACKS_DIR}: "
                  f"{exc.strerror or exc}", file=sys.stderr)
            return 2
        for name, answer in answers.items():
            results += [(name + " via its agent", d) for d in answer.get("dumps") or []]
        problems += [f"no answer from the agent of node {n} in {args.timeout:g} s (agent gone, or the run dir is "
                     "not shared with that node)" for n in missing]
    results.sort(key=lambda r: (r[1].get("rank") is None, r[1].get("rank")))
    for node, d in results:
        if args.json:
            print(json.dumps({"node": node, **d}))
        else:
            print("\n".join(stacks.format_dict(d, where=f"node {node}, ")))
    for p in problems:
        print(f"trainguard stacks: {p}", file=sys.stderr)
    return 0 if results and not problems else 1
