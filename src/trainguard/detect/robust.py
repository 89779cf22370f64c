"""Robust statistics shared by the detectors: median and MAD, and the "slower than its peers" test.

The median absolute deviation scaled by 1.4826 estimates the standard deviation of normally
distributed values while ignoring outliers, so one slow rank or node does not widen the spread
it is judged against.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable

MAD_SCALE = 1.4826


def median_and_spread(values: Iterable[float]) -> tuple[float, float]:
    """(median, 1.4826 x median absolute deviation) of at least one value."""
    values = list(values)
    med = statistics.median(values)
    return med, MAD_SCALE * statistics.median(abs(v - med) for v in values)


def slower(value: float, ref: float, spread: float, *, k: float, ratio: float, min_delta: float = 0.0,
           strict: bool = False) -> bool:
    """Whether ``value`` stands out above ``ref`` (the peers' median): at least ``ratio`` times it,
    and more than ``k`` robust deviations (``spread``) and ``min_delta`` above it. ``strict``: both
    bounds must be exceeded, not merely reached."""
    limit = max(min_delta, k * spread)
    if strict:
        return value > ref * ratio and value - ref > limit
    return value >= ref * ratio and value - ref >= limit
