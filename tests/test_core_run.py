"""The supervisor core with real processes: start, kill, restart, resume, fail, stop."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from tgtest import (
    EXAMPLE,
    SCRIPTS,
    alive,
    events,
    free_port,
    processes_of,
    rank_log,
    trainguard_cmd,
    wait_event,
    wait_for,
    wait_log,
)

CORE = SCRIPTS / "core_job.py"
pytestmark = pytest.mark.slow


CORE_KINDS = {"job_started", "worker_failed", "restart", "job_succeeded", "job_failed"}


def kinds(run_dir):
    """The supervisor's own events, in order (checks, diagnosis... add theirs in between)."""
    return [e.kind for e in events(run_dir) if e.kind in CORE_KINDS]


def pid_of(run_dir, rank, attempt=0):
    ev = wait_event(run_dir, "job_started", pred=lambda e: e.evidence["attempt"] == attempt and str(rank) in e.evidence["pids"])
    return ev.evidence["pids"][str(rank)]


def test_healthy_run_logs_env_and_events(jobs, tmp_path):
    run = tmp_path / "run"
    job = jobs("run", "--standalone", "--nproc-per-node", "2", "--run-dir", run, CORE, "--steps", "3")
    assert job.wait() == 0, job.output()
    assert kinds(run) == ["job_started", "job_succeeded"]
    started = events(run, "job_started")[0]
    assert set(started.evidence["pids"]) == {"0", "1"}
    for rank in (0, 1):
        lines = rank_log(run, 0, rank).read_text().splitlines()
        assert any(f"env run_dir={run} restart_count=0" in ln for ln in lines)
        # every line timestamped and rank-prefixed
        assert all(re.match(rf"^\d{{4}}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{{6}} \[rank{rank}\]: ", ln) for ln in lines), lines[:3]
        assert any(f"step=3 rank={rank}" in ln for ln in lines)
    assert (run / "agent-" f"{started.node}.log").exists()


@pytest.mark.parametrize(
    "moment,extra,needle,victim",
    [
        # rank 1 blocks in init_process_group while rank 0 is still sleeping before it
        ("init", ["--init-delay-rank", "0", "--init-delay", "600"], "init_begin", 1),
        ("training", [], "step=7 rank=1", 1),
        # rank 0 is killed while torch.save writes a 64 MB checkpoint
        ("checkpoint", ["--ckpt-pad-mb", "64"], "saving step=10", 0),
    ],
)
def test_sigkill_worker_recovers(jobs, tmp_path, moment, extra, needle, victim):
    run = tmp_path / "run"
    job = jobs(
        "run", "--standalone", "--nproc-per-node", "2", "--max-restarts", "2", "--run-dir", run, CORE, "--steps", "14", *extra
    )
    pid = pid_of(run, victim)
    wait_log(rank_log(run, 0, victim), needle)
    os.kill(pid, signal.SIGKILL)
    assert job.wait() == 0, job.output()
    ks = kinds(run)
    assert ks[0] == "job_started" and ks[-1] == "job_succeeded", ks
    failed = events(run, "worker_failed")
    assert [e.rank for e in failed] == [victim]
    assert failed[0].evidence["signal"] == "SIGKILL"
    assert ks.index("worker_failed") < ks.index("restart") < ks.index("job_succeeded")
    restart = events(run, "restart")[0]
    assert restart.evidence["restart_count"] == 1
    resumed = wait_log(rank_log(run, 1, 0), "resume step=")
    step = int(resumed.rsplit("=", 1)[1])
    saved = [int(ln.rsplit("=", 1)[1]) for ln in rank_log(run, 0, 0).read_text().splitlines() if "saved step=" in ln]
    # resumes from the last checkpoint that was completely written before the failure — never a torn file
    assert step == (max(saved) if saved else 0)
    if moment == "training":
        assert step >= 5
    assert "env run_dir" in rank_log(run, 1, 0).read_text() and "restart_count=1" in rank_log(run, 1, 0).read_text()


def test_user_exception_every_time_fails_with_evidence(jobs, tmp_path):
    run = tmp_path / "run"
    job = jobs("run", "--standalone", "--nproc-per-node", "2", "--max-restarts", "2", "--run-dir", run, CORE, "--raise-always")
    assert job.wait() == 1, job.output()
    final = events(run, "job_failed")
    assert len(final) == 1
    blob = json.dumps(final[0].evidence)
    assert "ValueError" in blob and "bad batch shape" in blob
    assert final[0].rank == 1


