"""Through `trainguard run`: two agents, a straggler named and its node excluded, the job goes on."""

from __future__ import annotations

import os

import pytest
from tgtest import EXAMPLE, events, free_port, wait_event

from trainguard.policy import STRAGGLER_EXIT_MESSAGE
from trainguard.rundir.readers import iter_spans
from trainguard.worker.ring import shm_dir

pytestmark = pytest.mark.slow


def test_straggler_node_excluded_and_elastic_job_continues(jobs, tmp_path):
    run = tmp_path / "run"
    port = free_port()
    common = [
        "--nnodes",
        "1:2",
        "--nproc-per-node",
        "2",
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        f"127.0.0.1:{port}",
        "--rdzv-id",
        "strag",
        "--max-restarts",
        "2",
        "--run-dir",
        run,
        "--exclude-straggler",
    ]
    script = [EXAMPLE, "--steps", "2000", "--step-time-ms", "50", "--slow-rank", "3", "--slow-factor", "1.5"]
    # node0 hosts the rendezvous store (is_host): the leaving node must not take the store with it.
    agents = [jobs("run", *common, "--rdzv-conf", f"is_host={int(i == 0)}", "--node-name", f"node{i}", *script,
                   name=f"node{i}") for i in (0, 1)]
    ev = wait_event(run, "straggler_detected")
    assert (ev.rank, ev.node, ev.evidence["kind"]) == (3, "node1", "compute")
    assert ev.evidence["windows"][-1] < 4, "named within 20 steps"
    assert agents[1].wait() != 0
    assert STRAGGLER_EXIT_MESSAGE in agents[1].output()
    assert [e.node for e in events(run, "node_excluded")] == ["node1"]
    # The job goes on without node1: node0 starts a new attempt alone.
    wait_event(run, "job_started", pred=lambda e: e.node == "node0" and e.evidence["group_world_size"] == 1)
    assert agents[0].proc.poll() is None
    assert all(e.node == "node1" for e in events(run, "straggler_detected"))


def test_a_job_shorter_than_the_agents_tick_keeps_every_step_span(jobs, tmp_path):
    """12 steps with no step time end before the agent's first read of the rings: the workers exit
    and the agent, still alive, drains their rings afterwards (a worker removes its ring at exit
    only when its agent is gone), so no span of a short attempt is lost. Every step of every rank
    is in the record files, and no ring is left in shared memory."""
    run = tmp_path / "run"
    job = jobs("run", "--standalone", "--nproc-per-node", "2", "--quiet", "--run-dir", run,
               EXAMPLE, "--steps", "12")
    assert job.wait() == 0, job.output()
    spans = list(iter_spans(run))
    for rank in (0, 1):
        assert sorted(s.step for s in spans if s.rank == rank and s.kind == "Step") == list(range(1, 13)), rank
    pid = job.proc.pid
    assert not [n for n in os.listdir(shm_dir()) if n.startswith(f"trainguard-{pid}-")], "a ring outlived its agent"
