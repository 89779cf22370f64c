"""--node-check result reuse: a node's recent healthy result stands while nothing about it changed;
only the nodes involved in a failure (or changed) are rechecked, with healthy partners, and every
agent still reaches the same verdict through the store."""

from __future__ import annotations

from datetime import timedelta

import pytest
from test_checks_monitor import before_start_all, contexts, kinds, monitor, options
from test_policy import ZERODIV
from torch.distributed import TCPStore

from trainguard.checks.bench import CHAOS_ENV
from trainguard.checks.items import HardwareReport
from trainguard.detect.nodecheck import recheck_nodes
from trainguard.evidence import RankFailure
from trainguard.monitors.checks import NodeCheckConfig
from trainguard.monitors.nodecheck_reuse import NEVER_CHECKED, NodeCheckMemory, fingerprint
from trainguard.policy import Action


@pytest.mark.parametrize(
    "nodes,needy,want",
    [
        ([0, 1, 2, 3], set(), []),
        ([0, 1, 2, 3], {2}, [0, 1, 2]),  # two partners: a failed pair can still be told apart
        ([0, 1, 2, 3, 4, 5], {1, 4}, [0, 1, 2, 3, 4]),
        ([0, 1], {1}, [0, 1]),
        ([0], {0}, [0]),
        ([0, 1, 2], {0, 1, 2}, [0, 1, 2]),
    ],
)
def test_recheck_nodes(nodes, needy, want):
    assert recheck_nodes(nodes, needy) == want


def test_memory_reuses_only_a_recent_healthy_result_of_an_unchanged_uninvolved_node():
    m = NodeCheckMemory(reuse_s=600)
    assert m.reason_to_check("fp", now=0) == NEVER_CHECKED
    m.record(True, "fp", now=100)
    assert m.reason_to_check("fp", now=650) == ""
    assert "reuse limit" in m.reason_to_check("fp", now=701)
    assert "changed" in m.reason_to_check("other", now=101)
    m.involve("its rank(s) [0] failed")
    m.involve("something later")  # the first reason is kept
    assert m.reason_to_check("fp", now=101) == "its rank(s) [0] failed"
    m.record(True, "fp", now=200)  # rechecked: involvement cleared
    assert m.reason_to_check("fp", now=201) == ""
    m.record(False, "fp", now=300)  # a faulty or straggling result is never reused
    assert m.reason_to_check("fp", now=301) == NEVER_CHECKED
    assert NodeCheckMemory(reuse_s=0, healthy_at=1.0, fingerprint="fp").reason_to_check("fp", now=2).startswith("reuse off")


def test_fingerprint_follows_settings_and_devices(monkeypatch):
    cfg = NodeCheckConfig()
    a = fingerprint("node0", cfg)
    assert a == fingerprint("node0", NodeCheckConfig())
    assert a != fingerprint("node1", cfg)
    assert a != fingerprint("node0", NodeCheckConfig(gemm_n=64))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1,2")
    assert a != fingerprint("node0", cfg)


@pytest.fixture
def server():
    s = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
    yield s
    del s


def _round(tmp_path, server, monitors, opts, round_no, ctxs=None):
    ctxs = ctxs or contexts(tmp_path, server, len(monitors), opts, round_no=round_no)
    before = len(kinds(tmp_path, "nodecheck_result"))
    got = before_start_all(monitors, ctxs, opts)
    results = kinds(tmp_path, "nodecheck_result")[before:]
    assert len(results) == len(monitors)
    return got, results


@pytest.mark.slow
def test_only_the_nodes_involved_in_a_failure_are_rechecked(tmp_path, server):
    common = ["--nnodes", "3:4", "--precheck", "off", "--health-check-interval", "0", "--node-check",
              "--node-check-iters", "2", "--node-check-gemm-n", "32", "--node-check-coll-mb", "0.05",
              "--node-check-straggler-ratio", "1000"]  # this test is not about timing: no stragglers on a busy machine  # fmt: skip
    opts = [options(*common) for _ in range(4)]
    healthy = lambda c: HardwareReport(True, [], [])  # noqa: E731 - the post-failure hardware check
    monitors = [monitor(o, hardware_check_fn=healthy) for o in opts]

    # Round 0: nobody has a result yet: everyone is checked.
    got, res = _round(tmp_path, server, monitors, opts, 0)
    assert all(d is None or d.action == Action.CONTINUE for d in got.values()), got
    assert sorted(e.node for e in res) == ["node0", "node1", "node2", "node3"]
    assert all(e.evidence["checked"] == [0, 1, 2, 3] and e.evidence["measurements"] for e in res)

    # Round 1 (e.g. a re-rendezvous for a reason on no node): every result stands, no benchmark.
    got, res = _round(tmp_path, server, monitors, opts, 1)
    assert all(e.evidence.get("reused") and e.evidence["checked"] == [] for e in res), [e.message for e in res]

    # Node 1's own rank failed; node 0's rank only lost its peer: node 1 is rechecked, with two
    # healthy partners; node 3 keeps its result and takes the verdict from the store.
    ctxs = contexts(tmp_path, server, 4, opts, round_no=2)
    monitors[1].on_workers_failed(ctxs[1], {1: ZERODIV})
    gloo_peer = "RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:4312"
    monitors[0].on_workers_failed(ctxs[0], {0: RankFailure(0, 1234, 1, log_tail=(gloo_peer,))})
    got, res = _round(tmp_path, server, monitors, opts, 2, ctxs)
    assert all(d is None or d.action == Action.CONTINUE for d in got.values()), got
    by_node = {e.node: e for e in res}
    assert {n: e.evidence["checked"] for n, e in by_node.items()} == {f"node{i}": [0, 1, 2] for i in range(4)}
    assert by_node["node3"].evidence["measurements"] == [] and by_node["node1"].evidence["measurements"]
    assert set(by_node["node3"].evidence["why"]) == {"1"} and "failed" in by_node["node3"].evidence["why"]["1"]

    # Node 3 changes (its check now fails: fault injection changes its settings): it is rechecked
    # with nodes 0 and 1, found faulty by all four agents alike (node 2 through the store), excluded.
    monitors[3]._node_check_env = {CHAOS_ENV: "fail"}
    got, res = _round(tmp_path, server, monitors, opts, 3)
    assert {e.node: e.evidence["checked"] for e in res} == {f"node{i}": [0, 1, 3] for i in range(4)}
    assert all(list(e.evidence["verdict"]["faulty"]) == ["3"] for e in res), [e.evidence["verdict"] for e in res]
    assert got[3].action == Action.EXCLUDE_NODE
    assert all(got[i].action == Action.RERENDEZVOUS for i in (0, 1, 2)), got
