"""A whole node (agent and workers) SIGKILLed: the survivors name it (`node_lost`), go on without
it in a new round that uses no restart, and finish (issue 14). Three agents on loopback as nodes."""

from __future__ import annotations

import pytest
from test_core_exclusion import port_open
from tgtest import EXAMPLE, events, free_port, kill_tree, rank_log, wait_event, wait_for, wait_log

pytestmark = pytest.mark.slow


def test_sigkilled_node_is_named_and_the_others_go_on(jobs, tmp_path):
    run = tmp_path / "run"
    port = free_port()
    common = [
        "--nnodes", "2:3", "--nproc-per-node", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
        "--rdzv-id", "lost", "--rdzv-conf", "last_call_timeout=2", "--max-restarts", "0", "--run-dir", run,
        "--precheck", "off", "--quiet",
    ]  # fmt: skip
    script = [EXAMPLE, "--steps", "200", "--step-time-ms", "40", "--ckpt-every", "10", "--ckpt-dir", tmp_path / "ck"]
    agents = {}
    for i in range(3):
        agents[f"node{i}"] = jobs("run", *common, "--node-name", f"node{i}", *script, name=f"node{i}")
        if i == 0:  # node0 hosts the rendezvous store
            wait_for(lambda: port_open(port), what="node0 hosting the rendezvous store")
    # Each agent records its own job_started: wait for node2's (the first one written may be another's).
    victim = wait_event(run, "job_started", pred=lambda e: e.node == "node2" and e.evidence["group_world_size"] == 3)
    victim_rank = int(next(iter(victim.evidence["pids"])))
    wait_log(rank_log(run, victim.evidence["attempt"], victim_rank), "step=20 ")
    kill_tree(agents["node2"].proc.pid)  # SIGKILL: agent and workers at once, sockets closed by the kernel
    lost = wait_event(run, "node_lost")
    assert "node node2 lost" in lost.message and "no heartbeat" in lost.message, lost.message
    for name in ("node0", "node1"):
        assert agents[name].wait() == 0, agents[name].output()
    assert {e.node for e in events(run, "node_lost")} <= {"node0", "node1"}
    decisions = [e for e in events(run, "policy_decision") if e.evidence.get("source") == "node_lost"]
    assert decisions and all(e.evidence["action"] == "rerendezvous" for e in decisions)
    last = [e for e in events(run, "job_started") if e.node == "node0"][-1]
    assert last.evidence["group_world_size"] == 2 and last.evidence["restart_count"] == 0  # no restart used
    assert {e.node for e in events(run, "job_succeeded")} == {"node0", "node1"}
