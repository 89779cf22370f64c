"""SIGINT to an agent a script started in the background. A non-interactive
shell starts background commands with SIGINT ignored, and the workers inherit that: the agent's
SIGINT reached them as nothing, and they trained on until the stop's timeout SIGKILLed them. The
agent now stops workers that ignore the signal it got with SIGTERM."""

from __future__ import annotations

import os
import signal

import psutil
import pytest
from tgtest import EXAMPLE, events, wait_event, wait_for

pytestmark = pytest.mark.slow


def ignores(pid: int, sig: int) -> bool:
    with open(f"/proc/{pid}/status") as f:
        mask = next(int(ln.split()[1], 16) for ln in f if ln.startswith("SigIgn:"))
    return bool(mask >> (sig - 1) & 1)


def test_sigint_to_a_background_agent_stops_workers_that_ignore_it(jobs, tmp_path):
    run, pidfile = tmp_path / "run", tmp_path / "agent.pid"
    background = ["bash", "-c", f'"$@" & echo $! > {pidfile}; wait $!', "bash"]  # what a job script does
    job = jobs("run", "--standalone", "--nproc-per-node", "2", "--run-dir", run, "--precheck", "off", "--quiet",
               EXAMPLE, "--steps", "100000", "--step-time-ms", "50", prefix=background)  # fmt: skip
    started = wait_event(run, "job_started")
    workers = [psutil.Process(int(p)) for p in started.evidence["pids"].values()]
    assert all(ignores(w.pid, signal.SIGINT) for w in workers)  # the situation: inherited from the shell
    agent = int(wait_for(lambda: pidfile.exists() and pidfile.read_text().strip()))
    os.kill(agent, signal.SIGINT)
    job.wait()
    out = job.output()
    assert "ignore SIGINT" in out and "stopping them with SIGTERM" in out, out[-3000:]
    assert not [w for w in workers if w.is_running() and w.status() != psutil.STATUS_ZOMBIE]
    [failed] = events(run, "job_failed")
    assert "stopped by SIGINT" in failed.message


def test_sighup_to_an_agent_under_nohup_is_ignored_as_nohup_promises(jobs, tmp_path):
    """`nohup trainguard run ...`: the terminal closing (SIGHUP) must not stop the job. Both the
    agent's own handlers and torch's PContext.start used to register SIGHUP over nohup's SIG_IGN."""
    run = tmp_path / "run"
    job = jobs("run", "--standalone", "--nproc-per-node", "2", "--run-dir", run, "--precheck", "off", "--quiet",
               EXAMPLE, "--steps", "150", "--step-time-ms", "40", prefix=["nohup"])  # fmt: skip
    started = wait_event(run, "job_started")
    agent = psutil.Process(job.proc.pid)
    assert ignores(agent.pid, signal.SIGHUP)  # nohup's promise, kept after the agent set its handlers
    workers = [psutil.Process(int(p)) for p in started.evidence["pids"].values()]
    os.kill(agent.pid, signal.SIGHUP)
    for w in workers:
        os.kill(w.pid, signal.SIGHUP)  # a hangup reaches the whole session
    assert job.wait() == 0, job.output()[-3000:]
    assert events(run, "job_succeeded") and not events(run, "job_failed")
