"""End to end: `trainguard run` diagnoses a real worker failure from its own logs."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from tgtest import (
    DEADLINE,
    EXAMPLE,
    SCRIPTS,
    events,
    kill_tree,
    rank_log,
    trainguard_cmd,
    wait_event,
    wait_log,
)

from trainguard.cli import main as cli_main
from trainguard.events.store import read_all


@pytest.mark.slow
def test_run_records_a_diagnosis_event_and_the_cli_agrees(jobs, tmp_path, capsys):
    run_dir = tmp_path / "run"
    job = jobs("run", "--standalone", "--nproc-per-node", "2", "--max-restarts", "0", "--run-dir", run_dir,
               EXAMPLE, "--steps", "12", "--fail-rank", "1", "--fail-step", "4", "--fail-mode", "zerodiv")  # fmt: skip
    assert job.wait() != 0
    (ev,) = read_all(run_dir, kinds=["diagnosis"])
    d = ev.evidence
    assert d["category"] == "python_exception" and ev.rank == 1
    assert "ZeroDivisionError: division by zero" in d["first_failure"]["line"]
    assert d["evidence"] and d["fix"]
    # the same logs, offline
    assert cli_main(["diagnose", str(run_dir / "logs" / "attempt-0"), "--json"]) == 0
    offline = json.loads(capsys.readouterr().out)
    assert offline["category"] == "python_exception" and offline["first_failure"]["rank"] == 1


@pytest.mark.slow
def test_a_worker_killed_from_outside_is_not_called_host_oom(jobs, tmp_path):
    """`kill -9` of a live worker: the kernel's oom_kill counters do not move, so the diagnosis (and
    the policy's input) says "not by the OOM killer", never host_oom."""
    run_dir = tmp_path / "run"
    job = jobs("run", "--standalone", "--nproc-per-node", "2", "--max-restarts", "0", "--run-dir", run_dir,
               EXAMPLE, "--steps", "2000", "--step-time-ms", "20")  # fmt: skip
    started = wait_event(run_dir, "job_started")
    wait_log(rank_log(run_dir, 0, 1), "step=3 ")
    os.kill(int(started.evidence["pids"]["1"]), signal.SIGKILL)
    assert job.wait() != 0
    ev = wait_event(run_dir, "diagnosis")
    d = ev.evidence
    assert d["category"] == "killed_external", d["summary"]
    assert ev.rank == 1 and "not by the OOM killer" in d["summary"]
    assert d["oom_check"]["moved"] is False and d["oom_check"]["checked"]
    (decision,) = events(run_dir, "policy_decision")  # the policy was handed the same verdict
    assert decision.evidence["diagnosis"]["category"] == "killed_external"


def _memory_cgroup(tmp_path) -> tuple[Path, str] | None:
    """A fresh memory cgroup (v1 or v2) this test may fill, or None where it cannot make one."""
    name = f"tg-oomtest-{os.getpid()}-{tmp_path.name}"[:60]
    for parent, limit in (
        (Path("/sys/fs/cgroup/memory"), "memory.limit_in_bytes"),
        (Path("/sys/fs/cgroup"), "memory.max"),
    ):
        if not (parent / "cgroup.procs").exists() or (
            limit == "memory.max" and not (parent / "cgroup.controllers").exists()
        ):
            continue
        cg = parent / name
        try:
            cg.mkdir()
            (cg / limit).write_text(str(1536 << 20))
            return cg, limit
        except OSError:
            with contextlib.suppress(OSError):
                cg.rmdir()
    return None


@pytest.mark.slow
def test_a_worker_killed_by_the_oom_killer_is_host_oom(tmp_path):
    """The other side: a worker that really runs its cgroup out of memory is OOM-killed by the
    kernel; the counters move and the diagnosis says host_oom. Needs a writable memory cgroup."""
    made = _memory_cgroup(tmp_path)
    if made is None:
        pytest.skip("no writable memory cgroup on this machine (needs root and cgroup v1/v2 memory)")
    cg, _ = made
    run_dir = tmp_path / "run"
    cmd = trainguard_cmd("run", "--standalone", "--nproc-per-node", "2", "--max-restarts", "0",
                         "--prestart-workers", "off", "--run-dir", run_dir, SCRIPTS / "grow_memory.py",
                         "--grow-rank", "1", "--grow-step", "3", "--limit-mb", "6144")  # fmt: skip
    log = open(tmp_path / "job.out", "wb")  # noqa: SIM115 - closed below
    # The whole job runs in the cgroup: `sh` moves itself in, then becomes trainguard.
    proc = subprocess.Popen(["sh", "-c", f'echo $$ > "{cg}/cgroup.procs" && exec "$@"', "sh", *map(str, cmd)],
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
    try:
        proc.wait(timeout=DEADLINE)
        ev = wait_event(run_dir, "diagnosis")
        d = ev.evidence
        assert d["oom_check"]["moved"] is True, (d["oom_check"], (tmp_path / "job.out").read_text()[-3000:])
        assert d["category"] == "host_oom" and ev.rank == 1, d["summary"]
    finally:
        kill_tree(proc.pid)
        log.close()
        for _ in range(50):  # the cgroup can only go once its processes are gone
            try:
                cg.rmdir()
                break
            except OSError:
                time.sleep(0.1)