def test_crash_every_time_exhausts_restarts(jobs, tmp_path):
    run = tmp_path / "run"
    job = jobs("run", "--standalone", "--nproc-per-node", "2", "--max-restarts", "2", "--run-dir", run, CORE, "--exit-always", "3")
    assert job.wait() == 1, job.output()
    assert [e.evidence["restart_count"] for e in events(run, "restart")] == [1, 2]
    final = events(run, "job_failed")
    assert len(final) == 1 and final[0].rank == 0
    assert final[0].evidence["failures"]["0"]["exitcode"] == 3


def test_two_agents_recover_from_worker_kill(jobs, tmp_path):
    run = tmp_path / "run"
    port = free_port()
    common = ["--nnodes", "2", "--nproc-per-node", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
              "--rdzv-id", "two", "--max-restarts", "2", "--run-dir", run]
    agents = [jobs("run", *common, "--node-name", f"node{i}", CORE, "--steps", "14", name=f"node{i}") for i in (0, 1)]
    victim = wait_event(run, "job_started", pred=lambda e: "3" in e.evidence["pids"]).evidence["pids"]["3"]
    wait_log(rank_log(run, 0, 3), "step=6 rank=3")
    os.kill(victim, signal.SIGKILL)
    for a in agents:
        assert a.wait() == 0, a.output()
    failed = events(run, "worker_failed")
    assert [(e.rank, e.node) for e in failed] == [(3, "node1")]
    # node0's ranks, if they died of losing rank 3 before their agent restarted them, say so
    assert {e.node for e in events(run, "worker_lost_peer")} <= {"node0"}
    assert {e.node for e in events(run, "job_succeeded")} == {"node0", "node1"}
    resumed = int(wait_log(rank_log(run, 1, 0), "resume step=").rsplit("=", 1)[1])
    saved = [int(ln.rsplit("=", 1)[1]) for ln in rank_log(run, 0, 0).read_text().splitlines() if "saved step=" in ln]
    assert saved and resumed == max(saved)  # the last checkpoint written before the kill


def test_sigterm_to_launcher_leaves_nothing_behind(jobs, tmp_path):
    run = tmp_path / "run"
    shm_before = set(os.listdir("/dev/shm"))
    job = jobs("run", "--standalone", "--nproc-per-node", "2", "--run-dir", run, EXAMPLE, "--steps", "100000", "--step-time-ms", "50")
    wait_log(rank_log(run, 0, 1), "step=3 rank=1")
    procs = processes_of(run)  # launcher, 2 workers, pre-started spares
    assert len(procs) >= 3
    job.proc.send_signal(signal.SIGTERM)
    assert job.wait() != 0
    wait_for(lambda: not alive(procs), 30, "all job processes gone")
    mine = {p.pid for p in procs}
    # Other jobs on this machine (tests running beside this one) make their own rings and snapshot
    # dirs meanwhile; names carry the creating agent's pid, so only theirs are set aside.
    foreign = re.compile(r"^trainguard-(?:ckpt-)?(\d+)-")
    # Other test sessions on the machine make snapshot roots of their own (tg-ckpt-test-*) too.
    left = {n for n in set(os.listdir("/dev/shm")) - shm_before
            if not ((m := foreign.match(n)) and int(m.group(1)) not in mine)
            and not (n.startswith("tg-ckpt-test-") and n != Path(jobs.shm_root).name)}  # fmt: skip
    assert left == set()
    assert os.listdir(jobs.shm_root) == []  # its snapshot dir too
    final = events(run, "job_failed")
    assert final and "SIGTERM" in final[-1].message


@pytest.mark.parametrize(
    "argv,needle",
    [
        (["run", "--no-such-flag", "x.py"], "unrecognized arguments"),
        (["run", "--standalone", "/nonexistent/train.py"], "training script not found"),
        (["run", "--standalone", "--run-dir", "/proc/forbidden", str(EXAMPLE)], "not writable"),
        (["run", "--nnodes", "3:1", str(EXAMPLE)], "min_nodes"),
    ],
)
def test_bad_input_is_one_clear_line_exit_2(argv, needle, tmp_path):
    res = subprocess.run(trainguard_cmd(*argv), capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert res.returncode == 2, res
    lines = [ln for ln in res.stderr.splitlines() if ln.startswith("trainguard")]
    assert len(lines) == 1 and needle in lines[0], res.stderr


def test_example_runs_under_plain_python_tools():
    # The example's CLI stays usable by itself.
    res = subprocess.run([sys.executable, str(EXAMPLE), "--help"], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0 and "--slow-rank" in res.stdout
