"""Goodput: how much of a job's wall time trained the model, and where the rest went. Pure.

From the events and one reference rank's steps (a synchronous job's ranks step together):

- productive: the steps whose result was kept;
- detection:  from the fault (a worker's exit, or the last step before a hang) to trainguard's
              event that found it (worker_failed, hang_detected);
- restart:    from that event to the first step of the next attempt (stopping, rendezvous,
              starting workers, loading the checkpoint);
- lost work:  steps done after the checkpoint the next attempt resumed from (done again), and
              the step in flight when the fault hit;
- other:      the rest — pre-flight checks, the first start, the end.
"""

from __future__ import annotations

import bisect
from dataclasses import asdict, dataclass
from typing import Any

from trainguard.events.model import Event
from trainguard.events.summary import pids_of

FAULT_KINDS = ("worker_failed", "worker_lost_peer", "hang_detected")
END_KINDS = ("job_succeeded", "job_failed", "node_excluded")


@dataclass
class Goodput:
    wall: float = 0.0
    productive: float = 0.0
    detection: float = 0.0
    restart: float = 0.0
    lost: float = 0.0
    lost_steps: int = 0
    other: float = 0.0
    attempts: int = 0
    faults: int = 0
    reference_rank: int | None = None
    lost_known: bool = True  # False: an attempt resumed without a checkpoint_loaded event

    @property
    def ratio(self) -> float:
        return self.productive / self.wall if self.wall > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "goodput": round(self.ratio, 4)}

    def line(self) -> str:
        if self.wall <= 0:
            return "goodput: no steps recorded"
        lost = f"lost work {self.lost:.1f} s ({self.lost_steps} step(s) redone)"
        if not self.lost_known:
            lost += ", resume steps unknown"
        return (f"goodput {100 * self.ratio:.1f}% of {self.wall:.1f} s: productive {self.productive:.1f} s, "
                f"detection {self.detection:.1f} s, restart {self.restart:.1f} s, {lost}, "
                f"other {self.other:.1f} s (pre-checks, start, end); {self.attempts} attempt(s), {self.faults} fault(s)")


def compute(events: list[Event], steps: dict[int, list[tuple[float, float]]]) -> Goodput:
    """``steps``: rank -> [(end, duration)] in seconds, any order."""
    g = Goodput()
    ranks = sorted(r for r, s in steps.items() if s)
    if not events or not ranks:
        return g
    ref = g.reference_rank = ranks[0]
    events = sorted(events, key=lambda e: e.time)
    starts = [e.time for e in events if e.kind == "job_started" and ref in pids_of(e.evidence)]
    if not starts:
        return g
    ref_steps = sorted(steps[ref])
    ends = [e.time for e in events if e.kind in END_KINDS]
    t0 = events[0].time
    t1 = max(ends) if ends else max(events[-1].time, ref_steps[-1][0])
    t1 = max(t1, ref_steps[-1][0])
    g.wall = t1 - t0
    g.attempts = len(starts)
    bounds = [*starts, float("inf")]
    by_attempt: list[list[tuple[float, float]]] = [[] for _ in starts]
    for end, dur in ref_steps:
        i = bisect.bisect_right(starts, end) - 1
        if i >= 0:
            by_attempt[i].append((end, dur))
    resume = [_resume(events, bounds[i], bounds[i + 1]) for i in range(len(starts))]
    for i, s in enumerate(by_attempt):
        kept = len(s)
        if i + 1 < len(starts):
            nxt = resume[i + 1]
            if nxt is None:
                g.lost_known = False
            else:
                kept = max(0, min(len(s), nxt - (resume[i] or 0)))
            g.lost_steps += len(s) - kept
            g.lost += sum(d for _, d in s[kept:])
            last_end = s[-1][0] if s else starts[i]
            first_next = by_attempt[i + 1][0] if by_attempt[i + 1] else None
            resumed_at = first_next[0] - first_next[1] if first_next else bounds[i + 1]
            fault = _fault(events, starts[i], bounds[i + 1], last_end)
            if fault is not None:
                fault_time, found = fault
                g.faults += 1
                g.lost += max(0.0, fault_time - last_end)  # the step in flight
                g.detection += max(0.0, found - fault_time)
                g.restart += max(0.0, resumed_at - found)
            else:  # a membership change: no fault, the gap is the restart
                g.restart += max(0.0, resumed_at - last_end)
        g.productive += sum(d for _, d in s[:kept])
    g.other = max(0.0, g.wall - g.productive - g.detection - g.restart - g.lost)
    return g


def _resume(events: list[Event], lo: float, hi: float) -> int | None:
    """The step an attempt resumed from: its checkpoint_loaded event; 0 for the first attempt."""
    for e in events:
        if lo <= e.time < hi and e.kind == "checkpoint_loaded" and isinstance(e.evidence.get("step"), int):
            return int(e.evidence["step"])
    return 0 if lo == min((e.time for e in events if e.kind == "job_started"), default=lo) else None


def _fault(events: list[Event], lo: float, hi: float, last_step_end: float) -> tuple[float, float] | None:
    """(when the fault happened, when trainguard found it) within one attempt, or None."""
    for e in events:
        if not (lo <= e.time < hi) or e.kind not in FAULT_KINDS:
            continue
        if e.kind == "hang_detected":
            return last_step_end, e.time
        exit_time = e.evidence.get("exit_time")
        when = float(exit_time) if isinstance(exit_time, int | float) else e.time
        return min(when, e.time), e.time
    return None
