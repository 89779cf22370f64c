"""The readable hang report: RUN_DIR/hang-<time>-<node>-attempt<n>.txt."""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass, field
from pathlib import Path

from trainguard.detect.culprit import CulpritVerdict, RankView
from trainguard.detect.hang import Assessment
from trainguard.probes.stacks import StackDump


def report_path(run_dir: Path, when: float, node: str, attempt: int, suffix: str = "") -> Path:
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(when))
    safe_node = re.sub(r"[^A-Za-z0-9_.-]", "_", node) or "node"
    return Path(run_dir) / f"hang-{stamp}-{safe_node}-attempt{attempt}{suffix}.txt"


@dataclass(frozen=True)
class HangReport:
    """Everything the report shows about one confirmed hang."""

    when: float
    node: str
    attempt: int
    assessment: Assessment
    verdict: CulpritVerdict
    dumps: dict[int, StackDump]
    remote: dict[int, RankView] = field(default_factory=dict)  # other nodes' ranks
    level: str = "detected"  # or "suspected": steps stopped, the culprit still progresses
    nodes: dict[str, dict] = field(default_factory=dict)  # several nodes: what each saw (NodeViews.evidence)
    sequence: list[str] = field(default_factory=list)  # ranks in different collectives (detect/sequence.py)


def render(r: HangReport) -> str:
    when, node, attempt, assessment, verdict, dumps, remote = (
        r.when, r.node, r.attempt, r.assessment, r.verdict, r.dumps, r.remote
    )
    culprit = "unknown (see reason)" if verdict.rank is None else f"rank {verdict.rank}"
    lines = [
        "trainguard hang report" + (" (suspected: the candidate is busy, progressing or waiting on the outside world; watching)" if r.level == "suspected" else ""),
        f"time:    {time.strftime('%Y-%m-%dT%H:%M:%S%z', time.localtime(when))}",
        f"node:    {node}    attempt: {attempt}",
        f"culprit: {culprit}",
        f"reason:  {verdict.reason}",
        f"rule:    {assessment.rule}: {assessment.message}",
    ]
    if verdict.candidates and len(verdict.candidates) > 1:
        lines.append(f"odd ranks: {', '.join(map(str, verdict.candidates))}")
    if verdict.causes:
        lines += ["", "known causes shown by the evidence:"]
        lines += [f"  - {c['cause']}: {c['advice']}" for c in verdict.causes]
    lines += ["", "ranks:"]
    for rank, position in sorted(verdict.positions.items()):
        d = dumps.get(rank)
        pid = d.pid if d else "?"
        state = d.state if d else "?"
        mark = "  <== culprit" if rank == verdict.rank else ""
        lines.append(f"  rank {rank} (pid {pid}, state {state or 'gone'}): {position.describe()}{mark}")
    if r.sequence:
        lines += ["", "collective sequence (ranks in different collectives):"] + [f"  {ln}" for ln in r.sequence]
    lines += _nodes(r.nodes)
    lines += ["", "signals:"]
    lines += ["  " + ln for ln in json.dumps(assessment.signals, indent=2, default=str).splitlines()]
    lines += ["", "stacks (innermost frame first):"]
    for rank, d in sorted(dumps.items()):
        lines.append(f"--- rank {rank} pid {d.pid} state {d.state or 'gone'}"
                     + (" (read without pausing: process stopped)" if d.nonblocking else "") + " ---")
        if d.error:
            lines.append(f"  stack unavailable: {d.error}")
        for t in d.threads:
            flags = ", ".join(f for f, on in (("active", t.active), ("holds GIL", t.owns_gil)) if on) or "idle"
            lines.append(f"  Thread {t.name or t.thread_id} ({flags}):")
            lines += [f"      {fr.name} ({fr.filename}:{fr.line})" for fr in t.frames]
    for rank, view in sorted((remote or {}).items()):
        lines.append(f"--- rank {rank} (another node) state {view.state or 'gone'} ---")
        if view.error:
            lines.append(f"  stack unavailable: {view.error}")
        lines += [f"      {fr.name} ({fr.filename}:{fr.line})" for fr in view.frames]
    return "\n".join(lines) + "\n"


def _nodes(nodes: dict[str, dict]) -> list[str]:
    """What each node saw when it judged the stall (the verdict is the job's, recorded once)."""
    if not nodes:
        return []
    lines = ["", "nodes (what each node saw):"]
    for name, n in nodes.items():
        seen = "found no progress" if n.get("declared") else "latest view, had not judged it a hang"
        candidate = f"candidate rank {n['culprit']}" if n.get("culprit") is not None else "no local candidate"
        lines.append(f"  {name} (node rank {n.get('node_rank')}, {seen}): {candidate}: {n.get('reason') or '-'}")
        for rank, x in n.get("ranks", {}).items():
            lines.append(f"    rank {rank}: {x.get('progress') or 'not judged'}, {x.get('position') or x.get('state')}")
    return lines


def write_report(run_dir: Path, report: HangReport) -> Path:
    suffix = "-suspected" if report.level == "suspected" else ""
    path = report_path(run_dir, report.when, report.node, report.attempt, suffix)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(render(report), encoding="utf-8")
    tmp.replace(path)
    return path
