"""Live slowdown detection inside ``trainguard run`` (seed 003): the agent follows its ranks' logs.

A thread reads what the workers' log pumps append to ``RUN_DIR/logs/attempt-<n>/rank-<r>.log`` and
finds step times with the same parser and detector as ``trainguard slowdown`` (Megatron-LM
iteration lines, HF Trainer / LLaMA-Factory progress bars and JSON rows, DeepSpeed, ``step=``
lines). A slowdown is reported with the seed's exact warning line, the log's time first::

    2025-04-21 15:25:56 Smoothed mean (iters 83-87: 9465.00 ms, baseline: 3101.00 ms), threshold ratio:2.05. Warning

One series per node: the lowest local rank whose log shows step times (Megatron-LM prints them on
the last rank, HF Trainer and LLaMA-Factory on rank 0; other ranks printing the same job-wide
numbers would only repeat it). A slowdown is evidence, never a decision (seed 003: a slow job keeps
running): a ``slowdown_detected`` event (severity warning, notified like any event) when it starts
and again each time it has doubled since the last event; every warning line also goes to the
agent log (``RUN_DIR/agent-<node>.log``), like the seed's fault-tolerance log. The baseline is kept
across restarts (the same job); the open window and the clock anchors are not (the restart's
downtime is no step's time).
"""

from __future__ import annotations

import argparse
import logging
import re
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from trainguard.detect.slowdown import DEFAULT_THRESHOLD, DEFAULT_WINDOW, SlowdownWarning
from trainguard.diagnose.slowdown_cli import SlowdownFollower
from trainguard.diagnose.steplog import StepTimer
from trainguard.monitors.api import Monitor, MonitorContext
from trainguard.options import given, positive, positive_int
from trainguard.spawn.logs import attempt_dir, rank_log_path

log = logging.getLogger(__name__)

TICK_S = 0.5
READ_LIMIT = 1 << 20  # bytes read per log per tick: a flood of output cannot stall the thread
MAX_LINE = 1 << 16  # longer lines are not step lines (and are not kept whole)
_EOL = re.compile(rb"\r\n|\r|\n")


@dataclass(frozen=True)
class SlowdownSettings:
    enabled: bool = True
    window: int = DEFAULT_WINDOW  # iterations per smoothed mean
    threshold: float = DEFAULT_THRESHOLD  # warn when smoothed mean / fastest smoothed mean - 1 reaches it

    @classmethod
    def from_options(cls, options: argparse.Namespace) -> SlowdownSettings:
        if options.slowdown == "off":
            return cls(enabled=False)
        return cls(**given(options, {"window": "slowdown_window", "threshold": "slowdown_threshold"}))


def add_run_arguments(group: argparse._ArgumentGroup) -> None:
    group.add_argument("--slowdown", choices=["on", "off"], default="on",
                       help="follow the ranks' logs and warn when training slows down (seed 003 warning lines)")
    group.add_argument("--slowdown-window", type=positive_int, default=None, metavar="ITERS",
                       help=f"iterations per smoothed mean (default {SlowdownSettings.window})")
    group.add_argument("--slowdown-threshold", type=positive, default=None, metavar="R",
                       help="warn when smoothed mean / fastest smoothed mean - 1 reaches R "
                       f"(default {SlowdownSettings.threshold:g}, the seed's)")


def settings(options: argparse.Namespace) -> SlowdownSettings:
    return SlowdownSettings.from_options(options)


def create(settings: SlowdownSettings) -> SlowdownMonitor | None:
    if not settings.enabled:
        return None
    return SlowdownMonitor(window=settings.window, threshold=settings.threshold)


class _Tail:
    """New complete lines of one growing file, from a starting offset."""

    def __init__(self, path: Path, offset: int) -> None:
        self.path = path
        self.offset = offset
        self._f: IO[bytes] | None = None
        self._buf = b""

    def lines(self) -> list[str]:
        if self._f is None:
            try:
                self._f = open(self.path, "rb")  # noqa: SIM115 - kept open across ticks
            except OSError:
                return []
            self._f.seek(self.offset)
        try:
            data = self._f.read(READ_LIMIT)
        except OSError:
            return []
        if not data:
            return []
        parts = _EOL.split(self._buf + data)
        self._buf = parts.pop()
        if len(self._buf) > MAX_LINE:
            self._buf = b""
        return [p.decode("utf-8", errors="replace") for p in parts if p and len(p) <= MAX_LINE]

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None


