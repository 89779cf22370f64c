"""`trainguard chaos` against a running job: each injection is real, bounded, reverted where it
lasts, and recorded as a `chaos_injected` event the job's own verdicts can be joined with."""

from __future__ import annotations

import subprocess

import psutil
import pytest
from tgtest import EXAMPLE, events, rank_log, trainguard_cmd, wait_event, wait_for, wait_log

pytestmark = pytest.mark.slow


def chaos(run, *args) -> subprocess.CompletedProcess:
    return subprocess.run(trainguard_cmd("chaos", run, *args), capture_output=True, text=True, timeout=120)


def test_chaos_faults_on_a_running_job(jobs, tmp_path):
    run = tmp_path / "run"
    job = jobs("run", "--standalone", "--nproc-per-node", "2", "--max-restarts", "2", "--run-dir", run,
               "--precheck", "off", "--quiet", EXAMPLE, "--steps", "100000", "--step-time-ms", "30",
               "--ckpt", "trainguard", "--ckpt-every", "5")  # fmt: skip
    first = wait_event(run, "job_started")
    wait_log(rank_log(run, 0, 1), "step=6 ")
    wait_for(lambda: list((run / "checkpoints").glob("step-*/rank-00000.json")), what="a persisted checkpoint")

    # slow: a bounded CPU load pinned to rank 1's core, gone after its duration
    done = chaos(run, "slow", "--rank", "1", "--percent", "50", "--duration", "2")
    assert done.returncode == 0, done.stderr
    [slow] = events(run, "chaos_injected")
    assert slow.rank == 1 and slow.evidence["fault"] == "slow" and slow.evidence["percent"] == 50
    wait_event(run, "chaos_reverted", pred=lambda e: e.evidence["fault"] == "slow")
    wait_for(lambda: not psutil.pid_exists(slow.evidence["holder"]) or psutil.Process(slow.evidence["holder"]).status()
             == psutil.STATUS_ZOMBIE, what="the load process ended")  # fmt: skip

    # fill-disk: bounded, and the file is gone afterwards
    fill = tmp_path / "disk"
    fill.mkdir()
    assert chaos(run, "fill-disk", "--node", first.node, "--path", fill, "--size-mb", "4", "--duration", "1").returncode == 0
    reverted = wait_event(run, "chaos_reverted", pred=lambda e: e.evidence["fault"] == "fill-disk")
    assert "4194304 bytes written" in reverted.message and not list(fill.iterdir())

    # corrupt-ckpt: the newest step's data changes in place
    done = chaos(run, "corrupt-ckpt", "--rank", "0")
    assert done.returncode == 0, done.stderr
    corrupt = [e for e in events(run, "chaos_injected") if e.evidence["fault"] == "corrupt-ckpt"][0]
    assert corrupt.evidence["file"].endswith("rank-00000.bin") and corrupt.evidence["bytes"] > 0

    # stop / cont
    pid0 = first.evidence["pids"]["0"]
    assert chaos(run, "stop", "--rank", "0").returncode == 0
    wait_for(lambda: psutil.Process(pid0).status() == psutil.STATUS_STOPPED, what="rank 0 stopped")
    assert chaos(run, "cont", "--rank", "0").returncode == 0
    wait_for(lambda: psutil.Process(pid0).status() != psutil.STATUS_STOPPED, what="rank 0 running again")

    # kill a worker: the job's own verdict follows
    assert chaos(run, "kill", "--rank", "1").returncode == 0
    failed = wait_event(run, "worker_failed")
    assert failed.rank == 1 and "SIGKILL" in failed.message
    wait_event(run, "job_started", pred=lambda e: e.evidence["attempt"] == 1)
    kinds = [e.evidence["fault"] for e in events(run, "chaos_injected")]
    assert kinds == ["slow", "fill-disk", "corrupt-ckpt", "stop", "cont", "kill"]

    # net faults need a network-namespace node; bad targets are one clear line, exit 2
    bad = chaos(run, "net-cut", "--node", first.node)
    assert bad.returncode == 2 and "own network namespace" in bad.stderr and bad.stderr.count("\n") == 1
    bad = chaos(run, "kill", "--rank", "7")
    assert bad.returncode == 2 and "no running rank 7" in bad.stderr
    job.kill()
