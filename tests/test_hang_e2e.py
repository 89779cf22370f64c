"""End to end through `trainguard run`: the profiling monitor feeds step samples from the workers'
optimizer hooks, the hang monitor finds the culprit (a rank spinning in Python; a rank sleeping
before all_reduce on another node), the agent restarts the group, and the job finishes."""

from __future__ import annotations

from pathlib import Path

import pytest
from tgtest import SCRIPTS, events, free_port, processes_of, wait_event, wait_for

pytestmark = pytest.mark.slow


def test_hang_busy_loop_through_trainguard_run(jobs, tmp_path: Path) -> None:
    """An endless `while True` loop cannot be told from long work within seconds: it is a
    suspicion (warning) at once, and a detected hang at --hang-detect-time (here 0.25 min) once
    the seed's rule holds: no I/O in the job, flat CPU, no rank progressing."""
    run = tmp_path / "run"
    job = jobs(
        "run", "--standalone", "--nproc-per-node", "2", "--max-restarts", "1", "--run-dir", run,
        "--hang-period", "0.5", "--hang-step-slack", "3", "--hang-detect-time", "0.25",
        SCRIPTS / "hang_worker.py", "--steps", "30", "--fault", "spin", "--fault-rank", "0", "--fault-step", "10",
    )  # fmt: skip
    assert job.wait() == 0, job.output()
    suspected = events(run, "hang_suspected")
    # a suspicion at once; at each window another one while the window's CPU series is not flat yet
    # (it still holds the last steps, or a loaded machine makes the spinner's share jump), then the
    # verdict: how many windows that takes depends on the machine's load, so only their order and
    # their rank are asserted (below: every suspicion comes before the verdict)
    assert suspected and {e.rank for e in suspected} == {0}, [e.message for e in suspected]
    assert suspected[0].severity.label == "warning" and "spin_forever" in suspected[0].evidence["stack"][0]
    assert Path(suspected[0].evidence["report"]).exists()
    hangs = events(run, "hang_detected")
    assert len(hangs) == 1, [e.message for e in hangs]
    ev = hangs[0]
    assert ev.rank == 0 and ev.evidence["rule"] == "detect-time", ev.message
    assert all(e.time < ev.time for e in suspected), [e.message for e in suspected]
    assert ev.evidence["ranks"]["0"]["kind"] == "user" and ev.evidence["ranks"]["0"]["busy"]
    assert ev.evidence["ranks"]["1"]["op"] == "all_reduce"
    assert "spin_forever" in ev.evidence["stack"][0]
    assert Path(ev.evidence["report"]).exists()
    decisions = [e for e in events(run, "policy_decision") if e.evidence.get("source") == "hang"]
    assert len(decisions) == 1 and decisions[0].rank == 0 and decisions[0].evidence["action"] == "restart"
    kinds = [e.kind for e in events(run)]
    assert kinds.index("hang_detected") < kinds.index("restart") < len(kinds) - 1
    assert kinds[-1] == "job_succeeded", kinds


def test_hang_multi_node_long_evaluation_on_one_node_is_not_a_hang(jobs, tmp_path: Path) -> None:
    """Healthy: rank 1 (node1) evaluates alone for 20 s while rank 0 (node0) waits for it in
    all_reduce. Node0 sees only a waiting rank and no culprit of its own; the other node's rank
    still progresses, which holds node0's verdict: no hang_detected, no restart."""
    run = tmp_path / "run"
    common = ["--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d",
              "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--rdzv-id", "evalnode", "--max-restarts", "1",
              "--run-dir", run, "--hang-period", "0.5", "--hang-step-slack", "3"]  # fmt: skip
    script = [SCRIPTS / "hang_worker.py", "--steps", "30", "--eval-at", "10", "--eval-rank", "1", "--eval-seconds", "20"]
    agents = [jobs("run", *common, "--node-name", f"node{i}", *script, name=f"node{i}") for i in (0, 1)]
    for a in agents:
        assert a.wait() == 0, a.output()
    assert not events(run, "hang_detected"), [e.message for e in events(run, "hang_detected")]
    assert not events(run, "restart")
    assert len(events(run, "job_succeeded")) == 2


