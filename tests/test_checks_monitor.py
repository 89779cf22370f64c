"""The checks monitor with hand-built MonitorContexts and a real TCPStore on 127.0.0.1: agents agree
on pre-check and node-check verdicts through the store, exactly as `trainguard run` agents do."""

from __future__ import annotations

import argparse
import threading
from datetime import timedelta

import pytest
from test_policy import ZERODIV
from tgtest import wait_for
from torch.distributed import PrefixStore, TCPStore

from trainguard import policy
from trainguard.agent.cli import make_parser
from trainguard.checks import items as I
from trainguard.checks.items import HardwareReport
from trainguard.events import EventBus, EventStore
from trainguard.monitors import checks as CM
from trainguard.monitors.api import MonitorContext, StepTracker
from trainguard.policy import Action


def options(*argv: str) -> argparse.Namespace:
    """`trainguard run` flags, parsed by its own parser."""
    base = ["--nnodes", "1", "--rdzv-endpoint", "127.0.0.1:0", "--nproc-per-node", "1"]
    return make_parser().parse_args([*base, *argv, "train.py"])


def monitor(opts: argparse.Namespace, **kw) -> CM.ChecksMonitor:
    return CM.ChecksMonitor(CM.ChecksSettings.from_options(opts), **kw)


@pytest.fixture
def server():
    s = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
    yield s
    del s


def contexts(tmp_path, server, nnodes, opts, round_no=0):
    store = EventStore(tmp_path)
    out = []
    for r in range(nnodes):
        client = TCPStore("127.0.0.1", server.port, is_master=False, timeout=timedelta(seconds=60))
        out.append(
            MonitorContext(
                run_dir=tmp_path,
                node=f"node{r}",
                node_rank=r,
                nnodes=nnodes,
                nproc_per_node=1,
                world_size=nnodes,
                restart_count=round_no,
                workers=[],
                events=EventBus(store, f"node{r}"),
                steps=StepTracker(),
                store=PrefixStore(f"round{round_no}", client),  # the agent's store is round-scoped
            )
        )
    return out


def before_start_all(monitors, ctxs, opts):
    """Every node's pre-start outcome, and what the policy decides on it for that node (as the agent does)."""
    decisions: dict[int, object] = {}
    errors: list[BaseException] = []

    def one(i):
        try:
            outcome = monitors[i].on_before_start(ctxs[i])
            settings = policy.PolicySettings.from_options(opts[i])
            n = ctxs[i].nnodes
            decisions[i] = outcome and policy.decide_before_start(
                outcome, ctxs[i].node_rank, n, settings.min_nodes(n), settings.node_check_exclude_straggler
            )
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(monitors))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=240)
    assert not errors, errors
    assert len(decisions) == len(monitors), "a monitor did not finish"
    return decisions


def kinds(tmp_path, kind):
    return EventStore(tmp_path, readonly=True).query(kinds=[kind])


def test_failed_precheck_excludes_that_node_and_the_rest_go_on(tmp_path, server):
    common = ["--nnodes", "3:4", "--check-cache-dir", "/nonexistent", "--health-check-interval", "0"]
    opts = [options(*common) for _ in range(4)]
    opts[2] = options(*common, "--check-disk-shm-gb", "1e9")  # node 2's /dev/shm is "too small"
    monitors = [monitor(o) for o in opts]
    got = before_start_all(monitors, contexts(tmp_path, server, 4, opts), opts)
    assert got[2].action == Action.EXCLUDE_NODE
    assert got[2].exit_message == policy.NODE_DOWN_MESSAGE == "The node is down."
    assert got[2].evidence["scenario"] == 2  # pre-check failed, hardware fine
    assert "disk-size shm" in got[2].reason
    for n in (0, 1, 3):
        assert got[n].action == Action.RERENDEZVOUS and "node 2 (node2) excluded" in got[n].reason
    failed = kinds(tmp_path, "precheck_failed")
    assert [e.node for e in failed] == ["node2"]
    assert any(i["item"] == "disk-size shm" and i["status"] == "failed" for i in failed[0].evidence["items"])
    assert sorted(e.node for e in kinds(tmp_path, "precheck_passed")) == ["node0", "node1", "node3"]
    # node_excluded itself is recorded by the agent when it carries the decision out (test_checks_e2e).

    # Next round without node 2: the cheap items run again (a disk may have filled), the rest stand.
    again = before_start_all(
        [monitors[i] for i in (0, 1, 3)], contexts(tmp_path, server, 3, opts[:3], round_no=1), opts[:3]
    )
    assert list(again.values()) == [None, None, None]
    passed_ = kinds(tmp_path, "precheck_passed")
    assert len(passed_) == 6
    assert [e.evidence["rechecked"] for e in passed_[3:]] == [list(I.RECHECKED_ITEMS)] * 3


