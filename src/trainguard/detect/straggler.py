"""Straggler detection over span summaries of all ranks. Pure: plain data in, verdicts out.

Per rank and step we know the time spent in FP (compute), DataLoader and Communication. Steps are
grouped into fixed windows (window ``w`` = steps ``w*W+1 .. (w+1)*W``, the same steps on every rank
of a synchronous job) and each rank's window is summarised by per-step medians, so one noisy step
does not count. A rank is flagged in a window when its own work is slower than the median of its
peers by a ratio *and* by more than the peers' robust spread (MAD) and an absolute floor. It is a
straggler when it is flagged for the same kind in several consecutive windows.

Why the own-work kinds first: in a synchronous job, the ranks that wait for a straggler show long
Communication (they sit in the all-reduce), while the straggler shows long compute or dataloader
time and *short* communication. So compute and dataloader outliers are looked for first. A
Communication outlier is reported only when no rank's own work stands out *and* the extra time in
communication is not paid back by less time outside it (own work = step - communication): in a
synchronous job every rank's step takes the same time, so a rank with more communication and less
own work is merely waiting for slightly slower peers. What remains is a rank whose steps are longer
because its communication is slow (a slow link or NIC on its node, a slow p2p peer).
"""

from __future__ import annotations

import bisect
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field

from trainguard.detect.robust import median_and_spread, slower

COMPUTE, DATALOADER, COMMUNICATION = "compute", "dataloader", "communication"
# Which span kind feeds which metric.
SPAN_METRIC = {"FP": COMPUTE, "DataLoader": DATALOADER, "Communication": COMMUNICATION}


@dataclass(frozen=True)
class StepBreakdown:
    """One finished step of one rank, times in ms."""

    step: int
    duration_ms: float
    compute_ms: float | None  # None: no FP span seen (model not an nn.Module call)
    dataloader_ms: float
    communication_ms: float


@dataclass(frozen=True)
class RankWindow:
    """Per-step medians of one rank over one window (what agents exchange through the store)."""

    rank: int
    node: str
    window: int
    steps: int
    step_ms: float
    compute_ms: float | None
    dataloader_ms: float
    communication_ms: float

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> RankWindow:
        return cls(**{k: d[k] for k in cls.__dataclass_fields__})

    def metric(self, kind: str) -> float | None:
        return {COMPUTE: self.compute_ms, DATALOADER: self.dataloader_ms, COMMUNICATION: self.communication_ms}[kind]


@dataclass(frozen=True)
class StragglerConfig:
    window_steps: int = 5
    windows: int = 3  # consecutive flagged windows needed...
    min_seconds: float = 1.0  # ...covering at least this much wall time
    ratio: float = 1.25  # at least this much slower than the peers' median
    min_delta_ms: float = 1.0  # and at least this many ms per step slower
    mad_k: float = 4.0  # and beyond k robust standard deviations of the peers


@dataclass(frozen=True)
class Flag:
    rank: int
    node: str
    window: int
    kind: str
    value_ms: float
    peers_ms: float

    @property
    def ratio(self) -> float:
        return self.value_ms / self.peers_ms if self.peers_ms > 0 else float("inf")


@dataclass(frozen=True)
class Verdict:
    rank: int
    node: str
    kind: str  # compute | dataloader | communication
    slower_by: float  # ratio to the peers' median (median over the windows)
    value_ms: float  # this rank's per-step time in that kind (last window)
    peers_ms: float  # the peers' median (last window)
    windows: list[int] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)


# ---- per-rank accumulation ----------------------------------------------------------------------
class StepAccumulator:
    """Sums one rank's spans per step; a Step span closes the step. No I/O, no clock."""

    def __init__(self) -> None:
        self._open: dict[int, dict[str, float]] = {}
        self._seen_fp = False
        self.last_closed = 0

    def add_span(self, kind: str, step: int, duration_ms: float) -> None:
        metric = SPAN_METRIC.get(kind)
        if metric is None or step <= self.last_closed:
            return  # other kinds do not enter the analysis; late spans of closed steps are dropped
        if metric == COMPUTE:
            self._seen_fp = True
        sums = self._open.setdefault(step, {})
        sums[metric] = sums.get(metric, 0.0) + duration_ms

    def close_step(self, step: int, duration_ms: float) -> StepBreakdown | None:
        if step <= self.last_closed:
            return None
        sums = self._open.pop(step, {})
        for old in [s for s in self._open if s < step]:
            del self._open[old]
        self.last_closed = step
        return StepBreakdown(
            step=step,
            duration_ms=duration_ms,
            compute_ms=sums.get(COMPUTE, 0.0) if self._seen_fp else None,
            dataloader_ms=sums.get(DATALOADER, 0.0),
            communication_ms=sums.get(COMMUNICATION, 0.0),
        )


def window_of(step: int, window_steps: int) -> int:
    return (step - 1) // window_steps


def summarize(rank: int, node: str, window: int, steps: Sequence[StepBreakdown]) -> RankWindow:
    compute = [s.compute_ms for s in steps if s.compute_ms is not None]
    return RankWindow(
        rank=rank,
        node=node,
        window=window,
        steps=len(steps),
        step_ms=statistics.median(s.duration_ms for s in steps),
        compute_ms=statistics.median(compute) if compute else None,
        dataloader_ms=statistics.median(s.dataloader_ms for s in steps),
        communication_ms=statistics.median(s.communication_ms for s in steps),
    )


