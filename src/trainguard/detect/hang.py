"""Is the job hung? Rules over plain samples (no clocks, no I/O: callers pass the time).

1. The seed's rule (ModelArts hang detection, ``MA_HANG_DETECT_TIME``): every period the I/O
   counters of all worker processes and their children are read. Any change anywhere means the job
   is alive. When none changed for ``detect_time``, the accelerator utilisation of a window is
   judged: if its variance and the median are flat, nothing is computing either — hung. Without a
   GPU, each rank's CPU utilisation (from its CPU time) is the series.

2. Steps, when step samples are known: the job's own step times give a threshold
   ``slack + factor × p99(step time)``. No step finished for longer than that is a *stall*, not yet
   a hang: whether it is one is judged per rank from its progress (detect.progress) — a rank that
   is busy and progressing makes it at most a suspicion. The first steps (compilation, warm-up,
   rendezvous) never count: the threshold is trusted after ``min_step_gaps`` regular steps. Long
   healthy pauses (checkpoint saves, evaluation, DataLoader refills) get allowances learned from
   the job's own earlier pauses of the same kind (``phase_allowance``). No step for
   ``detect_time`` is judged by the seed's rule above (detect.verdict): only no I/O anywhere in the
   job, flat utilisation and no rank progressing make it a hang; otherwise it stays a suspicion.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol


@dataclass(frozen=True)
class HangConfig:
    period: float = 1.0  # seconds between samples
    detect_time: float = 1800.0  # seed: seconds without I/O change / without a step (MA_HANG_DETECT_TIME=30 min)
    util_window: float = 60.0  # seconds of utilisation judged by the seed rule (at most detect_time)
    util_max_stdev: float = 5.0  # percentage points; a flatter series has "no change"
    util_max_shift: float = 5.0  # percentage points between the medians of the window's two halves
    step_slack: float = 5.0  # seconds added to factor × p99 step time
    step_factor: float = 3.0
    min_step_gaps: int = 3  # regular step intervals needed before the step threshold is trusted
    pause_factor: float = 5.0  # an interval above this × median is a pause (checkpoint, eval)
    # Progress (detect.progress): a rank that shows none of it for `window` seconds is not progressing.
    window: float = 5.0  # seconds (and at least 2 samples) a rank must stand still to count as stuck
    idle_cpu: float = 5.0  # percent of one core over the window: less is no CPU progress
    stack_every: float = 1.0  # seconds between py-spy samples while steps are stalled
    # Learned allowances: factor × the longest healthy pause of the same kind, at least the floor.
    phase_floor: float = 60.0  # a recognised phase (checkpoint, evaluation, forward passes, DataLoader)
    phase_factor: float = 3.0
    first_step_floor: float = 60.0  # the first step of a restarted attempt
    # Uninterruptible sleep (D) with no I/O is proof of a hang only after this long (a
    # slow os.sync() or NFS server holds a healthy rank in D for a while).
    stalled_limit: float = 120.0

    def __post_init__(self) -> None:
        for name in ("period", "detect_time", "util_window", "step_factor", "pause_factor", "window",
                     "stack_every", "phase_factor"):  # fmt: skip
            if not getattr(self, name) > 0:
                raise ValueError(f"hang detection: {name} must be > 0 (got {getattr(self, name)!r})")
        if self.step_slack < 0 or self.min_step_gaps < 1 or self.idle_cpu < 0:
            raise ValueError("hang detection: step_slack >= 0, min_step_gaps >= 1, idle_cpu >= 0")
        if self.phase_floor < 0 or self.first_step_floor < 0 or self.stalled_limit < 0:
            raise ValueError("hang detection: phase_floor >= 0, first_step_floor >= 0")


@dataclass(frozen=True)
class Activity:
    """Cumulative counters of one rank's process tree at one time (see probes.proc.ProcSample)."""

    rank: int
    io: tuple[int, ...] | None  # None: could not be read (not evidence either way)
    cpu: float  # CPU seconds
    state: str = "S"
    alive: bool = True
    net: int | None = None  # bytes its tree's sockets moved outside the job (None: unknown)