def test_an_rdma_port_down_is_a_hardware_fault_of_the_node(tmp_path, server):
    """A down RDMA port fails the rdma item: seed scenario 1 (hardware), like gpu-check."""
    port = tmp_path / "ib" / "mlx5_0" / "ports" / "1"
    port.mkdir(parents=True)
    (port / "state").write_text("1: DOWN\n")
    (port / "phys_state").write_text("3: Disabled\n")
    opts = [options("--check-ib-dir", str(tmp_path / "ib"), "--check-ulimit", "never", "--health-check-interval", "0")]
    got = before_start_all([monitor(opts[0])], contexts(tmp_path, server, 1, opts), opts)
    assert got[0].action == Action.EXCLUDE_NODE and got[0].evidence["scenario"] == 1
    assert "item rdma ... failed (1 of 1 RDMA port(s) not up: mlx5_0/1 state '1: DOWN'" in got[0].reason


def test_failed_precheck_stops_a_job_that_is_not_elastic(tmp_path, server):
    common = ["--nnodes", "2", "--health-check-interval", "0"]
    opts = [options(*common), options(*common, "--check-disk-root-gb", "1e9")]
    got = before_start_all([monitor(o) for o in opts], contexts(tmp_path, server, 2, opts), opts)
    assert got[1].action == Action.EXCLUDE_NODE
    assert got[0].action == Action.STOP_JOB and "needs at least 2" in got[0].reason


def test_precheck_off_and_all_off():
    assert CM.create(CM.settings(options("--precheck", "off", "--health-check-interval", "0"))) is None
    assert isinstance(CM.create(CM.settings(options())), CM.ChecksMonitor)


def test_periodic_hardware_check_turns_a_fault_into_exclusion(tmp_path, server):
    calls = []

    def fake(cfg):
        calls.append(cfg.xid_window_s)
        bad = len(calls) >= 2
        return HardwareReport(
            healthy=not bad, faults=["GPU 0: row remapping failed"] if bad else [], items=[]
        )

    opts = options("--health-check-interval", "0.05", "--precheck", "off")
    mon = monitor(opts, hardware_check_fn=fake)
    ctx = contexts(tmp_path, server, 1, [opts])[0]
    try:
        mon.on_workers_started(ctx)
        fault = wait_for(lambda: mon.poll(ctx), timeout=60, what="evidence from poll")
    finally:
        mon.close()
    assert fault.faults == ["GPU 0: row remapping failed"] and (fault.node, fault.node_rank) == ("node0", 0)
    d = policy.decide_on_hardware_fault(fault, nnodes=2, min_nodes=1)  # a job that can go on without it
    assert d.action == Action.EXCLUDE_NODE and d.exit_message == "The node is down."
    assert "row remapping failed" in d.reason and d.source == "health_check"
    assert mon.poll(ctx) is None  # reported once
    assert kinds(tmp_path, "hardware_fault")
    assert all(w < 3600 for w in calls)  # only Xids since the agent started count


def test_workers_failed_runs_the_hardware_check_for_the_policy(tmp_path, server):
    opts = options("--health-check-interval", "0")
    healthy = monitor(opts, hardware_check_fn=lambda c: HardwareReport(True, [], []))
    ctx = contexts(tmp_path, server, 1, [opts])[0]
    report = healthy.on_workers_failed(ctx, {1: ZERODIV})
    assert (report.healthy, report.faults) == (True, [])
    d = policy.decide_on_failure({1: ZERODIV}, 3, None, report)
    assert d.action == Action.STOP_JOB  # scenario 4
    assert d.evidence["hardware"] == {"healthy": True, "faults": []}

    sick = monitor(opts, hardware_check_fn=lambda c: HardwareReport(False, ["Xid 79"], []))
    report = sick.on_workers_failed(ctx, {1: ZERODIV})
    assert policy.decide_on_failure({1: ZERODIV}, 3, None, report).action == Action.EXCLUDE_NODE
    assert [e.severity.label for e in kinds(tmp_path, "hardware_check")] == ["info", "critical"]


def test_a_broken_hardware_checker_leaves_no_verdict(tmp_path, server):
    opts = options("--health-check-interval", "0")
    mon = monitor(opts, hardware_check_fn=lambda c: 1 / 0)
    ctx = contexts(tmp_path, server, 1, [opts])[0]
    assert mon.on_workers_failed(ctx, {}) is None
