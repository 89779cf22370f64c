"""A daemon a worker leaves behind (its own session, the worker's stdout/stderr inherited) neither
holds the job's end nor goes unnoticed: real 2-worker jobs whose script starts one and exits 0."""

from __future__ import annotations

import time

import psutil
import pytest
from tgtest import SCRIPTS, events, kill_tree

pytestmark = pytest.mark.slow

EXIT_DEADLINE_S = 120.0  # generous, and far below the daemons' own 300 s


def _daemons(pid_dir, since: float) -> dict[int, psutil.Process]:
    """The daemons the workers wrote down, those still running and started by this test."""
    out = {}
    for path in pid_dir.glob("daemon-*.pid"):
        try:
            p = psutil.Process(int(path.read_text()))
            if p.create_time() >= since - 1 and p.status() != psutil.STATUS_ZOMBIE:
                out[p.pid] = p
        except (psutil.NoSuchProcess, ValueError):
            continue
    return out


@pytest.mark.parametrize(("how", "quiet"), [("popen", True), ("fork", True), ("popen", False)],
                         ids=["popen-quiet", "setsid-fork-quiet", "popen-console"])  # fmt: skip
def test_a_daemon_holding_a_workers_output_neither_holds_the_job_nor_goes_unnamed(tmp_path, jobs, how, quiet):
    """Each rank starts `sleep 300` (or a forked child that calls setsid) with its stdout/stderr,
    then exits 0. trainguard exits 0 while both daemons still run (they were not killed), and one
    ``worker_daemon_left`` per daemon names its pid and the rank that started it. Before, the log
    pumps waited for EOF on the pipes the daemons held (30 s per close, twice), and nothing said why."""
    run_dir, pid_dir = tmp_path / "R", tmp_path / "pids"
    pid_dir.mkdir()
    since = time.time()
    job = jobs("run", "--standalone", "--nproc-per-node", "2", *(["--quiet"] if quiet else []), "--run-dir", run_dir,
               SCRIPTS / "daemon_leaver.py", "--pid-dir", pid_dir, "--how", how, "--seconds", "300")  # fmt: skip
    try:
        assert job.wait(timeout=EXIT_DEADLINE_S) == 0, job.output()
        running = _daemons(pid_dir, since)
        assert len(running) == 2, (running, job.output())  # still alive once trainguard has exited
        named = {e.evidence["pid"]: e for e in events(run_dir, "worker_daemon_left")}
        assert set(named) == set(running), job.output()
        for pid, e in named.items():
            assert (pid_dir / f"daemon-{e.rank}.pid").read_text() == str(pid)
            assert e.evidence["killed"] is False and "not killed" in e.message
            assert e.evidence["session"] == pid  # its own session: the group kill did not reach it
            assert e.evidence["cmdline"] == running[pid].cmdline()
            assert set(e.evidence["streams"]) == {"stdout", "stderr"}
        (ended,) = events(run_dir, "job_succeeded")
        assert all(e.time <= ended.time for e in named.values())
        if not quiet:  # the workers' lines still reach the console, once each
            for rank in (0, 1):
                assert job.output().count(f"[rank{rank}]: rank {rank} started daemon") == 1, job.output()
    finally:
        for p in _daemons(pid_dir, since).values():
            kill_tree(p.pid)
