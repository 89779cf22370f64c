"""Slowdown detection: the pure detector, step-time parsing, and `trainguard slowdown`."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
from datetime import datetime
from pathlib import Path

import pytest

from trainguard.cli import main as cli_main
from trainguard.detect.slowdown import SlowdownDetector, detect
from trainguard.diagnose.steplog import StepTimer, parse_step

SEED_WARNINGS = [
    "Smoothed mean (iters 83-87: 9465.00 ms, baseline: 3101.00 ms), threshold ratio:2.05. Warning",
    "Smoothed mean (iters 88-92: 16704.00 ms, baseline: 3101.00 ms), threshold ratio:4.39. Warning",
]
MEGATRON = Path(__file__).resolve().parent / "corpus" / "slowdown" / "megatron_seed_numbers" / "megatron.log"


def _seed_samples() -> list[tuple[int, float]]:
    return [(i, 3101.0 if i < 83 else 9465.0 if i < 88 else 16704.0) for i in range(3, 93)]


def test_seed_numbers_give_the_seed_warnings_exactly():
    assert [w.format() for w in detect(_seed_samples())] == SEED_WARNINGS


def test_baseline_is_the_fastest_window_and_threshold_is_the_excess():
    det = SlowdownDetector(window=2, threshold=0.5)
    out = [det.feed(i, ms) for i, ms in enumerate([100, 100, 80, 80, 119, 121, 200, 200], start=1)]
    warns = [w for w in out if w]
    assert det.baseline_ms == 80.0
    assert [(w.first_iter, w.last_iter, round(w.ratio, 3)) for w in warns] == [(5, 6, 0.5), (7, 8, 1.5)]
    assert detect([(1, 100.0), (2, 179.0)], window=1, threshold=0.8) == []


def test_restart_drops_the_open_window_and_bad_values_are_ignored():
    det = SlowdownDetector(window=3, threshold=0.8)
    for i, ms in [(1, 10), (2, 10), (3, 10), (4, 50), (5, 50)]:
        det.feed(i, ms)
    assert det.feed(3, 50) is None  # resumed from step 2: the window [4, 5] is dropped
    assert det.feed(4, float("nan")) is None and det.feed(4, -1) is None
    assert det.feed(4, 50) is None
    w = det.feed(5, 50)
    assert w is not None and (w.first_iter, w.last_iter) == (3, 5)
    with pytest.raises(ValueError):
        SlowdownDetector(window=0)


@pytest.mark.parametrize(
    "line, iteration, ms",
    [
        (" iteration      100/  500000 | consumed samples: 12800 | elapsed time per iteration (ms): 3101.2 | lr: 1E-4 |", 100, 3101.2),
        (" 10%|█         | 83/800 [04:12<36:00,  3.10s/it]", 83, 3100.0),
        (" 10%|█         | 83/800 [04:12<36:00,  2.00it/s]", 83, 500.0),
    ],
)  # fmt: skip
def test_step_lines_with_a_duration(line, iteration, ms):
    obs = parse_step(line)
    assert (obs.iteration, obs.ms) == (iteration, pytest.approx(ms))


def test_step_times_from_clocks():
    t = StepTimer()
    assert t.feed(parse_step("step=5 rank=1 t=1763717401.000 loss=0.1")) is None
    assert t.feed(parse_step("step=7 rank=1 t=1763717402.000 loss=0.1")) == (7, 500.0, 2)
    lf = StepTimer()
    rows = [
        '{"current_steps": 10, "elapsed_time": "0:01:00"}',
        '{"current_steps": 20, "elapsed_time": "0:01:30"}',
    ]
    assert [lf.feed(parse_step(r)) for r in rows] == [None, (20, 3000.0, 10)]
    ds = StepTimer()  # DeepSpeed: step numbers timed by the line's own timestamp
    assert ds.feed(parse_step("[Rank 0] step=100, skipped=0, lr=[0.1]", line_time=10.5)) is None
    assert ds.feed(parse_step("[Rank 0] step=110, skipped=0, lr=[0.1]", line_time=12.5)) == (110, 200.0, 10)
    hf = StepTimer()  # HF Trainer log_history rows in a timestamped log
    assert hf.feed(parse_step('{"loss": 2.1, "step": 50, "epoch": 0.1}', line_time=100.25)) is None
    assert hf.feed(parse_step("{'loss': 2.0, 'step': 60, 'epoch': 0.12}", line_time=103.25)) == (60, 300.0, 10)
    assert parse_step("resume step=5") is None and parse_step("no numbers here") is None


def test_coarse_clock_steps_are_timed_over_ten_ticks():
    """One-second timestamps and several steps per second gave 0 ms steps."""
    t = StepTimer()
    got = [t.feed(parse_step(f"step={i}", line_time=1000.0 + i // 4)) for i in range(1, 90)]
    samples = [s for s in got if s is not None]
    # 4 steps per one-second tick: a sample spans 10 ticks (anchors at steps 1, 40, 80), never 0 ms
    assert samples == [(40, pytest.approx(10_000 / 39), 39), (80, 250.0, 40)]
    again = [t.feed(parse_step(f"step={i}", line_time=1000.0 + i // 4)) for i in (80, 81, 85)]
    assert again == [None, None, None], "the same step again, or too soon: no sample"
    assert t.feed(parse_step("step=3", line_time=2000.0)) is None, "a restart re-anchors"


def test_zero_time_samples_are_never_a_baseline():
    det = SlowdownDetector(window=5, threshold=0.8)
    assert [det.feed(i, 0.0) for i in range(1, 11)] == [None] * 10
    assert det.baseline_ms is None, "no baseline from samples that took no time"
    for i in range(11, 16):
        det.feed(i, 10.0)
    assert det.baseline_ms == 10.0  # the 0 ms samples are no part of the window
    warns = [det.feed(i, 40.0) for i in range(17, 22)]
    assert warns[-1] is not None and warns[-1].format() == (
        "Smoothed mean (iters 17-21: 40.00 ms, baseline: 10.00 ms), threshold ratio:3.00. Warning"
    )
    multi = detect([(10, 100.0, 10), (20, 100.0, 10), (30, 300.0, 10)])
    assert [(w.first_iter, w.last_iter, w.ratio) for w in multi] == [(21, 30, 2.0)]


def test_zero_ms_steps_do_not_drag_the_baseline_down():
    """40 iterations logged at 0 ms before a window of real steps made that
    window's mean (and the baseline) 1/9 of the real step time; a 2x slowdown then read ratio 17."""
    samples = [(i, 0.0) for i in range(1, 41)]
    samples += [(i, 100.0) for i in range(41, 61)]  # 100 ms steps
    samples += [(i, 200.0) for i in range(61, 71)]  # then 2x slower
    warns = detect(samples, window=5, threshold=0.8)
    assert [round(w.ratio, 2) for w in warns] == [1.0, 1.0]
    assert all(w.baseline_ms == 100.0 for w in warns)


