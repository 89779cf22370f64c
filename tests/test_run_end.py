"""How a job's workers end, judged right (issue 18 items 6 and 13), with real 2-worker jobs."""

from __future__ import annotations

import pytest
from tgtest import EXAMPLE, events

pytestmark = pytest.mark.slow


def _run(run_dir, max_restarts, *extra):
    return ["run", "--standalone", "--nproc-per-node", "2", "--quiet", "--max-restarts", str(max_restarts),
            "--run-dir", run_dir, EXAMPLE, *extra]


def test_a_rank_that_exits_0_early_is_named_not_a_lost_peer(tmp_path, jobs):
    """18.6: rank 1 leaves with exit code 0 at step 3; rank 0 then fails in its all-reduce. The
    cause is rank 1's early exit on this node, not "a peer on another node" nor the network."""
    run_dir = tmp_path / "R"
    job = jobs(*_run(run_dir, 0, "--steps", "50", "--step-time-ms", "20",
                     "--fail-rank", "1", "--fail-step", "3", "--fail-mode", "exit0"))  # fmt: skip
    assert job.wait() == 1, job.output()
    assert events(run_dir, "worker_lost_peer") == []
    failed = events(run_dir, "worker_failed")
    assert [e.rank for e in failed] == [1], [e.message for e in failed]
    assert "finished its script (exit code 0)" in failed[0].message and "left the job early" in failed[0].message
    assert failed[0].evidence["first_failure"] is True
    (diagnosis,) = events(run_dir, "diagnosis")
    assert diagnosis.evidence["category"] == "early_exit", diagnosis.message
    assert diagnosis.rank == 1
    assert "nccl_network" not in diagnosis.message


def test_a_crash_after_every_rank_finished_is_a_success_with_a_warning(tmp_path, jobs):
    """18.13: rank 1 trains to the end, then aborts in the interpreter's teardown (as torch's gloo
    teardown does under load). The work is done: rc 0, no restart, one warning naming rank 1."""
    run_dir = tmp_path / "R"
    job = jobs(*_run(run_dir, 2, "--steps", "6",
                     "--fail-rank", "1", "--fail-step", "2", "--fail-mode", "abort-at-exit"))  # fmt: skip
    assert job.wait() == 0, job.output()
    assert len(events(run_dir, "job_started")) == 1  # no restart
    assert events(run_dir, "restart") == [] and events(run_dir, "worker_failed") == []
    (crash,) = events(run_dir, "worker_exit_crash")
    assert crash.rank == 1 and crash.evidence["signal"] == "SIGABRT", crash.message
    assert events(run_dir, "job_succeeded")


def test_a_crash_before_the_script_finished_still_restarts(tmp_path, jobs):
    """The control: the same abort while training (no finished marker) is a failure, restarted."""
    run_dir = tmp_path / "R"
    job = jobs(*_run(run_dir, 2, "--steps", "6",
                     "--fail-rank", "1", "--fail-step", "2", "--fail-mode", "kill"))  # fmt: skip
    assert job.wait() == 0, job.output()
    assert len(events(run_dir, "job_started")) == 2 and events(run_dir, "worker_exit_crash") == []
