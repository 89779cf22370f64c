"""Pure hang detector: the seed's I/O + utilisation rule, step stalls and learned allowances, over plain samples."""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest

from trainguard.detect.hang import (
    Activity,
    HangConfig,
    HangDetector,
    first_step_allowance,
    judge_utilisation,
    percentile,
    phase_allowance,
    step_stats,
)


@dataclass(frozen=True)
class S:  # a step sample
    rank: int
    step: int
    end: float
    duration: float = 0.0


CFG = HangConfig(period=1.0, detect_time=60.0, util_window=30.0, step_slack=5.0, step_factor=3.0)


def steps_every(interval: float, n: int, ranks=(0, 1), start: float = 100.0) -> dict[int, list[S]]:
    return {r: [S(r, i + 1, start + i * interval) for i in range(n)] for r in ranks}


def feed(
    det: HangDetector,
    t0: float,
    t1: float,
    io_at=lambda t, r: 0,
    cpu_at=lambda t, r: 0.0,
    ranks=(0, 1),
    gpu=None,
):
    t = t0
    while t <= t1 + 1e-9:
        det.observe(t, [Activity(r, (io_at(t, r), 0), cpu_at(t, r)) for r in ranks], gpu(t) if gpu else None)
        t += det.cfg.period


# --- utilisation -------------------------------------------------------------------------------


def test_hang_util_flat_series_is_unchanged_at_any_level() -> None:
    assert judge_utilisation([[0.0, 100.0]] * 10, CFG).unchanged  # idle rank + spinning rank
    assert judge_utilisation([[0.5, 99.0], [0.0, 100.0], [1.0, 98.5]] * 3, CFG).unchanged


def test_hang_util_variance_or_median_shift_means_change() -> None:
    noisy = [[v] for v in (10, 90, 20, 80, 15, 95)]
    assert not judge_utilisation(noisy, CFG).unchanged
    shifted = [[40.0]] * 6 + [[55.0]] * 6  # a level change: small stdev per half, big median shift
    v = judge_utilisation(shifted, HangConfig(util_max_stdev=10.0))
    assert v.series[0].shift == 15.0 and not v.unchanged


def test_hang_util_needs_three_samples() -> None:
    assert not judge_utilisation([[0.0], [0.0]], CFG).unchanged
    assert not judge_utilisation([], CFG).unchanged


# --- steps -------------------------------------------------------------------------------------


def test_hang_step_threshold_from_p99_without_first_step_or_pauses() -> None:
    steps = {0: [S(0, 1, 100.0)] + [S(0, i, 130.0 + i * 0.2) for i in range(2, 40)]}  # 30 s first step
    steps[0].insert(20, S(0, 999, steps[0][19].end + 25.0))  # a 25 s checkpoint pause mid-run
    steps[0] = sorted(steps[0], key=lambda s: s.end)
    st = step_stats(steps, CFG)
    assert st.ready and st.pauses == 2  # the first step's interval and the checkpoint
    assert st.p99 == pytest.approx(0.2)
    assert st.threshold == pytest.approx(5.0 + 3 * 0.2)
    assert st.longest_pause >= 25.0


def test_hang_step_stats_not_ready_before_enough_steps() -> None:
    assert not step_stats({0: [S(0, 1, 10.0), S(0, 2, 11.0)]}, CFG).ready
    assert math.isinf(step_stats({}, CFG).threshold)
    assert step_stats({0: [S(0, 1, 10.0)] * 1}, CFG).last_end == 10.0


def test_hang_step_stats_ignores_samples_before_since() -> None:
    old = steps_every(1.0, 10, start=0.0)
    assert not step_stats(old, CFG, since=50.0).ready


def test_hang_percentile_nearest_rank() -> None:
    assert percentile(list(range(1, 101)), 99) == 99
    assert percentile([3.0], 99) == 3.0


def test_hang_phase_allowance_floor_then_learned_multiple() -> None:
    assert phase_allowance(None, 5.6, CFG) == 60.0  # a recognised phase: the floor the first time
    assert phase_allowance(None, 5.6, CFG, recognised=False) == 5.6  # unrecognised: the step threshold
    cfg = HangConfig(detect_time=600.0, phase_floor=20.0, phase_factor=3.0)
    assert phase_allowance(10.0, 5.6, cfg) == 30.0  # 3 × the longest seen
    assert phase_allowance(1.0, 5.6, cfg) == 20.0  # at least the floor
    assert phase_allowance(400.0, 5.6, cfg) == 600.0  # never more than the seed's detect_time


def test_hang_first_step_allowance_is_learned() -> None:
    cfg = HangConfig(detect_time=600.0, phase_floor=20.0, first_step_floor=30.0)
    assert first_step_allowance(None, cfg) is None
    assert first_step_allowance(5.0, cfg) == 30.0
    assert first_step_allowance(40.0, cfg) == 120.0


