"""The job as one summary, folded from its events and step samples. Pure: no I/O, no clock.

One fold serves every view: the agent's Prometheus metrics (fed by its event bus and step
samples), ``trainguard status``, the dashboard (fed from the run directory) — so they never
disagree. It keeps the fault-tolerance counts of seed 003 (the maximum number of restarts, the
restarts used, the reschedules caused by hardware faults), the state of every node and rank, and
what happened: hangs, stragglers, diagnoses, checkpoints.
"""

from __future__ import annotations

import bisect
import math
import statistics
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any

from trainguard.events.bus import ROUTINE_KINDS
from trainguard.events.model import Event

# Span kinds that are a rank's own work (what the straggler detector compares), see detect/straggler.
OWN_WORK_KINDS = ("FP", "DataLoader")
SCORE_STEPS = 32  # recent steps per rank behind the straggler score
# The seed's exit message of a node isolated for a fault (policy.NODE_DOWN_MESSAGE), and the
# decision sources whose every exclusion is a hardware fault of the node: the GPU check after a
# worker failure, the periodic check, a NaN that reproduced on hardware with a fault.
NODE_DOWN = "The node is down."
HARDWARE_SOURCES = frozenset({"hardware_check", "health_check", "nan_triage"})
PRECHECK_HARDWARE_SCENARIO = 1  # policy.decide_before_start: a hardware item failed (gpu-check, rdma, node history)
NODE_STATES = ("starting", "running", "recovering", "restarting", "held", "failed", "succeeded", "excluded")
JOB_STATE_ORDER = ("recovering", "restarting", "running", "starting", "held", "failed", "succeeded", "excluded")
KEEP = 200  # diagnoses, hangs, stragglers, checkpoints kept in the summary


def restart_reason_label(source: str | None, membership: bool) -> str:
    """A small, stable label for trainguard_restarts_total{reason}."""
    if membership:
        return "membership"
    return {"worker_exit": "worker_failure", "": "worker_failure", None: "worker_failure"}.get(source, str(source))


def as_int(value: object, default: Any = None) -> Any:
    """An integer detail of an event, or ``default`` when it is missing or not an integer."""
    if isinstance(value, bool) or not isinstance(value, int | str):
        return default
    try:
        return int(value)
    except ValueError:
        return default


def pids_of(evidence: dict[str, Any]) -> dict[int, int]:
    """rank -> pid of a ``job_started`` event; entries that are not two integers are left out."""
    raw = evidence.get("pids")
    if not isinstance(raw, dict):
        return {}
    out = {}
    for r, p in raw.items():
        rank, pid = as_int(r), as_int(p)
        if rank is not None and pid is not None and 0 <= rank < 1 << 24 and 0 < pid < 1 << 31:
            out[rank] = pid
    return out


def is_hardware_exclusion(event: Event) -> bool:
    """Whether a ``node_excluded`` event is a reschedule for a hardware fault (seed 003's counter):
    a GPU fault, a node check (GEMM, collectives) that found the node faulty, a hardware item of the
    pre-check (gpu-check, rdma, the node history), a failure classified as hardware. Not the node's
    setup (a full disk, a name that does not resolve: seed scenario 2), a straggler or a restart loop."""
    ev = event.evidence or {}
    source = ev.get("source")
    if source in HARDWARE_SOURCES:
        return True
    if source == "precheck":
        return ev.get("scenario") == PRECHECK_HARDWARE_SCENARIO
    if source == "node_check":  # faulty: "The node is down."; a straggler leaves with another line
        return event.message.startswith(NODE_DOWN)
    cause = ev.get("cause")
    return source == "worker_exit" and isinstance(cause, dict) and cause.get("kind") == "hardware"


@dataclass
class _Attempt:
    """One rank's steps in one attempt (worker process)."""

    start: float
    node: str
    pid: int | None
    resume: int = 0  # training step it resumed from (checkpoint_loaded), 0 when fresh/unknown
    steps: int = 0  # steps finished in this attempt (the recorder's count)
    last_end: float | None = None
    last_duration: float | None = None


