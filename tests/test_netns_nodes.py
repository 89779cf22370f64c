"""Nodes in network namespaces, each with its own address and no host-name resolution for it
(chaos/testbed.py): the stores are reached through the right addresses, and a node that cannot
reach the workers' store fails at once, naming the address. Needs root."""

from __future__ import annotations

import pytest
from tgtest import EXAMPLE, events

from trainguard.chaos import testbed

pytestmark = [pytest.mark.slow, pytest.mark.skipif(testbed.available() is not None, reason=str(testbed.available()))]


@pytest.fixture
def bed():
    with testbed.Testbed(2) as b:
        yield b


def node_args(bed, run, node, *, rdzv_id: str, port: int = 29400) -> list:
    return [
        "--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d",
        "--rdzv-endpoint", f"{bed.nodes[0].addr}:{port}", "--rdzv-id", rdzv_id, "--max-restarts", "0",
        "--run-dir", run, "--node-name", f"n{node.index}", "--precheck", "off", "--quiet",
    ]  # fmt: skip


def start(jobs, bed, node, args):
    return jobs(*args, prefix=node.exec_prefix(), env={"GLOO_SOCKET_IFNAME": node.ifname}, name=f"n{node.index}")


def test_nodes_in_namespaces_train_without_local_addr(jobs, bed, tmp_path):
    """Host names do not resolve to the nodes' addresses here: the store host is found from the
    endpoint, and each round's workers' store is bound to and reached at the node's own address."""
    run = tmp_path / "run"
    agents = [
        start(jobs, bed, n, ["run", *node_args(bed, run, n, rdzv_id="ns-ok"), EXAMPLE, "--steps", "20"])
        for n in bed.nodes
    ]
    for a in agents:
        assert a.wait() == 0, a.output()
    started = events(run, "job_started")
    assert {e.evidence["group_world_size"] for e in started} == {2}
    assert {e.node for e in events(run, "job_succeeded")} == {"n1", "n2"}


def test_a_node_that_cannot_reach_the_workers_store_fails_at_once(jobs, bed, tmp_path):
    """Node 1 advertises an address only it has (on its loopback): node 2 has no route to it."""
    run = tmp_path / "run"
    n1, n2 = bed.nodes
    private = f"10.{n1.addr.split('.')[1]}.254.1"
    testbed._ip("addr", "add", f"{private}/32", "dev", "lo", netns=n1.netns)
    script = [EXAMPLE, "--steps", "100000", "--step-time-ms", "50"]
    a1 = start(jobs, bed, n1, ["run", *node_args(bed, run, n1, rdzv_id="ns-cut"), "--local-addr", private, *script])
    a2 = start(jobs, bed, n2, ["run", *node_args(bed, run, n2, rdzv_id="ns-cut"), *script])
    assert a2.wait() != 0, a2.output()
    assert f"node n2 cannot reach the workers' store at {private}:" in a2.output()
    assert "--local-addr" in a2.output()
    assert a1.wait() != 0, a1.output()  # told to stop through the rendezvous store
    failed = {e.node: e.message for e in events(run, "job_failed")}
    assert "cannot reach the workers' store" in failed["n2"]