class SlowdownMonitor(Monitor):
    name = "slowdown"

    def __init__(self, window: int = DEFAULT_WINDOW, threshold: float = DEFAULT_THRESHOLD, tick_s: float = TICK_S) -> None:
        self.window = window
        self.threshold = threshold
        self.tick_s = tick_s
        self._followers: dict[int, SlowdownFollower] = {}  # per rank, kept across attempts
        self._tails: dict[int, _Tail] = {}
        self._sizes: dict[Path, int] = {}  # log sizes before the attempt started (a reused run dir)
        self._reported: float | None = None  # mean/baseline of the last event; None: not slow now
        self._suppressed = 0
        self._bus: Any = None
        self._lock = threading.Lock()  # one tick at a time: the thread's, or the agent's final one
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ---- agent hooks ------------------------------------------------------------------------------
    def on_before_start(self, ctx: MonitorContext) -> None:
        # Rank logs are appended to: what a previous run into this run dir wrote is not this job's.
        try:
            self._sizes = {p: p.stat().st_size for p in attempt_dir(ctx.run_dir, ctx.restart_count).glob("rank-*.log")}
        except OSError:
            self._sizes = {}
        return None

    def on_workers_started(self, ctx: MonitorContext) -> None:
        with self._lock:
            self._bus = ctx.events
            self._drain()
            for t in self._tails.values():
                t.close()
            self._tails = {}
            for fol in self._followers.values():  # the time between attempts is no step's time
                fol.timer = StepTimer()
                fol.detector.drop_window()
            for w in ctx.workers:
                path = rank_log_path(ctx.run_dir, ctx.restart_count, w.global_rank)
                self._tails[w.global_rank] = _Tail(path, self._sizes.get(path, 0))
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="trainguard-slowdown", daemon=True)
            self._thread.start()

    def on_workers_stopped(self, ctx: MonitorContext) -> None:
        with self._lock:
            self._drain()  # what the workers printed last

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        with self._lock:
            self._drain()
            for t in self._tails.values():
                t.close()
            self._tails = {}

    # ---- the thread -------------------------------------------------------------------------------
    def _loop(self) -> None:
        while not self._stop.wait(self.tick_s):
            try:
                with self._lock:
                    self._drain()
            except Exception as exc:  # keep following: one bad tick must not end live detection
                log.warning("slowdown: tick failed: %s", exc)

    def _drain(self) -> None:
        for rank, tail in sorted(self._tails.items()):
            for raw in tail.lines():
                self._line(rank, raw)

    def _line(self, rank: int, raw: str) -> None:
        fol = self._followers.get(rank)
        if fol is None:
            fol = self._followers[rank] = SlowdownFollower(self.window, self.threshold, rank, rank, time.localtime().tm_year)
        det = fol.detector
        closed = det.windows
        out = fol.line(raw)
        if rank != min(r for r, f in self._followers.items() if f.samples or r == rank):
            return  # a higher rank while a lower one shows step times too: the same numbers again
        if out is not None:
            stamp, w = out
            self._warn(rank, stamp, w)  # type: ignore[arg-type]
        elif fol.detector is det and det.windows > closed and self._reported is not None:
            log.info("slowdown: rank %d back within %.2f of its baseline", rank, self.threshold)
            self._reported, self._suppressed = None, 0

    def _warn(self, rank: int, stamp: str | None, w: SlowdownWarning) -> None:
        line = f"{stamp} {w.format()}" if stamp else w.format()
        level = w.ratio + 1.0
        if self._reported is not None and level < 2 * self._reported:
            self._suppressed += 1
            log.info("%s", line)  # the agent log keeps every warning line
            return
        evidence: dict[str, Any] = {**w.to_dict(), "line": line, "log_time": stamp, "window": self.window,
                                    "threshold": self.threshold, "earlier_warnings": self._suppressed}  # fmt: skip
        if self._reported is not None:
            evidence["worse_than_last"] = round(level / self._reported, 2)
        self._reported, self._suppressed = level, 0
        if self._bus is not None:
            self._bus.emit("slowdown_detected", line, severity="warning", rank=rank, evidence=evidence)
        else:
            log.warning("%s", line)
