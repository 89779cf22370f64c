"""`chaos ... --rank R` and `stacks` never act on a pid that is not the rank's worker on this
machine: the rank ran on another node and its recorded pid is, here, an
unrelated process started before the event — which the old "started before job_started" check
took for the worker and SIGKILLed."""

from __future__ import annotations

import subprocess
import sys

import psutil
import pytest
from tgtest import EXAMPLE, kill_tree, trainguard_cmd, wait_event

from trainguard.events import EventBus, EventStore
from trainguard.events.store import node_db_path
from trainguard.probes import identity


@pytest.fixture
def bystander():
    """An unrelated local Python process (started before the run's events, like a long-lived one)."""
    p = subprocess.Popen([sys.executable, "-c", "import time\nwhile True: time.sleep(1)"])
    yield p
    kill_tree(p.pid)
    p.wait(timeout=30)


def run_dir_naming(tmp_path, pid: int, ident: dict | None):
    """A run dir where node "far" started rank 3 with ``pid`` (what the far node's agent recorded)."""
    run = tmp_path / "run"
    store = EventStore(node_db_path(run, "far"))
    try:
        evidence = {"attempt": 0, "pids": {"3": pid}, "max_restarts": 0, **({"identity": ident} if ident else {})}
        EventBus(store, "far").emit("job_started", "attempt 0: 1 worker(s) started on far", evidence=evidence)
    finally:
        store.close()
    return run


def tg(*args) -> subprocess.CompletedProcess:
    return subprocess.run(trainguard_cmd(*args), capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("recorded", ["none", "other-machine"])
def test_chaos_kill_never_signals_another_nodes_pid_reused_here(tmp_path, bystander, recorded):
    ident = None if recorded == "none" else {**identity.record({3: bystander.pid}), "boot_id": "another-machine"}
    run = run_dir_naming(tmp_path, bystander.pid, ident)
    res = tg("chaos", run, "kill", "--rank", "3")
    assert res.returncode == 2, res
    [line] = res.stderr.strip().splitlines()
    assert line.startswith("trainguard chaos: error: node far's workers cannot be acted on from here"), line
    assert bystander.poll() is None and psutil.Process(bystander.pid).status() != psutil.STATUS_ZOMBIE


def test_stacks_never_dumps_a_pid_it_cannot_verify(tmp_path, bystander):
    ident = {**identity.record({3: bystander.pid}), "created": {"3": psutil.Process(bystander.pid).create_time() - 5}}
    run = run_dir_naming(tmp_path, bystander.pid, ident)  # same machine, but the pid started at another time
    res = tg("stacks", run, "--node-name", "far", "--timeout", "1", "--json")
    assert res.stdout.strip() == "", res.stdout  # no dump of the bystander: its agent is asked instead
    assert "no answer from the agent of node far" in res.stderr


@pytest.mark.slow
def test_chaos_still_kills_the_ranks_own_worker(jobs, tmp_path):
    run = tmp_path / "run"
    job = jobs("run", "--standalone", "--nproc-per-node", "2", "--run-dir", run, "--precheck", "off", "--quiet",
               "--max-restarts", "0", EXAMPLE, "--steps", "100000", "--step-time-ms", "50")  # fmt: skip
    started = wait_event(run, "job_started")
    worker = psutil.Process(int(started.evidence["pids"]["1"]))
    res = tg("chaos", run, "kill", "--rank", "1")
    assert res.returncode == 0, res
    worker.wait(timeout=60)  # gone (psutil.TimeoutExpired otherwise)
    assert job.wait() != 0
