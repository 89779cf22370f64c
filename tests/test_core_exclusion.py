"""A node excluded while it hosts the c10d rendezvous store: the others must go on."""

from __future__ import annotations

import socket

import pytest
from tgtest import EXAMPLE, events, free_port, rank_log, wait_event, wait_for, wait_log

from trainguard.exitcodes import EXIT_EXCLUDED


def port_open(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0

pytestmark = pytest.mark.slow


def test_excluded_store_host_keeps_store_until_the_job_ends(jobs, tmp_path):
    run = tmp_path / "run"
    port = free_port()
    common = [
        "--nnodes", "1:2", "--nproc-per-node", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
        "--rdzv-id", "keeper", "--rdzv-conf", "last_call_timeout=3", "--max-restarts", "0", "--run-dir", run,
        "--exclude-straggler", "--precheck", "off", "--quiet",
    ]
    script = [EXAMPLE, "--steps", "150", "--step-time-ms", "50"]
    slow = ["--slow-rank", "1", "--slow-factor", "3"]
    host = jobs("run", *common, "--node-name", "node0", *script, *slow, name="node0")
    # node0 binds the endpoint first, so it hosts the rendezvous store — and holds the slow rank 1
    # (each worker reads its own node's flags: only node0's need --slow-rank; without it node1,
    # once alone, trains its 150 steps at full speed instead of three times slower)
    wait_for(lambda: port_open(port), what="node0 hosting the rendezvous store")
    other = jobs("run", *common, "--node-name", "node1", *script, name="node1")
    assert other.wait() == 0, other.output()
    assert host.wait() == EXIT_EXCLUDED, host.output()
    assert "The node is a straggler and exits." in host.output()
    [excluded] = events(run, "node_excluded")
    assert excluded.node == "node0"
    assert [e.node for e in events(run, "job_succeeded")] == ["node1"]
    assert [e.node for e in events(run, "store_keeper_done")] == ["node0"]
    assert not events(run, "job_failed")
    # node1 went on alone: its last attempt had world size 2 (its own two workers)
    last = [e for e in events(run, "job_started") if e.node == "node1"][-1]
    assert last.evidence["group_world_size"] == 1


def test_a_node_joining_a_running_job_learns_the_new_rounds_master(jobs, tmp_path):
    """torch caches rank 0's MASTER_ADDR from the first rendezvous round (TCPStore sharing) and
    never writes it again: a node that joined a later round waited 60 s for that key, then failed.
    The agent clears the cache before each round (torch_compat.forget_rendezvous_bootstrap)."""
    run = tmp_path / "run"
    port = free_port()
    common = [
        "--nnodes", "1:2", "--nproc-per-node", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
        "--rdzv-id", "late", "--rdzv-conf", "last_call_timeout=1", "--max-restarts", "1", "--run-dir", run,
        "--precheck", "off", "--quiet",
    ]  # fmt: skip
    script = [EXAMPLE, "--steps", "100000", "--step-time-ms", "50"]
    jobs("run", *common, "--node-name", "node0", *script, name="node0")
    wait_event(run, "job_started", pred=lambda e: e.node == "node0")  # round 0, alone
    late = jobs("run", *common, "--node-name", "node1", *script, name="node1")
    joined = wait_event(run, "job_started", pred=lambda e: e.node == "node1")
    assert joined.evidence["group_world_size"] == 2
    wait_log(rank_log(run, joined.evidence["attempt"], 1), "step=3 rank=1")  # both ranks train together
    assert late.proc.poll() is None and not events(run, "job_failed"), late.output()