def _hf_rank_log(path: Path, slow_from: int) -> Path:
    """An HF Trainer rank log as trainguard's log pump writes it (one stamped line per bar update,
    every 0.1 s): 120 it/s, 20 it/s from ``slow_from``; every 100 steps an evaluation bar and a
    "Writing model shards" bar run for 1.2 s; "... at step N" messages at the start and end."""
    rows, t, n = [], 1795262000.0, 0

    def add(text: str, dt: float = 0.0) -> None:
        nonlocal t
        t += dt
        rows.append(f"{datetime.fromtimestamp(t):%Y-%m-%dT%H:%M:%S.%f} [rank0]: {text}\n")

    add("train begins at step 0")
    while n < 300:
        rate = 120 if n < slow_from else 20
        step = min(rate // 10, 300 - n)
        add(f" {n * 100 // 300:3d}%|#         | {n + step}/300 [00:01<00:02, {rate:.2f}it/s]", step / rate)
        if (n + step) // 100 > n // 100:
            add("  0%|          | 0/8 [00:00<?, ?it/s]\x1b[A")
            add("100%|##########| 8/8 [00:00<00:00, 13.00it/s]\x1b[A", 0.6)
            add("Writing model shards: 100%|##########| 1/1 [00:00<00:00, 1.67it/s]", 0.6)
        n += step
    add("train ends at step 300", 0.1)
    path.write_text("".join(rows))
    return path


def test_cli_times_the_training_bar_only_and_eval_pauses_are_not_slowdowns(tmp_path, capsys):
    assert cli_main(["slowdown", str(_hf_rank_log(tmp_path / "healthy.log", slow_from=10**9))]) == 0
    assert capsys.readouterr().out == "", "evaluations and saves between bar updates are no step time"
    assert cli_main(["slowdown", str(_hf_rank_log(tmp_path / "slow.log", slow_from=204)), "--json"]) == 0
    warns = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert warns and all(w["first_iter"] > 204 for w in warns)
    assert all((w["baseline_ms"], w["mean_ms"]) == pytest.approx((1000 / 120, 50.0), abs=0.01) for w in warns)


def _coarse_log(path: Path) -> Path:
    """8 steps/s on a log with one-second timestamps, then 2 steps/s (4x slower)."""
    lines, t = [], 0.0
    for step in range(1, 700):
        t += 0.125 if step <= 480 else 0.5
        s = int(t)
        lines.append(f"2026-11-21 09:{30 + s // 60:02d}:{s % 60:02d} step={step} loss=1.0\n")
    path.write_text("".join(lines))
    return path


def test_cli_coarse_timestamps_warn_on_the_slowdown_only(tmp_path, capsys):
    assert cli_main(["slowdown", str(_coarse_log(tmp_path / "coarse.log"))]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == ("2026-11-21 09:31:10 Smoothed mean (iters 481-500: 500.00 ms, baseline: 125.00 ms), "
                      "threshold ratio:3.00. Warning")  # fmt: skip
    assert len(out) == 10 and all("baseline: 125.00 ms), threshold ratio:3.00. Warning" in x for x in out)


@pytest.mark.parametrize("text", [
    " iteration      100/  500000 | elapsed time per iteration (ms): . | lr: 1E-4 |",
    " 10%|█         | 83/800 [04:12<36:00,  .s/it]",
    " iteration " + "9" * 5000 + "/ 1 | elapsed time per iteration (ms): 1.0 |",
    "step=" + "7" * 5000 + " t=1763717401.5",
])  # fmt: skip
def test_cli_malformed_numbers_are_skipped_lines(tmp_path, capsys, text):
    log = tmp_path / "odd.log"
    log.write_text(text + "\n")
    assert cli_main(["slowdown", str(log)]) == 0
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.strip() == f"trainguard slowdown: no step times found in {log}"


def test_cli_prints_the_seed_lines(capsys):
    assert cli_main(["slowdown", str(MEGATRON)]) == 0
    assert capsys.readouterr().out.splitlines() == SEED_WARNINGS
    assert cli_main(["slowdown", str(MEGATRON), "--json", "--threshold", "3"]) == 0
    (only,) = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert only["first_iter"] == 88 and only["message"] == SEED_WARNINGS[1]


def test_cli_bad_usage(tmp_path, capsys):
    assert cli_main(["slowdown", str(tmp_path / "nope.log")]) == 2
    with pytest.raises(SystemExit) as exit_:  # refused by the parser: one line, exit 2
        cli_main(["slowdown", str(MEGATRON), "--window", "0"])
    assert exit_.value.code == 2
    assert "error" in capsys.readouterr().err


def test_cli_per_rank_series_from_trainguard_logs(tmp_path, capsys):
    lines = []
    t = 1763717400.0
    for step in range(1, 31):
        t += 0.1 if step <= 20 else 0.3
        for rank in (0, 1):
            lines.append(
                f"2026-11-21T09:30:{step:02d}.000000 [rank{rank}]: step={step} rank={rank} t={t + rank * 0.01:.3f} loss=1\n"
            )
    log = tmp_path / "rank-all.log"
    log.write_text("".join(lines))
    assert cli_main(["slowdown", str(log), "--rank", "1"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out and all(x.startswith("2026-11-21 09:30:") and x.endswith("Warning") for x in out)


@pytest.mark.slow
def test_cli_follow_sees_appended_lines(tmp_path):
    t0 = 1763717400.0
    log = tmp_path / "train.log"
    log.write_text("".join(f"step={i} rank=0 t={t0 + i * 0.1:.3f}\n" for i in range(1, 12)))
    proc = subprocess.Popen([sys.executable, "-m", "trainguard", "slowdown", str(log), "--follow"],
                            stdout=subprocess.PIPE, text=True, start_new_session=True)  # fmt: skip
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(x) for x in proc.stdout], daemon=True).start()
    try:
        t = t0 + 11 * 0.1
        with open(log, "a") as f:
            for i in range(12, 30):
                t += 0.5
                f.write(f"step={i} rank=0 t={t:.3f}\n")
        first = lines.get(timeout=60)  # generous: the CLI polls the file twice a second
        assert (
            first.strip()
            == "Smoothed mean (iters 12-16: 500.00 ms, baseline: 100.00 ms), threshold ratio:4.00. Warning"
        )
        assert proc.poll() is None  # still following
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