@dataclass
class RankState:
    rank: int
    attempts: list[_Attempt] = field(default_factory=list)
    durations: deque[float] = field(default_factory=lambda: deque(maxlen=SCORE_STEPS))
    own: dict[tuple[int, int], float] = field(default_factory=dict)  # (attempt index, step) -> own work s
    last_event: Event | None = None
    save_stall: float | None = None  # duration of its newest SaveCheckpoint span
    straggler: dict[str, Any] | None = None  # newest straggler_detected evidence

    def attempt_at(self, t: float) -> int | None:
        starts = [a.start for a in self.attempts]
        i = bisect.bisect_right(starts, t) - 1
        return i if i >= 0 else None

    def own_median(self) -> float | None:
        if len(self.own) < 2:
            return None
        newest = max(self.own)
        values = [v for k, v in self.own.items() if k != newest]  # the newest step may be incomplete
        return statistics.median(values) if values else None


@dataclass
class NodeState:
    node: str
    state: str = "starting"
    attempt: int = -1
    max_restarts: int | None = None
    restarts_used: int = 0
    restarts: Counter = field(default_factory=Counter)  # reason label -> count
    failures: Counter = field(default_factory=Counter)  # category -> count
    hangs: int = 0
    ranks: list[int] = field(default_factory=list)
    pids: dict[int, int] = field(default_factory=dict)
    identity: dict[str, Any] = field(default_factory=dict)  # who the pids are (probes/identity.py)
    started: float | None = None  # current attempt's job_started time
    held_until: float | None = None
    metrics: str | None = None  # "addr:port" of its metrics endpoint
    last_event: Event | None = None
    _pending: list[int | None] = field(default_factory=list)  # failed ranks awaiting their diagnosis
    _category: str | None = None
    _source: str | None = None  # source of its newest policy decision


