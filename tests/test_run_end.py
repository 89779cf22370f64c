"""How a job's workers end, judged right, with real 2-worker jobs."""

from __future__ import annotations

import os
import signal

import pytest
from tgtest import EXAMPLE, events, wait_event

pytestmark = pytest.mark.slow


def _run(run_dir, max_restarts, *extra):
    return ["run", "--standalone", "--nproc-per-node", "2", "--quiet", "--max-restarts", str(max_restarts),
            "--run-dir", run_dir, EXAMPLE, *extra]


def test_a_rank_that_exits_0_early_is_named_not_a_lost_peer(tmp_path, jobs):
    """Rank 1 leaves with exit code 0 at step 3; rank 0 then fails in its all-reduce. The
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
    """Rank 1 trains to the end, then aborts in the interpreter's teardown (as torch's gloo
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


def test_workers_sigtermed_before_their_agent_are_a_preemption_not_a_failure(tmp_path, jobs):
    """A scheduler stopping a job sends SIGTERM to every process of it, in no order (Slurm's
    requeue): here the workers get theirs first, and the agent its own once it has seen them die.
    The agent waits for that signal and the job ends preempted (snapshots persisted, exit 143);
    before, with no restarts left, it was recorded as a failed job by then."""
    run_dir = tmp_path / "R"
    job = jobs(*_run(run_dir, 0, "--steps", "100000", "--step-time-ms", "20", "--ckpt", "trainguard", "--ckpt-every", "5"))
    started = wait_event(run_dir, "job_started")
    wait_event(run_dir, "checkpoint_persisted")
    for pid in started.evidence["pids"].values():
        os.kill(int(pid), signal.SIGTERM)
    wait_event(run_dir, "worker_failed")
    job.proc.send_signal(signal.SIGTERM)
    assert job.wait() == 128 + signal.SIGTERM, job.output()
    assert [e.evidence["signal"] for e in events(run_dir, "job_preempted")] == ["SIGTERM"]
    assert not [e for e in events(run_dir, "policy_decision") if e.evidence["action"] == "stop_job"]


def test_workers_sigtermed_while_slurm_ends_the_job_are_a_preemption_without_the_agents_signal(tmp_path, jobs):
    """Slurm stopping a step does not always signal every process: srun forcing the step's end
    from another node signalled a node's workers and never its agent (CI run of 2026-11-24). After
    its grace the agent asks Slurm (`scontrol show job`, here a stand-in saying COMPLETING) and
    stops as signalled: preempted, not failed."""
    fake = tmp_path / "bin"
    fake.mkdir()
    scontrol = fake / "scontrol"
    scontrol.write_text('#!/bin/sh\necho "JobId=77 JobName=train JobState=COMPLETING Reason=None"\n')
    scontrol.chmod(0o755)
    env = {"SLURM_JOB_ID": "77", "SLURM_JOB_NODELIST": "n1", "SLURM_JOB_NUM_NODES": "1",
           "PATH": f"{fake}:{os.environ['PATH']}"}  # fmt: skip
    run_dir = tmp_path / "R"
    job = jobs(*_run(run_dir, 0, "--steps", "100000", "--step-time-ms", "20", "--ckpt", "trainguard", "--ckpt-every", "5"),
               env=env)  # fmt: skip
    started = wait_event(run_dir, "job_started")
    wait_event(run_dir, "checkpoint_persisted")
    for pid in started.evidence["pids"].values():
        os.kill(int(pid), signal.SIGTERM)  # the workers only: the agent gets no signal
    assert job.wait() == 128 + signal.SIGTERM, job.output()
    assert [e.evidence["signal"] for e in events(run_dir, "job_preempted")] == ["SIGTERM"]
    assert not [e for e in events(run_dir, "policy_decision") if e.evidence["action"] == "stop_job"]