class StepLike(Protocol):
    step: int
    end: float
    duration: float


# --------------------------------------------------------------------------------------------
# utilisation: "no change" from variance and median


@dataclass(frozen=True)
class SeriesStats:
    median: float
    stdev: float
    shift: float  # |median(second half) - median(first half)|
    unchanged: bool


@dataclass(frozen=True)
class UtilVerdict:
    unchanged: bool
    samples: int
    series: tuple[SeriesStats, ...]
    source: str  # "gpu" or "cpu"

    def to_dict(self) -> dict[str, Any]:
        return {
            "unchanged": self.unchanged,
            "samples": self.samples,
            "source": self.source,
            "series": [
                {"median": round(s.median, 1), "stdev": round(s.stdev, 2), "shift": round(s.shift, 1)}
                for s in self.series
            ],
        }


# A CPU series shares its cores with every other process of the machine: a rank spinning on one
# frame reads 55-100 % on a loaded 2-core box (bench/hang.py, window matrix). Its limits grow with
# the level (a fraction of the median); a GPU's series keeps the seed's absolute limits.
CPU_STDEV_FRACTION = 0.3
CPU_SHIFT_FRACTION = 0.15


def series_stats(values: Sequence[float], cfg: HangConfig, relative: bool = False) -> SeriesStats:
    median = statistics.median(values)
    stdev = statistics.pstdev(values) if len(values) > 1 else 0.0
    half = len(values) // 2
    shift = abs(statistics.median(values[half:]) - statistics.median(values[:half])) if half else 0.0
    max_stdev, max_shift = cfg.util_max_stdev, cfg.util_max_shift
    if relative:
        max_stdev = max(max_stdev, CPU_STDEV_FRACTION * median)
        max_shift = max(max_shift, CPU_SHIFT_FRACTION * median)
    return SeriesStats(median, stdev, shift, stdev <= max_stdev and shift <= max_shift)


def judge_utilisation(samples: Sequence[Sequence[float]], cfg: HangConfig, source: str = "cpu") -> UtilVerdict:
    """``samples[i][j]``: utilisation (0-100) of series j (a GPU, or a rank's CPU) at sample i.

    Unchanged when every series is flat (a CPU series within limits relative to its level). Fewer than 3 samples is never "unchanged": too little
    to judge."""
    width = min((len(s) for s in samples), default=0)
    if len(samples) < 3 or width == 0:
        return UtilVerdict(False, len(samples), (), source)
    series = tuple(series_stats([s[j] for s in samples], cfg, relative=source == "cpu") for j in range(width))
    return UtilVerdict(all(s.unchanged for s in series), len(samples), series, source)


# --------------------------------------------------------------------------------------------
# steps: a threshold from the job's own step times


@dataclass(frozen=True)
class StepStats:
    ready: bool  # enough regular intervals to trust the threshold
    threshold: float  # seconds without a finished step that count as a hang (inf when not ready)
    p99: float
    median: float
    intervals: int  # regular intervals the threshold was learned from
    pauses: int  # intervals longer than pause_factor × median (checkpoint saves, evaluation)
    longest_pause: float
    last_end: float  # the job's latest step end (any rank); -inf when none
    last_step: dict[int, int] = field(default_factory=dict)  # rank -> latest step number

    def to_dict(self) -> dict[str, Any]:
        return {
            "ready": self.ready,
            "threshold_s": _round(self.threshold),
            "p99_step_s": _round(self.p99),
            "median_step_s": _round(self.median),
            "intervals": self.intervals,
            "pauses": self.pauses,
            "longest_pause_s": _round(self.longest_pause),
            "last_step": {str(r): s for r, s in sorted(self.last_step.items())},
        }


