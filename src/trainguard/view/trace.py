"""A run as Chrome / Perfetto trace-event JSON: process = node, thread = rank.

Every rank's spans are complete events ("X"), trainguard's events are instants ("i") on the rank
they name (or on the node's agent track), and every attempt is a slice on the agent track, so a
restart shows as the gap between two attempts. Times are microseconds since the run's first
event (``otherData.t0_unix`` gives it). Format:
https://docs.google.com/document/d/1CvAClvFfyA5R-PhYUmn5OOQtYMH4h6I0nSsKchNAySU
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from typing import IO, Any

from trainguard.events.model import Event
from trainguard.events.summary import JobSummary
from trainguard.rundir.readers import Span
from trainguard.view.goodput import Goodput

AGENT_TID = 1_000_000  # the agent's own track in each node's process (ranks use tid = rank)
EVIDENCE_LIMIT = 2000  # characters of an event's evidence kept in its args
ATTEMPT_END_KINDS = ("restart", "job_succeeded", "job_failed", "node_excluded")


def _us(t: float, t0: float) -> float:
    return round((t - t0) * 1e6, 3)


def _evidence(ev: dict[str, Any]) -> Any:
    text = json.dumps(ev, default=str)
    return ev if len(text) <= EVIDENCE_LIMIT else text[:EVIDENCE_LIMIT] + "…"


def build(events: list[Event], spans: Iterable[Span], goodput: Goodput | None = None) -> dict[str, Any]:
    """The whole trace as one object (small runs, tests); ``write`` streams it."""
    spans = list(spans)
    counts: dict[str, int] = {}
    out = list(trace_events(events, spans, start_time(events, spans), counts))
    return {"traceEvents": out, "displayTimeUnit": "ms", "otherData": _other(events, counts, goodput)}


def start_time(events: list[Event], spans: Iterable[Span]) -> float:
    """t0 of the trace: the run's first event or span."""
    first = min((e.time for e in events), default=float("inf"))
    first = min(first, min((s.start for s in spans), default=float("inf")))
    return first if first != float("inf") else 0.0


def _other(events: list[Event], counts: dict[str, int], goodput: Goodput | None) -> dict[str, Any]:
    other: dict[str, Any] = {"t0_unix": counts.get("t0", 0.0), "spans": counts.get("spans", 0),
                             "events": len(events), "tool": "trainguard trace"}
    if goodput is not None:
        other["goodput"] = goodput.to_dict()
        other["goodput_line"] = goodput.line()
    return other


def write(out: IO[bytes], events: list[Event], spans: Iterable[Span], t0: float,
          goodput: Goodput | None = None) -> dict[str, Any]:
    """Write the trace JSON to ``out`` one trace event at a time (a run dir of gigabytes of span
    records is never held in memory); returns its ``otherData``."""
    counts: dict[str, int] = {}
    out.write(b'{"traceEvents":[')
    sep = b""
    for item in trace_events(events, spans, t0, counts):
        out.write(sep + json.dumps(item, separators=(",", ":"), default=str).encode())
        sep = b",\n"
    other = _other(events, counts, goodput)
    out.write(b'],"displayTimeUnit":"ms","otherData":' + json.dumps(other, separators=(",", ":")).encode() + b"}\n")
    return other