class JobSummary:
    """Fold events (``apply``) and step samples (``add_step``, ``add_span``) into the job's state."""

    def __init__(self) -> None:
        self.nodes: dict[str, NodeState] = {}
        self.ranks: dict[int, RankState] = {}
        self.hardware_reschedules = 0
        self._lost: set[str] = set()  # nodes counted lost (each survivor reports them) until they start again
        self.hangs: deque[dict[str, Any]] = deque(maxlen=KEEP)
        self.stragglers: deque[dict[str, Any]] = deque(maxlen=KEEP)
        self.diagnoses: deque[dict[str, Any]] = deque(maxlen=KEEP)
        self.checkpoints: deque[dict[str, Any]] = deque(maxlen=50)  # persisted: frequent, the newest only
        self.restores: deque[dict[str, Any]] = deque(maxlen=KEEP)  # loaded and failed: rare, all kept
        self.checkpoint_last_step: int | None = None
        self.first_time: float | None = None
        self.last_time: float | None = None
        self.events = 0
        self.damaged = 0  # events whose details could not be folded in
        self._seen_ids: set[tuple[str, int]] = set()

    # ---- events ---------------------------------------------------------------------------------
    def apply(self, e: Event) -> None:
        if e.id is not None:
            # The same event from the bus and from the store. Ids are per node database (or per
            # merged reader), so the node is part of the key.
            key = (e.node, e.id)
            if key in self._seen_ids:
                return
            self._seen_ids.add(key)
        self.events += 1
        self.first_time = e.time if self.first_time is None else min(self.first_time, e.time)
        self.last_time = e.time if self.last_time is None else max(self.last_time, e.time)
        n = self.nodes.setdefault(e.node, NodeState(e.node))
        n.last_event = e
        if e.rank is not None and e.kind not in ROUTINE_KINDS:
            self._rank(e.rank).last_event = e
        handler = getattr(self, "_on_" + e.kind, None)
        if handler is not None:
            try:
                handler(n, e)
            except (ValueError, TypeError, AttributeError, KeyError, OverflowError):
                # Details of a type this trainguard never writes (a damaged or foreign row): the
                # event is counted and shown, its details are not folded in. Never a crash.
                self.damaged += 1

    def _rank(self, rank: int) -> RankState:
        return self.ranks.setdefault(rank, RankState(rank))

    def _flush_failures(self, n: NodeState) -> None:
        for _ in n._pending:
            n.failures[n._category or "unknown"] += 1
        n._pending, n._category = [], None

    def _on_job_started(self, n: NodeState, e: Event) -> None:
        ev = e.evidence
        self._lost.discard(n.node)  # back: a later loss counts again
        self._flush_failures(n)
        n.state, n.started, n.held_until = "running", e.time, None
        n.attempt = as_int(ev.get("attempt"), n.attempt + 1)
        n.max_restarts = as_int(ev.get("max_restarts"), n.max_restarts)
        n.pids = pids_of(ev)
        n.ranks = sorted(n.pids)
        n.identity = ev["identity"] if isinstance(ev.get("identity"), dict) else {}
        for rank, pid in n.pids.items():
            rs = self._rank(rank)
            rs.attempts.append(_Attempt(start=e.time, node=n.node, pid=pid))
            rs.attempts.sort(key=lambda a: a.start)

    def _on_restart(self, n: NodeState, e: Event) -> None:
        ev = e.evidence
        membership = bool(ev.get("membership_change"))
        n.state = "restarting"
        n.max_restarts = as_int(ev.get("max_restarts"), n.max_restarts)
        if not membership:
            n.restarts_used += 1
        n.restarts[restart_reason_label(n._source, membership)] += 1
        n._source = None
        self._flush_failures(n)

    def _on_worker_failed(self, n: NodeState, e: Event) -> None:
        n.state = "recovering"
        n._pending.append(e.rank)

    def _on_worker_lost_peer(self, n: NodeState, e: Event) -> None:
        n.state = "recovering"
        n._pending.append(e.rank)
        n._category = n._category or "lost_peer"

    def _on_diagnosis(self, n: NodeState, e: Event) -> None:
        ev = e.evidence
        n._category = str(ev.get("category") or "unknown")
        self.diagnoses.append({"time": e.time, "node": n.node, "rank": e.rank, "category": n._category,
                               "summary": ev.get("summary") or e.message, "fix": ev.get("fix"),
                               "confidence": ev.get("confidence"), "message": e.message})

    def _on_policy_decision(self, n: NodeState, e: Event) -> None:
        n._source = e.evidence.get("source")
        self._flush_failures(n)

    def _on_hang_detected(self, n: NodeState, e: Event) -> None:
        n.hangs += 1
        ev = e.evidence
        self.hangs.append({"time": e.time, "node": n.node, "rank": e.rank, "message": e.message,
                           "report": ev.get("report"), "cause": ev.get("cause") or ev.get("rule"),
                           "nodes": sorted(map(str, ev.get("nodes") or {})) if isinstance(ev.get("nodes"), dict | list) else []})

    def _on_straggler_detected(self, n: NodeState, e: Event) -> None:
        entry = {"time": e.time, "node": n.node, "rank": e.rank, "message": e.message,
                 "slower_by": e.evidence.get("slower_by"), "kind": e.evidence.get("kind"),
                 "steps": e.evidence.get("steps")}
        self.stragglers.append(entry)
        if e.rank is not None:
            self._rank(e.rank).straggler = entry

    def _on_checkpoint_persisted(self, n: NodeState, e: Event) -> None:
        step = e.evidence.get("step")
        if isinstance(step, int):
            self.checkpoint_last_step = max(step, self.checkpoint_last_step or 0)
        self.checkpoints.append({"time": e.time, "node": n.node, "kind": "persisted", "step": step,
                                 "bytes": e.evidence.get("bytes"), "seconds": e.evidence.get("seconds"),
                                 "trigger": e.evidence.get("trigger")})

    def _on_checkpoint_loaded(self, n: NodeState, e: Event) -> None:
        step = e.evidence.get("step")
        if not isinstance(step, int):
            return
        self.restores.append({"time": e.time, "node": n.node, "kind": "loaded", "step": step,
                                 "source": e.evidence.get("source"), "rank": e.rank})
        # Every rank of the attempt resumed from the same step (load_latest agrees across ranks).
        for rank in n.ranks:
            rs = self.ranks.get(rank)
            i = rs.attempt_at(e.time) if rs else None
            if rs is not None and i is not None:
                rs.attempts[i].resume = step

    def _on_checkpoint_failed(self, n: NodeState, e: Event) -> None:
        self.restores.append({"time": e.time, "node": n.node, "kind": "failed",
                                 "step": e.evidence.get("step"), "message": e.message})

    def _on_job_succeeded(self, n: NodeState, e: Event) -> None:
        n.state = "succeeded"

    def _on_job_failed(self, n: NodeState, e: Event) -> None:
        self._flush_failures(n)
        n.state = "failed"
        n.max_restarts = as_int(e.evidence.get("max_restarts"), n.max_restarts)

    def _on_node_excluded(self, n: NodeState, e: Event) -> None:
        self._flush_failures(n)
        n.state = "excluded"
        if is_hardware_exclusion(e):
            self.hardware_reschedules += 1

    def _on_node_lost(self, n: NodeState, e: Event) -> None:
        """A lost node (no heartbeat) is rescheduled without it: one reschedule per node lost,
        however many survivors report it."""
        lost = e.evidence.get("nodes")
        for name in lost if isinstance(lost, dict) else {}:
            if isinstance(name, str) and name not in self._lost:
                self._lost.add(name)
                self.hardware_reschedules += 1

    def _on_node_held(self, n: NodeState, e: Event) -> None:
        n.state = "held"
        until = e.evidence.get("until")
        n.held_until = float(until) if isinstance(until, int | float) and math.isfinite(until) else None

    def _on_hold_ended(self, n: NodeState, e: Event) -> None:
        n.state = str(e.evidence.get("state") or "failed")
        n.held_until = None

    def _on_metrics_listening(self, n: NodeState, e: Event) -> None:
        n.metrics = e.evidence.get("endpoint")

    # ---- step samples ---------------------------------------------------------------------------
    def add_step(self, rank: int, step: int, end: float, duration: float) -> None:
        rs = self._rank(rank)
        i = rs.attempt_at(end)
        if i is None:
            return  # before any job_started we know of
        a = rs.attempts[i]
        a.steps = max(a.steps, step)
        if a.last_end is None or end >= a.last_end:
            a.last_end, a.last_duration = end, duration
        if i == len(rs.attempts) - 1:
            rs.durations.append(duration)

    def add_span(self, rank: int, kind: str, step: int, start: float, end: float) -> None:
        if kind == "Step":
            self.add_step(rank, step, end, end - start)
            return
        rs = self._rank(rank)
        if kind == "SaveCheckpoint":
            rs.save_stall = end - start
            return
        if kind not in OWN_WORK_KINDS:
            return
        i = rs.attempt_at(end)
        if i is None:
            return
        key = (i, step)
        rs.own[key] = rs.own.get(key, 0.0) + (end - start)
        if len(rs.own) > SCORE_STEPS + 1:
            del rs.own[min(rs.own)]

    # ---- derived --------------------------------------------------------------------------------
    @property
    def max_restarts(self) -> int | None:
        known = [n.max_restarts for n in self.nodes.values() if n.max_restarts is not None]
        return max(known) if known else None

    @property
    def restarts_used(self) -> int:
        return sum(n.restarts_used for n in self.nodes.values())

    @property
    def state(self) -> str:
        states = {n.state for n in self.nodes.values()}
        if not states:
            return "starting"
        if states == {"succeeded", "excluded"}:
            return "succeeded"
        return min(states, key=JOB_STATE_ORDER.index)

    def straggler_scores(self) -> dict[int, float]:
        """Each rank's own work per step (compute + data loading) over its peers' median, as the
        straggler detector compares them; step time instead when no rank has FP spans. 1.0 = like
        its peers."""
        own = {r: m for r, rs in self.ranks.items() if (m := rs.own_median()) is not None}
        if len(own) < 2:
            own = {r: statistics.median(rs.durations) for r, rs in self.ranks.items() if len(rs.durations) >= 2}
        scores = {}
        for r, v in own.items():
            peers = statistics.median([p for q, p in own.items() if q != r]) if len(own) > 1 else 0.0
            if peers > 0:
                scores[r] = v / peers
        return scores

    def checkpoint_stall(self) -> float | None:
        stalls = [rs.save_stall for rs in self.ranks.values() if rs.save_stall is not None]
        return max(stalls) if stalls else None

    def restarts_by_reason(self) -> Counter:
        total: Counter = Counter()
        for n in self.nodes.values():
            total.update(n.restarts)
        return total

    def failures_by_category(self) -> Counter:
        total: Counter = Counter()
        for n in self.nodes.values():
            total.update(n.failures)
        return total

    def rank_rows(self) -> list[dict[str, Any]]:
        scores = self.straggler_scores()
        rows = []
        for rank, rs in sorted(self.ranks.items()):
            a = rs.attempts[-1] if rs.attempts else None
            ev = rs.last_event
            rows.append({
                "rank": rank,
                "node": a.node if a else None,
                "pid": a.pid if a else None,
                "attempt": len(rs.attempts) - 1,
                "step": (a.resume + a.steps) if a and (a.steps or a.resume) else None,
                "step_time": a.last_duration if a else None,
                "last_step_at": a.last_end if a else None,
                "straggler_score": scores.get(rank),
                "straggler": rs.straggler is not None,
                "save_stall": rs.save_stall,
                "last_event": None if ev is None else {"kind": ev.kind, "message": ev.message, "time": ev.time,
                                                       "severity": ev.severity.label},
            })
        return rows

    def snapshot(self) -> dict[str, Any]:
        """Everything as plain JSON data (the dashboard's API, ``status --json``)."""
        return {
            "state": self.state,
            "max_restarts": self.max_restarts,
            "restarts_used": self.restarts_used,
            "hardware_reschedules": self.hardware_reschedules,
            "hangs": sum(n.hangs for n in self.nodes.values()),
            "restarts_by_reason": dict(self.restarts_by_reason()),
            "failures_by_category": dict(self.failures_by_category()),
            "checkpoint_last_step": self.checkpoint_last_step,
            "checkpoint_stall_seconds": self.checkpoint_stall(),
            "first_time": self.first_time,
            "last_time": self.last_time,
            "nodes": [
                {"node": n.node, "state": n.state, "attempt": n.attempt, "max_restarts": n.max_restarts,
                 "restarts_used": n.restarts_used, "ranks": n.ranks, "held_until": n.held_until,
                 "metrics": n.metrics,
                 "last_event": None if n.last_event is None else {"kind": n.last_event.kind, "time": n.last_event.time,
                                                                  "message": n.last_event.message}}
                for n in sorted(self.nodes.values(), key=lambda n: n.node)
            ],
            "ranks": self.rank_rows(),
            "stragglers": list(self.stragglers),
            "diagnoses": list(self.diagnoses),
            "hang_events": list(self.hangs),
            "checkpoints": sorted([*self.checkpoints, *self.restores], key=lambda c: c["time"]),
        }