# --- the detector ------------------------------------------------------------------------------


def test_hang_seed_rule_quiet_io_and_flat_utilisation() -> None:
    det = HangDetector(CFG, start=0.0)
    feed(det, 0.0, 59.0, cpu_at=lambda t, r: t * (1.0 if r == 1 else 0.0))  # rank 1 spins at 100 %
    assert not det.assess(59.0, {}).hang  # not yet detect_time
    feed(det, 60.0, 61.0, cpu_at=lambda t, r: t * (1.0 if r == 1 else 0.0))
    a = det.assess(61.0, {})
    assert a.hang and a.rule == "io+utilisation"
    assert a.signals["utilisation"]["source"] == "cpu"


def test_hang_seed_rule_any_io_change_keeps_the_job_alive() -> None:
    det = HangDetector(CFG, start=0.0)
    # only rank 1 writes, once every 50 s: enough to keep the whole job out of the seed rule
    feed(det, 0.0, 200.0, io_at=lambda t, r: int(t // 50) if r == 1 else 7)
    assert not det.assess(200.0, {}).hang
    assert det.last_io_change == 200.0


def test_hang_seed_rule_steps_finishing_are_progress_without_io() -> None:
    """A healthy job whose traffic bypasses the kernel (NCCL over NVLink) and that logs nothing:
    no I/O and flat utilisation for the whole window, but steps keep finishing, so no hang; once
    they stop, the seed rule fires when the stall too has lasted the window."""
    det = HangDetector(CFG, start=0.0)
    busy = lambda t, r: t  # noqa: E731  (100 % CPU, flat)
    feed(det, 0.0, 200.0, cpu_at=busy)
    steps = {r: [S(r, i + 1, 1.0 + i * 0.5) for i in range(399)] for r in (0, 1)}  # last at 200.0
    assert not det.assess(200.0, steps).hang
    feed(det, 201.0, 259.0, cpu_at=busy)
    assert not det.assess(259.0, steps).hang  # steps stopped 59 s ago: within the window
    feed(det, 260.0, 261.0, cpu_at=busy)
    a = det.assess(261.0, steps)
    assert a.hang and a.rule == "io+utilisation" and a.stall == pytest.approx(61.0)


def test_hang_seed_rule_changing_utilisation_is_not_a_hang() -> None:
    det = HangDetector(CFG, start=0.0)
    wobble = lambda t, r: sum(0.9 if int(x) % 2 else 0.1 for x in range(int(t)))  # noqa: E731
    feed(det, 0.0, 100.0, cpu_at=wobble)
    a = det.assess(100.0, {})
    assert not a.hang and not a.signals["utilisation"]["unchanged"]


def test_hang_seed_rule_uses_gpu_utilisation_when_given() -> None:
    det = HangDetector(CFG, start=0.0)
    feed(det, 0.0, 70.0, gpu=lambda t: [100.0, 100.0])  # NCCL spinning: flat 100 %
    a = det.assess(70.0, {})
    assert a.hang and a.signals["utilisation"]["source"] == "gpu"
    det2 = HangDetector(CFG, start=0.0)
    feed(det2, 0.0, 70.0, gpu=lambda t: [100.0 if int(t) % 3 else 20.0] * 2)
    assert not det2.assess(70.0, {}).hang


def test_hang_unreadable_io_is_not_a_change() -> None:
    det = HangDetector(CFG, start=0.0)
    det.observe(0.0, [Activity(0, (1, 1), 0.0)])
    det.observe(1.0, [Activity(0, None, 0.0)])
    det.observe(2.0, [Activity(0, (1, 1), 0.0)])
    assert det.last_io_change == 0.0


def test_hang_stall_is_measured_not_judged() -> None:
    """Steps stopping is a stall the caller judges from the ranks' progress: never a verdict here."""
    det = HangDetector(CFG, start=90.0)
    steps = steps_every(0.5, 20)  # last step at 109.5, threshold 5 + 3 × 0.5 = 6.5 s
    feed(det, 90.0, 130.0)
    a = det.assess(130.0, steps)
    assert not a.hang and a.stall == pytest.approx(20.5)
    assert a.steps is not None and a.steps.ready and a.steps.threshold == pytest.approx(6.5)
    assert a.signals["stall_s"] == pytest.approx(20.5)


def test_hang_stall_zero_without_steps() -> None:
    det = HangDetector(CFG, start=90.0)
    feed(det, 90.0, 140.0, io_at=lambda t, r: int(t))
    a = det.assess(140.0, {})
    assert not a.hang and a.stall == 0.0 and "stall_s" not in a.signals


def test_hang_config_rejects_nonsense() -> None:
    with pytest.raises(ValueError, match="period"):
        HangConfig(period=0)
    with pytest.raises(ValueError):
        HangConfig(step_slack=-1)