def trace_events(events: list[Event], spans: Iterable[Span], t0: float, counts: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Every trace event, spans consumed once in their order; ``counts`` gets t0 and the spans kept."""
    events = sorted(events, key=lambda e: (e.time, e.id or 0))
    summary = JobSummary()
    for e in events:
        summary.apply(e)
    counts["t0"] = t0
    pids: dict[str, int] = {}
    meta: list[dict[str, Any]] = []  # metadata made while making an event: yielded before it
    threads: set[tuple[int, int]] = set()

    def pid_of(node: str) -> int:
        if node not in pids:
            pids[node] = len(pids) + 1
            meta.append({"ph": "M", "name": "process_name", "pid": pids[node], "tid": 0, "args": {"name": f"node {node}"}})
            meta.append({"ph": "M", "name": "process_sort_index", "pid": pids[node], "tid": 0, "args": {"sort_index": pids[node]}})
            thread(pids[node], AGENT_TID, "agent: attempts and events", -1)
        return pids[node]

    def thread(pid: int, tid: int, name: str, sort: int) -> None:
        if (pid, tid) in threads:
            return
        threads.add((pid, tid))
        meta.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": name}})
        meta.append({"ph": "M", "name": "thread_sort_index", "pid": pid, "tid": tid, "args": {"sort_index": sort}})

    def flush(item: dict[str, Any] | None = None) -> Iterator[dict[str, Any]]:
        yield from meta
        meta.clear()
        if item is not None:
            yield item

    for node in sorted(summary.nodes):
        pid_of(node)
    attempts: list[dict[str, Any]] = []
    _attempts(events, t0, pid_of, attempts)
    yield from flush()
    yield from attempts
    counts["spans"] = 0
    for s in spans:
        rs = summary.ranks.get(s.rank)
        i = rs.attempt_at(s.end) if rs else None
        if rs is None or i is None:
            continue  # a span from before any attempt we know of
        pid = pid_of(rs.attempts[i].node)
        thread(pid, s.rank, f"rank {s.rank}", s.rank)
        counts["spans"] += 1
        yield from flush({"ph": "X", "name": s.name, "cat": s.kind, "pid": pid, "tid": s.rank, "ts": _us(s.start, t0),
                          "dur": round(max(0.0, s.duration) * 1e6, 3), "args": {"step": s.step, "attempt": i}})
    for e in events:
        pid = pid_of(e.node)
        tid = AGENT_TID if e.rank is None else e.rank
        if e.rank is not None:
            thread(pid, e.rank, f"rank {e.rank}", e.rank)
        yield from flush({"ph": "i", "s": "t", "name": e.kind, "cat": f"event,{e.severity.label}", "pid": pid,
                          "tid": tid, "ts": _us(e.time, t0),
                          "args": {"message": e.message, "severity": e.severity.label, "evidence": _evidence(e.evidence)}})


def _attempts(events: list[Event], t0: float, pid_of, out: list[dict[str, Any]]) -> None:
    """One slice per attempt of each node: from job_started to what ended it."""
    open_: dict[str, Event] = {}
    last = events[-1].time if events else t0

    def close(node: str, end: float, how: str) -> None:
        start = open_.pop(node)
        out.append({"ph": "X", "name": f"attempt {start.evidence.get('attempt', '?')}", "cat": "attempt",
                    "pid": pid_of(node), "tid": AGENT_TID, "ts": _us(start.time, t0),
                    "dur": round(max(0.0, end - start.time) * 1e6, 3),
                    "args": {"ended_by": how, "pids": start.evidence.get("pids"), "message": start.message}})

    for e in events:
        if e.kind == "job_started":
            if e.node in open_:
                close(e.node, e.time, "job_started")
            open_[e.node] = e
        elif e.kind in ATTEMPT_END_KINDS and e.node in open_:
            close(e.node, e.time, e.kind)
    for node in list(open_):
        close(node, last, "still running")


def validate(trace: dict[str, Any]) -> list[str]:
    """Problems with a trace-event JSON object (empty list: well formed), per the format's rules."""
    problems = []
    evs = trace.get("traceEvents")
    if not isinstance(evs, list):
        return ["traceEvents is not a list"]
    for i, e in enumerate(evs):
        ph = e.get("ph")
        if ph not in ("X", "i", "M"):
            problems.append(f"{i}: unexpected phase {ph!r}")
            continue
        if not isinstance(e.get("pid"), int) or not isinstance(e.get("tid"), int):
            problems.append(f"{i}: pid/tid must be integers")
        if not isinstance(e.get("name"), str):
            problems.append(f"{i}: name must be a string")
        if ph == "M":
            if e["name"] not in ("process_name", "thread_name", "process_sort_index", "thread_sort_index"):
                problems.append(f"{i}: unknown metadata {e['name']!r}")
            continue
        if not isinstance(e.get("ts"), int | float) or e["ts"] < 0:
            problems.append(f"{i}: ts must be a number >= 0")
        if ph == "X" and (not isinstance(e.get("dur"), int | float) or e["dur"] < 0):
            problems.append(f"{i}: dur must be a number >= 0")
        if ph == "i" and e.get("s") not in ("g", "p", "t"):
            problems.append(f"{i}: instant scope must be g, p or t")
    return problems