class StepHeat:
    """Mean step time per rank in time bins, for the heatmap. Bins start at 0.25 s and double in
    width when there are too many, so a week-long job costs the same memory as a minute."""

    def __init__(self, max_bins: int = 4096, width: float = 0.25) -> None:
        self.width = width
        self.max_bins = max_bins
        self.t0: float | None = None
        self._bins: dict[int, dict[int, list[float]]] = {}  # rank -> bin -> [sum, n]

    def add(self, rank: int, end: float, duration: float) -> None:
        if self.t0 is None:
            self.t0 = end - duration
        b = int(max(0.0, end - self.t0) // self.width)
        cell = self._bins.setdefault(rank, {}).setdefault(b, [0.0, 0])
        cell[0] += duration
        cell[1] += 1
        if b >= self.max_bins:
            self._coarsen()

    def _coarsen(self) -> None:
        self.width *= 2
        for rank, bins in self._bins.items():
            merged: dict[int, list[float]] = {}
            for b, (s, n) in bins.items():
                m = merged.setdefault(b // 2, [0.0, 0])
                m[0] += s
                m[1] += n
            self._bins[rank] = merged

    def render(self, columns: int = 80, start: float | None = None, end: float | None = None) -> dict[str, Any]:
        """{t0, width (s per column), ranks, cells: per rank a list of mean step seconds or None},
        columns covering [start, end] (default: the steps' own range), so gaps show as empty cells."""
        if self.t0 is None or not self._bins:
            return {"t0": None, "width": None, "ranks": [], "cells": [], "median": None}
        last = self.t0 + (max(max(b) for b in self._bins.values() if b) + 1) * self.width
        start = self.t0 if start is None else min(start, self.t0)
        end = last if end is None else max(end, last)
        width = max(self.width, (end - start) / columns)
        ncols = max(1, min(columns, int(-(-(end - start) // width))))
        ranks = sorted(self._bins)
        cells = []
        for r in ranks:
            row: list[list[float]] = [[0.0, 0] for _ in range(ncols)]
            for b, (s, n) in self._bins[r].items():
                col = min(ncols - 1, int((self.t0 + b * self.width - start) // width))
                row[col][0] += s
                row[col][1] += n
            cells.append([round(s / n, 6) if n else None for s, n in row])
        values = [v for row in cells for v in row if v is not None]
        return {"t0": start, "width": width, "ranks": ranks, "cells": cells,
                "median": statistics.median(values) if values else None}
