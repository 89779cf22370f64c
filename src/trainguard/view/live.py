"""A run directory kept folded: new events and spans are read on every ``refresh()``."""

from __future__ import annotations

import threading
import time
from collections import defaultdict, deque
from pathlib import Path
from typing import Any

from trainguard.events.model import Event
from trainguard.events.summary import JobSummary, StepHeat
from trainguard.rundir.readers import EventTail, SpanTail, check_run_dir
from trainguard.view.goodput import compute as compute_goodput

# A live view reads only this much of each rank's newest record file when it starts.
LIVE_START_BYTES = 4 << 20
KEEP_EVENTS = 5000
KEEP_STEPS = 20000  # per rank, for goodput
LIVE_STATES = ("starting", "running", "recovering", "restarting")


class RunView:
    def __init__(self, run_dir: str | Path, start_bytes: int | None = LIVE_START_BYTES) -> None:
        self.run_dir = check_run_dir(run_dir)
        self.summary = JobSummary()
        self.heat = StepHeat()
        self.events: deque[Event] = deque(maxlen=KEEP_EVENTS)
        self.steps: dict[int, deque[tuple[float, float]]] = defaultdict(lambda: deque(maxlen=KEEP_STEPS))
        self._events = EventTail(self.run_dir)
        self._spans = SpanTail(self.run_dir, start_bytes=start_bytes)
        self._lock = threading.Lock()

    def refresh(self) -> list[Event]:
        """Read what is new; returns the new events."""
        with self._lock:
            new = self._events.read()
            for e in new:
                self.summary.apply(e)
                self.events.append(e)
            for s in self._spans.read():
                self.summary.add_span(s.rank, s.kind, s.step, s.start, s.end)
                if s.kind == "Step":
                    self.heat.add(s.rank, s.end, s.duration)
                    self.steps[s.rank].append((s.end, s.duration))
            return new

    def goodput(self):
        with self._lock:
            return compute_goodput(list(self.events), {r: list(v) for r, v in self.steps.items()})

    def snapshot(self, columns: int = 80) -> dict[str, Any]:
        with self._lock:
            snap = self.summary.snapshot()
            end = max(filter(None, [snap["last_time"], time.time() if snap["state"] in LIVE_STATES else None]), default=None)
            snap["heatmap"] = self.heat.render(columns, snap["first_time"], end)
        g = self.goodput()
        snap["goodput"], snap["goodput_line"] = g.to_dict(), g.line()
        return snap

    def close(self) -> None:
        self._events.close()