class WindowBuilder:
    """Groups one rank's step breakdowns into windows; returns each window once it is complete."""

    def __init__(self, rank: int, node: str, window_steps: int) -> None:
        self.rank, self.node, self.window_steps = rank, node, window_steps
        self._steps: dict[int, list[StepBreakdown]] = {}

    def add(self, b: StepBreakdown) -> RankWindow | None:
        w = window_of(b.step, self.window_steps)
        self._steps.setdefault(w, []).append(b)
        if b.step % self.window_steps != 0:
            return None
        done = self._steps.pop(w)
        for old in [k for k in self._steps if k < w]:
            del self._steps[old]  # a window whose last step was lost is abandoned
        return summarize(self.rank, self.node, w, done)


# ---- detection ----------------------------------------------------------------------------------
def flag_window(ranks: Iterable[RankWindow], cfg: StragglerConfig) -> list[Flag]:
    """Ranks slower than their peers in one window (own work first, see module doc)."""
    ranks = list(ranks)
    for kinds in ((COMPUTE, DATALOADER), (COMMUNICATION,)):
        flags = [f for kind in kinds for f in _outliers(ranks, kind, cfg)]
        if flags:
            return flags
    return []


def _outliers(ranks: list[RankWindow], kind: str, cfg: StragglerConfig) -> list[Flag]:
    values = [(r, r.metric(kind)) for r in ranks]
    values = [(r, v) for r, v in values if v is not None]
    if len(values) < 2:
        return []
    out = []
    ordered = sorted(v for _, v in values)
    for i, (r, v) in enumerate(values):
        # The peers' median without building the peers' list (O(1) on the sorted values): only
        # a rank that passes the ratio and the floor against it needs the peers' spread, so one
        # window costs O(n log n), not O(n^2), at thousands of ranks (bench/scale.py).
        ref = _median_without(ordered, v)
        if not slower(v, ref, 0.0, k=cfg.mad_k, ratio=cfg.ratio, min_delta=cfg.min_delta_ms):
            continue
        ref, spread = median_and_spread(pv for j, (_, pv) in enumerate(values) if j != i)
        if len(values) - 1 < 3:
            spread = 0.0  # too few peers for a spread: the ratio and the floor decide
        if not slower(v, ref, spread, k=cfg.mad_k, ratio=cfg.ratio, min_delta=cfg.min_delta_ms):
            continue
        if kind == COMMUNICATION:
            own = r.step_ms - v
            peers_own = statistics.median(p.step_ms - pv for j, (p, pv) in enumerate(values) if j != i)
            if own < peers_own - (v - ref) / 2:
                continue  # it communicates longer because it waits: its own work is shorter
        out.append(Flag(r.rank, r.node, r.window, kind, v, ref))
    return out


def _median_without(ordered: list[float], value: float) -> float:
    """Median of ``ordered`` (sorted) with one occurrence of ``value`` left out."""
    i = bisect.bisect_left(ordered, value)
    m = len(ordered) - 1

    def at(j: int) -> float:
        return ordered[j] if j < i else ordered[j + 1]

    return at(m // 2) if m % 2 else (at(m // 2 - 1) + at(m // 2)) / 2


def window_seconds(window: Sequence[RankWindow]) -> float:
    """Wall time a window covers (its steps at the median rank's step time)."""
    return statistics.median(r.steps * r.step_ms for r in window) / 1000.0 if window else 0.0


def detect(history: Sequence[Sequence[RankWindow]], cfg: StragglerConfig) -> list[Verdict]:
    """Stragglers at the end of ``history`` (consecutive windows, oldest first).

    A (rank, kind) is a straggler when it is flagged in each of the newest windows, at least
    ``cfg.windows`` of them and together at least ``cfg.min_seconds`` long: a rank that is slow for
    a moment (a noisy neighbour on a shared CPU for a few steps) is not a straggler."""
    if len(history) < cfg.windows:
        return []
    chains: dict[tuple[int, str], list[Flag]] = {(f.rank, f.kind): [] for f in flag_window(history[-1], cfg)}
    verdicts = []
    seconds = 0.0
    for window in reversed(history):
        if not chains:
            break
        flags = {(f.rank, f.kind): f for f in flag_window(window, cfg)}
        seconds += window_seconds(window)
        for key in list(chains):
            flag = flags.get(key)
            if flag is None:
                del chains[key]
                continue
            chains[key].append(flag)
            if len(chains[key]) >= cfg.windows and seconds >= cfg.min_seconds:
                verdicts.append(_verdict(chains.pop(key)[::-1]))
    return sorted(verdicts, key=lambda v: (v.rank, v.kind))


def _verdict(chain: list[Flag]) -> Verdict:
    last = chain[-1]
    return Verdict(
        rank=last.rank,
        node=last.node,
        kind=last.kind,
        slower_by=round(statistics.median(f.ratio for f in chain), 3),
        value_ms=round(last.value_ms, 3),
        peers_ms=round(last.peers_ms, 3),
        windows=[f.window for f in chain],
    )
