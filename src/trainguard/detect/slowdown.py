"""Training-slowdown detector (pure): smoothed step time against the best seen so far.

Step times are grouped into consecutive, non-overlapping windows of at least ``window``
iterations; a window's mean time per iteration is its smoothed time. The baseline is the fastest
smoothed mean so far. When a window's excess over the baseline, ``mean / baseline - 1``, reaches
``threshold`` a warning is raised, printed in the seed platform's exact form::

    Smoothed mean (iters 83-87: 9465.00 ms, baseline: 3101.00 ms), threshold ratio:2.05. Warning

(the seed's "threshold ratio" 2.05 is 9465/3101 - 1; its warning threshold is 0.8.)

A sample may stand for several iterations (a log that only shows step numbers on a coarse clock
is timed over several steps at once, ``diagnose.steplog.StepTimer``): it counts as that many
iterations at its mean time. A sample that took no measurable time (0 ms) is no step time: it
is left out of every window. Merged into the next window it would drag that window's mean, and
so the baseline, down by the share of 0 ms iterations (40 of them made a 2x slowdown
read as ratio 17); as a window of its own it would make a 0 baseline that silences every later
warning.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

DEFAULT_WINDOW = 5
DEFAULT_THRESHOLD = 0.8


@dataclass(frozen=True)
class SlowdownWarning:
    first_iter: int
    last_iter: int
    mean_ms: float
    baseline_ms: float
    ratio: float  # mean / baseline - 1

    def format(self) -> str:
        return (
            f"Smoothed mean (iters {self.first_iter}-{self.last_iter}: {self.mean_ms:.2f} ms, "
            f"baseline: {self.baseline_ms:.2f} ms), threshold ratio:{self.ratio:.2f}. Warning"
        )

    def to_dict(self) -> dict[str, float | int | str]:
        return {
            "first_iter": self.first_iter,
            "last_iter": self.last_iter,
            "mean_ms": round(self.mean_ms, 3),
            "baseline_ms": round(self.baseline_ms, 3),
            "ratio": round(self.ratio, 4),
            "message": self.format(),
        }


class SlowdownDetector:
    """Feed (iteration, step time in ms[, iterations]) in order; ``feed`` returns a warning when a
    window closes slow.

    An iteration number that does not increase (a restart resumed from a checkpoint) drops the open
    window but keeps the baseline: the job is the same job.
    """

    def __init__(self, window: int = DEFAULT_WINDOW, threshold: float = DEFAULT_THRESHOLD,
                 baseline_ms: float | None = None) -> None:  # fmt: skip
        if window < 1:
            raise ValueError("window must be >= 1")
        if not threshold > 0:
            raise ValueError("threshold must be > 0")
        self.window = window
        self.threshold = threshold
        self.baseline_ms = baseline_ms
        self._first = 0
        self._last = 0
        self._count = 0  # iterations in the open window
        self._total_ms = 0.0
        self.windows = 0  # windows closed so far (a caller can tell "closed, not slow" from "still open")

    def _reset(self) -> None:
        self._count, self._total_ms = 0, 0.0

    def drop_window(self) -> None:
        """Forget the open window, keep the baseline (the job restarted: the same job)."""
        self._reset()

    def feed(self, iteration: int, ms: float, iterations: int = 1) -> SlowdownWarning | None:
        if not (0 < ms < float("inf")) or iterations < 1:  # 0, NaN, negative or inf: not a step time
            return None
        if self._count and iteration <= self._last:
            self._reset()
        if not self._count:
            self._first = iteration - iterations + 1
        self._last = iteration
        self._count += iterations
        self._total_ms += ms * iterations
        if self._count < self.window:
            return None
        mean = self._total_ms / self._count
        first, last = self._first, self._last
        self._reset()
        self.windows += 1
        if self.baseline_ms is None or mean < self.baseline_ms:
            self.baseline_ms = mean
            return None
        ratio = mean / self.baseline_ms - 1.0
        if ratio >= self.threshold:
            return SlowdownWarning(first, last, mean, self.baseline_ms, ratio)
        return None


def detect(
    samples: Iterable[Sequence[float]], window: int = DEFAULT_WINDOW, threshold: float = DEFAULT_THRESHOLD
) -> list[SlowdownWarning]:
    """All warnings for a sequence of (iteration, step ms[, iterations])."""
    det = SlowdownDetector(window=window, threshold=threshold)
    out = []
    for sample in samples:
        w = det.feed(*sample)  # type: ignore[arg-type]
        if w is not None:
            out.append(w)
    return out
