"""Live slowdown detection inside `trainguard run` (seed 003): a real job logging like Megatron-LM."""

from __future__ import annotations

import argparse
import re
from datetime import datetime

import pytest
from tgtest import SCRIPTS, events, rank_log

SEED_LINE = re.compile(
    r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d Smoothed mean \(iters (\d+)-(\d+): (\d+\.\d\d) ms, "
    r"baseline: (\d+\.\d\d) ms\), threshold ratio:(\d+\.\d\d)\. Warning"
)


@pytest.mark.slow
def test_megatron_slowdown_is_warned_live_with_the_seed_line(jobs, tmp_path):
    run = tmp_path / "run"
    job = jobs("run", "--standalone", "--nproc-per-node", "2", "--run-dir", run,
               SCRIPTS / "megatron_log_job.py", "--iters", "70", "--step-time-ms", "50", "--slow-from", "41")  # fmt: skip
    assert job.wait() == 0, job.output()[-3000:]
    (ev,) = events(run, "slowdown_detected")  # one event: the later windows are as slow, not worse
    m = SEED_LINE.fullmatch(ev.message)
    assert m, ev.message
    first, last, mean, baseline, ratio = int(m[1]), int(m[2]), float(m[3]), float(m[4]), float(m[5])
    assert ev.rank == 1, "Megatron prints on the last rank"
    assert first >= 41 and last - first == 4, "no warning before the slowdown; windows of 5 iterations"
    assert ratio == pytest.approx(mean / baseline - 1, abs=0.01) and ratio >= 0.8
    assert ev.evidence["line"] == ev.message and ev.evidence["first_iter"] == first
    # Live: warned while the job still ran, before the rank printed its last iteration.
    last_line = next(x for x in rank_log(run, 0, 1).read_text().splitlines() if "iteration       70/" in x)
    assert ev.time < datetime.strptime(last_line[:26], "%Y-%m-%dT%H:%M:%S.%f").timestamp()
    # Every window's warning line is in the agent log (the seed's fault-tolerance log).
    (agent_log,) = run.glob("agent-*.log")
    lines = [SEED_LINE.search(x) for x in agent_log.read_text().splitlines()]
    assert len([x for x in lines if x]) >= 4  # iterations 41..70: 6 windows, all slow


@pytest.mark.parametrize("flag,value", [("--slowdown-window", "0"), ("--slowdown-threshold", "nan"),
                                        ("--slowdown-threshold", "-1"), ("--slowdown", "maybe")])  # fmt: skip
def test_bad_slowdown_flags_are_one_line_usage_errors(flag, value, capsys):
    from trainguard.cli import main as cli_main

    with pytest.raises(SystemExit) as exit_:
        cli_main(["run", "--standalone", flag, value, "train.py"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and flag in err.splitlines()[-1], err


def test_off_switch():
    from trainguard.monitors.slowdown import create, settings

    assert create(settings(argparse.Namespace(slowdown="off"))) is None
    assert create(settings(argparse.Namespace(slowdown="on", slowdown_window=7, slowdown_threshold=0.5))).window == 7


def _lines(rank: int, steps: range, t0: float, step_s: float) -> tuple[str, float]:
    out, t = [], t0
    for i in steps:
        t += step_s
        out.append(f"{datetime.fromtimestamp(t):%Y-%m-%dT%H:%M:%S.%f} [rank{rank}]: step={i} rank={rank} t={t:.3f}\n")
    return "".join(out), t


def test_monitor_one_series_per_node_episodes_restarts_and_reused_run_dir(tmp_path):
    from trainguard.events import EventBus, EventStore
    from trainguard.monitors.api import MonitorContext, StepTracker, WorkerInfo
    from trainguard.monitors.slowdown import SlowdownMonitor
    from trainguard.spawn.logs import rank_log_path

    db = EventStore(tmp_path)
    mon = SlowdownMonitor(window=5, threshold=0.8, tick_s=3600)  # the test drains through the hooks

    def ctx(attempt: int) -> MonitorContext:
        return MonitorContext(run_dir=tmp_path, node="n0", node_rank=0, nnodes=1, nproc_per_node=2, world_size=2,
                              restart_count=attempt, workers=[WorkerInfo(r, r, 0) for r in (0, 1)],
                              events=EventBus(db, "n0"), steps=StepTracker())  # fmt: skip

    def append(attempt: int, rank: int, text: str) -> None:
        path = rank_log_path(tmp_path, attempt, rank)
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a") as f:
            f.write(text)

    def warnings() -> list[str]:
        return [e.message.split(" ", 2)[2] for e in db.query(kinds=["slowdown_detected"])]

    try:
        # A previous run into the same run dir left a slow log: not this job's.
        old, _ = _lines(0, range(1, 40), 1_763_000_000.0, 0.1)
        append(0, 0, old + _lines(0, range(40, 60), 1_763_000_004.0, 2.0)[0])
        c0 = ctx(0)
        mon.on_before_start(c0)
        mon.on_workers_started(c0)
        for rank in (0, 1):  # both ranks print the same job-wide slowdown: reported once, for rank 0
            text, t = _lines(rank, range(1, 22), 1_763_100_000.0, 0.1)  # windows 2-6, 7-11 ...
            text2, t = _lines(rank, range(22, 42), t, 0.5)  # 5x: one event, the later windows only logged
            text3, _ = _lines(rank, range(42, 47), t, 1.0)  # 10x: twice as slow as reported: a second event
            append(0, rank, text + text2 + text3)
        mon.on_workers_stopped(c0)
        assert warnings() == [
            "Smoothed mean (iters 22-26: 500.00 ms, baseline: 100.00 ms), threshold ratio:4.00. Warning",
            "Smoothed mean (iters 42-46: 1000.00 ms, baseline: 100.00 ms), threshold ratio:9.00. Warning",
        ]
        assert {e.rank for e in db.query(kinds=["slowdown_detected"])} == {0}
        # Restart an hour later, at a later step number (a job that logs its global step from a
        # checkpoint): the downtime is no step's time; the baseline stays.
        c1 = ctx(1)
        mon.on_before_start(c1)
        mon.on_workers_started(c1)
        text, t = _lines(0, range(50, 70), 1_763_103_600.0, 0.1)
        append(1, 0, text + _lines(0, range(70, 80), t, 0.19)[0])
        mon.on_workers_stopped(c1)
        assert warnings()[2:] == [
            "Smoothed mean (iters 71-75: 190.00 ms, baseline: 100.00 ms), threshold ratio:0.90. Warning"]
    finally:
        mon.close()
        db.close()


def test_log_pump_ends_lines_at_carriage_returns(tmp_path):
    """Progress-bar updates become stamped lines as they come; \\r\\n split across writes is one
    line end; output with no line end at all is written in bounded pieces."""
    import io
    import os
    import threading

    from trainguard.spawn.logs import MAX_LINE, RankLog, pump

    r, w = os.pipe()
    dest, console = RankLog(), io.StringIO()
    dest.assign(tmp_path / "rank-0.log", 0, tee=True)
    t = threading.Thread(target=pump, args=(os.fdopen(r, "rb"), dest, console))
    t.start()
    for chunk in (b"start\r", b"\n 10%|#| 1/10 [00:01<00:09, 1.00s/it]\r 20%|##| 2/10 [00:02<00:08, 1.00s/it]\r",
                  b"\r\rdone\n", b"x" * (MAX_LINE + 5)):  # fmt: skip
        os.write(w, chunk)
    os.close(w)
    t.join(timeout=30)
    dest.close()
    lines = [x.split(" [rank0]: ", 1)[1] for x in (tmp_path / "rank-0.log").read_text().splitlines()]
    assert lines == ["start", " 10%|#| 1/10 [00:01<00:09, 1.00s/it]", " 20%|##| 2/10 [00:02<00:08, 1.00s/it]",
                     "done", "x" * MAX_LINE, "xxxxx"]  # fmt: skip
    assert console.getvalue().startswith("[rank0]: start\n[rank0]:  10%|#| 1/10 [00:01<00:09, 1.00s/it]\r")