def _round(x: float) -> float | None:
    return None if math.isinf(x) or math.isnan(x) else round(x, 3)


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100) of a non-empty sequence."""
    ordered = sorted(values)
    k = max(0, min(len(ordered) - 1, math.ceil(q / 100 * len(ordered)) - 1))
    return ordered[k]


def step_stats(steps: Mapping[int, Sequence[StepLike]], cfg: HangConfig, since: float = -math.inf) -> StepStats:
    """Learn the step threshold from the intervals between consecutive step ends of each rank.

    The first step of each rank only marks a start: its own duration (warm-up) is not learned.
    Intervals longer than ``pause_factor`` × the median are pauses, not steps, and are kept out
    of the p99 so that one checkpoint save does not make every later hang slow to detect."""
    intervals: list[float] = []
    last_end = -math.inf
    last_step: dict[int, int] = {}
    for rank, samples in steps.items():
        ends = sorted((s.end, s.step) for s in samples if s.end >= since)
        if not ends:
            continue
        last_end = max(last_end, ends[-1][0])
        last_step[rank] = ends[-1][1]
        intervals += [b[0] - a[0] for a, b in zip(ends, ends[1:], strict=False) if b[0] > a[0]]
    if not intervals:
        return StepStats(False, math.inf, math.nan, math.nan, 0, 0, 0.0, last_end, last_step)
    median = statistics.median(intervals)
    regular = [x for x in intervals if x <= cfg.pause_factor * median]
    pauses = [x for x in intervals if x > cfg.pause_factor * median]
    p99 = percentile(regular, 99)
    ready = len(regular) >= cfg.min_step_gaps
    threshold = cfg.step_slack + cfg.step_factor * p99 if ready else math.inf
    return StepStats(ready, threshold, p99, median, len(regular), len(pauses), max(pauses, default=0.0), last_end, last_step)


def phase_allowance(longest_seen: float | None, threshold: float, cfg: HangConfig, recognised: bool = True) -> float:
    """Seconds without a step that a *progressing* rank may take before it is a suspicion.

    ``phase_factor`` × the longest healthy pause of the same kind seen so far (``longest_seen``),
    at least the step threshold, at most ``detect_time``. A recognised phase (a checkpoint save, an
    evaluation, forward passes, a DataLoader refill) gets at least ``phase_floor`` even the first
    time; anything else only the step threshold until it was seen once. Allowances never cover a
    rank that shows no progress (detect.progress decides that)."""
    floor = cfg.phase_floor if recognised else 0.0
    learned = cfg.phase_factor * longest_seen if longest_seen else 0.0
    return min(cfg.detect_time, max(threshold, floor, learned))


def first_step_allowance(longest_first: float | None, cfg: HangConfig) -> float | None:
    """Seconds from the workers' start to their first step before a stall is judged, learned from
    earlier attempts (``phase_factor`` × the longest seen, at least ``first_step_floor``). None
    before any attempt reached a step: then only the seed rule watches the start."""
    if not longest_first:
        return None
    return min(cfg.detect_time, max(cfg.first_step_floor, cfg.phase_factor * longest_first))


# --------------------------------------------------------------------------------------------
# the detector


@dataclass
class Assessment:
    hang: bool  # the seed rule fired
    rule: str  # "io+utilisation" when it did; "" otherwise
    message: str
    signals: dict[str, Any]
    stall: float = 0.0  # seconds since the job's last finished step (0 when no step is known)
    steps: StepStats | None = None


class HangDetector:
    """Keeps the few facts the rules need from the samples it is fed (bounded memory)."""

    def __init__(self, cfg: HangConfig, start: float) -> None:
        self.cfg = cfg
        self.start = start  # when the workers started; earlier step samples are ignored
        self.last_io_change = start
        self._prev: dict[int, tuple[float, Activity]] = {}
        keep = int(min(cfg.detect_time, cfg.util_window) / cfg.period) + 4
        self._util: deque[tuple[float, tuple[float, ...], str]] = deque(maxlen=max(keep, 8))
        self.cpu_percent: dict[int, float] = {}
        self.states: dict[int, str] = {}
        self.io_total = 0  # bytes read + written + moved through sockets by the job, as last summed

    def observe(self, now: float, activity: Sequence[Activity], gpu_util: Sequence[float] | None = None) -> None:
        """One sampling round. ``gpu_util``: percent per GPU, or None to use each rank's CPU."""
        cpu: list[float] = []
        total = 0
        for a in sorted(activity, key=lambda a: a.rank):
            total += (sum(a.io[:2]) if a.io else 0) + (a.net or 0)
            prev = self._prev.get(a.rank)
            if prev is not None:
                t0, p = prev
                # Socket reads do not move /proc/<pid>/io: a download is I/O of the job too.
                if (a.io is not None and p.io is not None and a.io != p.io) or (
                        a.net is not None and p.net is not None and a.net != p.net):  # fmt: skip
                    self.last_io_change = now
                dt = now - t0
                pct = 100.0 * max(0.0, a.cpu - p.cpu) / dt if dt > 0 else 0.0
                self.cpu_percent[a.rank] = pct
                cpu.append(pct)
            self._prev[a.rank] = (now, a)
            self.states[a.rank] = a.state if a.alive else (a.state or "gone")
        self.io_total = max(self.io_total, total)  # a tree that lost a child must not count backwards
        if self._util and now - self._util[-1][0] < 0.5 * self.cfg.period:
            return  # an extra look between rounds: too short an interval for a utilisation sample
        if gpu_util is not None:
            self._util.append((now, tuple(gpu_util), "gpu"))
        elif cpu and len(cpu) == len(activity):
            self._util.append((now, tuple(cpu), "cpu"))

    def utilisation(self, since: float) -> UtilVerdict:
        window = [(vals, src) for t, vals, src in self._util if t >= since]
        source = window[-1][1] if window else "cpu"
        return judge_utilisation([v for v, s in window if s == source], self.cfg, source)

    def assess(self, now: float, steps: Mapping[int, Sequence[StepLike]]) -> Assessment:
        """The seed rule's verdict, and how long steps have stalled (judged by the caller)."""
        cfg = self.cfg
        io_quiet = now - self.last_io_change
        stats = step_stats(steps, cfg, since=self.start - 1.0)
        stall = now - stats.last_end if stats.last_end > -math.inf else 0.0
        signals: dict[str, Any] = {
            "io_quiet_s": round(io_quiet, 2),
            "period_s": cfg.period,
            "detect_time_s": cfg.detect_time,
            "cpu_percent": {str(r): round(p, 1) for r, p in sorted(self.cpu_percent.items())},
            "states": {str(r): s for r, s in sorted(self.states.items())},
            "steps": stats.to_dict(),
        }
        if stats.last_end > -math.inf:
            signals["stall_s"] = round(stall, 2)
        # Seed rule: quiet I/O for detect_time, then flat utilisation. A step finished within the
        # window is progress the I/O counters cannot see (NCCL over NVLink or InfiniBand bypasses
        # the kernel; ranks that log nothing write nothing), so steps veto it.
        steps_moved = stats.last_end > -math.inf and stall < cfg.detect_time
        if io_quiet >= cfg.detect_time and not steps_moved:
            util = self.utilisation(now - min(cfg.detect_time, cfg.util_window))
            signals["utilisation"] = util.to_dict()
            if util.unchanged:
                return Assessment(
                    True,
                    "io+utilisation",
                    f"no I/O from any worker for {io_quiet:.0f}s and {util.source.upper()} utilisation "
                    f"unchanged over {util.samples} samples",
                    signals,
                    stall=stall,
                    steps=stats,
                )
        return Assessment(False, "", "", signals, stall=stall, steps=stats)