@pytest.mark.parametrize(
    ("fault", "culprit"),
    [("sleep", 1), ("stop", 0)],  # the culprit on the other node; the leader's (node rank 0's) worker SIGSTOPped
)
def test_hang_one_verdict_for_the_job(jobs, tmp_path: Path, fault: str, culprit: int) -> None:
    """Two agents, one worker each: one rank hangs, both nodes judge the stall, and the job gets
    ONE hang_detected, agreed through the rendezvous store, naming the culprit from the stacks the
    nodes share, with what each node saw attached. Both nodes restart on that verdict."""
    run = tmp_path / "run"
    common = ["--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d",
              "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--rdzv-id", "hang2", "--max-restarts", "1",
              "--run-dir", run, "--hang-period", "0.5", "--hang-step-slack", "3"]  # fmt: skip
    script = [SCRIPTS / "hang_worker.py", "--steps", "30", "--fault", fault, "--fault-rank", str(culprit),
              "--fault-step", "10"]  # fmt: skip
    agents = [jobs("run", *common, "--node-name", f"node{i}", *script, name=f"node{i}") for i in (0, 1)]
    for a in agents:
        assert a.wait() == 0, a.output()
    hangs = events(run, "hang_detected")  # every node's events
    assert len(hangs) == 1, [(e.node, e.message) for e in hangs]
    ev = hangs[0]
    assert ev.rank == culprit and ev.evidence["recorded_by"] == ev.node, ev.message
    nodes = ev.evidence["nodes"]
    assert set(nodes) == {"node0", "node1"}, nodes  # who saw what
    assert set(nodes[f"node{culprit}"]["ranks"]) == {str(culprit)}
    assert nodes[f"node{culprit}"]["culprit"] == culprit  # the culprit's own node named it
    other = nodes[f"node{1 - culprit}"]
    assert "all_reduce" in other["ranks"][str(1 - culprit)]["position"], other  # the other rank waited for it
    assert other["culprit"] in (None, culprit)  # alone it cannot tell; never another rank
    report = Path(ev.evidence["report"]).read_text()
    assert "nodes (what each node saw):" in report and "node1 (node rank 1, " in report, report
    if ev.node != f"node{culprit}":  # named from the other node's stacks
        assert "on another node" in ev.evidence["reason"]
        assert "hang_worker.py" in "".join(ev.evidence["stack"])
    # every node acts on the one verdict (none records a verdict of its own)
    decisions = [e for e in events(run, "policy_decision") if e.evidence.get("source") == "hang"]
    assert decisions and {e.rank for e in decisions} == {culprit}
    assert {e.evidence.get("recorded_by") for e in decisions} == {ev.node}
    assert events(run, "hang_suspected") == [] and events(run, "hang_cleared") == []
    assert {e.node for e in events(run, "job_succeeded")} == {"node0", "node1"}


def test_hang_action_notify_records_and_never_stops_a_worker(jobs, tmp_path: Path) -> None:
    """--hang-action notify (seed 000's "suspected hung" marking): a stopped rank is a detected
    hang, recorded and notified, and the workers are left as they are: no restart. Continued by
    hand, the job finishes and the watch says the steps resumed."""
    run = tmp_path / "run"
    job = jobs(
        "run", "--standalone", "--nproc-per-node", "2", "--max-restarts", "1", "--run-dir", run,
        "--hang-period", "0.5", "--hang-step-slack", "3", "--hang-action", "notify",
        SCRIPTS / "hang_worker.py", "--steps", "30", "--fault", "stop", "--fault-rank", "1", "--fault-step", "10",
    )  # fmt: skip
    ev = wait_event(run, "hang_detected")
    assert ev.rank == 1 and "--hang-action notify" in ev.message, ev.message
    stopped = wait_for(lambda: [p for p in processes_of(run) if p.status() == "stopped"], what="the stopped rank")
    for proc in stopped:
        proc.resume()
    assert job.wait() == 0, job.output()
    assert not events(run, "restart") and not [e for e in events(run, "policy_decision")
                                               if e.evidence.get("source") == "hang"]  # fmt: skip
    cleared = events(run, "hang_cleared")
    assert cleared and "notify" in cleared[-1].message, [e.message for e in cleared]
    assert events(run, "job_succeeded")
