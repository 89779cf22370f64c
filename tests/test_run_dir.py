"""A run dir used again, or by two jobs at once (issue 18 items 2 and 3), with real jobs."""

from __future__ import annotations

import signal

import pytest
from tgtest import EXAMPLE, alive, events, processes_of, rank_log, wait_event, wait_for

pytestmark = pytest.mark.slow


def _run(run_dir, *extra):
    return ["run", "--standalone", "--nproc-per-node", "2", "--max-restarts", "2", "--quiet", "--run-dir", run_dir,
            EXAMPLE, *extra]


def test_a_resumed_run_is_diagnosed_on_its_own_lines(tmp_path, jobs):
    """18.2: the second run into the same dir fails differently; its diagnosis must not read the
    first run's ZeroDivisionError (that made the policy stop a job it should restart)."""
    run_dir = tmp_path / "R"
    first = jobs(*_run(run_dir, "--steps", "8", "--fail-rank", "1", "--fail-step", "3", "--fail-mode", "zerodiv"))
    assert first.wait() == 1, first.output()
    second = jobs(*_run(run_dir, "--steps", "8", "--fail-rank", "1", "--fail-step", "5", "--fail-mode", "exit"))
    assert second.wait() == 0, second.output()

    diagnoses = events(run_dir, "diagnosis")
    assert len(diagnoses) == 2
    assert diagnoses[0].evidence["category"] == "python_exception"
    assert "ZeroDivisionError" not in str(diagnoses[1].evidence), diagnoses[1].message
    started = events(run_dir, "job_started")
    runs = [e.evidence["run_id"] for e in started]
    assert runs[0] != runs[-1] and [e.evidence["attempt"] for e in started] == [0, 1, 2]
    assert started[1].evidence["first_attempt_of_run"] == 1
    # Each attempt's rank log holds one attempt's lines: the second run's first attempt injected
    # its failure (TRAINGUARD_RESTART_COUNT is 0 on every run's first attempt).
    assert "ZeroDivisionError" in rank_log(run_dir, 0, 1).read_text()
    second_run = rank_log(run_dir, 1, 1).read_text()
    assert "injecting failure (exit) at step=5" in second_run and "ZeroDivisionError" not in second_run
    assert "resume step=0" in rank_log(run_dir, 2, 1).read_text()


def test_a_second_job_on_a_run_dir_is_refused_until_the_first_is_gone(tmp_path, jobs):
    """18.3: one job per node on a run dir; the kernel frees the lock even after SIGKILL."""
    run_dir = tmp_path / "R"
    first = jobs(*_run(run_dir, "--steps", "100000", "--step-time-ms", "50"), name="first")
    wait_event(run_dir, "job_started")
    second = jobs(*_run(run_dir, "--steps", "3"), name="second")
    assert second.wait() == 2
    lines = second.output().strip().splitlines()
    assert len(lines) == 1 and "in use by another job" in lines[0] and f"pid {first.proc.pid} " in lines[0], lines
    assert first.proc.poll() is None
    assert {e.node for e in events(run_dir)} == {first_node(run_dir)}
    assert len(events(run_dir, "job_started")) == 1  # the refused job wrote nothing

    workers = processes_of(run_dir)
    first.proc.send_signal(signal.SIGKILL)  # no cleanup at all: only the kernel releases the lock
    first.proc.wait(timeout=60)
    wait_for(lambda: not alive(workers), 60, "the killed agent's workers to die with it")
    third = jobs(*_run(run_dir, "--steps", "3"), name="third")
    assert third.wait() == 0, third.output()


def first_node(run_dir):
    return events(run_dir, "job_started")[0].node
