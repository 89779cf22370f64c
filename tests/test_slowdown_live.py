"""Live slowdown detection inside `trainguard run` (seed 003): a real job logging like Megatron-LM."""

from __future__ import annotations

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


@pytest.mark.slow
def test_healthy_job_and_off_switch_record_nothing(jobs, tmp_path):
    runs = [tmp_path / "on", tmp_path / "off"]
    a = jobs("run", "--standalone", "--nproc-per-node", "2", "--run-dir", runs[0],
             SCRIPTS / "megatron_log_job.py", "--iters", "60", "--step-time-ms", "50")  # fmt: skip
    b = jobs("run", "--standalone", "--nproc-per-node", "2", "--run-dir", runs[1], "--slowdown", "off",
             SCRIPTS / "megatron_log_job.py", "--iters", "40", "--step-time-ms", "50", "--slow-from", "21")  # fmt: skip
    assert a.wait() == 0 and b.wait() == 0
    assert events(runs[0], "slowdown_detected") == [] and events(runs[1], "slowdown_detected") == []
