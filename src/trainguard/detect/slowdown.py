"""Training-slowdown detector (pure): smoothed step time against the best seen so far.

Step times are grouped into consecutive, non-overlapping windows of ``window`` iterations; a
window's mean is its smoothed time. The baseline is the fastest smoothed mean so far. When a
window's excess over the baseline, ``mean / baseline - 1``, reaches ``threshold`` a warning is
raised, printed in the seed platform's exact form::

    Smoothed mean (iters 83-87: 9465.00 ms, baseline: 3101.00 ms), threshold ratio:2.05. Warning

(the seed's "threshold ratio" 2.05 is 9465/3101 - 1; its warning threshold is 0.8.)
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

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


@dataclass
class SlowdownDetector:
    """Feed (iteration, step time in ms) in order; ``feed`` returns a warning when a window closes slow.

    An iteration number that does not increase (a restart resumed from a checkpoint) drops the open
    window but keeps the baseline: the job is the same job.
    """

    window: int = DEFAULT_WINDOW
    threshold: float = DEFAULT_THRESHOLD
    baseline_ms: float | None = None
    _iters: list[int] = field(default_factory=list)
    _times: list[float] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.window < 1:
            raise ValueError("window must be >= 1")
        if self.threshold <= 0:
            raise ValueError("threshold must be > 0")

    def feed(self, iteration: int, ms: float) -> SlowdownWarning | None:
        if not (ms == ms) or ms < 0 or ms == float("inf"):  # NaN, negative or inf: not a step time
            return None
        if self._iters and iteration <= self._iters[-1]:
            self._iters.clear()
            self._times.clear()
        self._iters.append(iteration)
        self._times.append(ms)
        if len(self._times) < self.window:
            return None
        mean = sum(self._times) / len(self._times)
        first, last = self._iters[0], self._iters[-1]
        self._iters.clear()
        self._times.clear()
        if self.baseline_ms is None or mean < self.baseline_ms:
            self.baseline_ms = mean
            return None
        if self.baseline_ms <= 0:
            return None
        ratio = mean / self.baseline_ms - 1.0
        if ratio >= self.threshold:
            return SlowdownWarning(first, last, mean, self.baseline_ms, ratio)
        return None


def detect(
    samples: Iterable[tuple[int, float]], window: int = DEFAULT_WINDOW, threshold: float = DEFAULT_THRESHOLD
) -> list[SlowdownWarning]:
    """All warnings for a sequence of (iteration, step ms)."""
    det = SlowdownDetector(window=window, threshold=threshold)
    out = []
    for it, ms in samples:
        w = det.feed(it, ms)
        if w is not None:
            out.append(w)
    return out
