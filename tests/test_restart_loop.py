"""Restart loops and the site's node history: the pure detector and policy, and real
2-rank gloo jobs under `trainguard run` (a rank that SIGKILLs itself at the same step in every
attempt; a host the node history refuses at the pre-check)."""

from __future__ import annotations

import sqlite3
import subprocess
import sys
import threading

import pytest
from tgtest import EXAMPLE, SCRIPTS, events, free_port, rank_log, trainguard_cmd, wait_for

from trainguard.cluster import node_history
from trainguard.cluster.node_history import HistoryUnavailable, NodeHistory
from trainguard.detect.restart_loop import find_restart_loop
from trainguard.evidence import AttemptRecord, CheckOutcome, RankFailure
from trainguard.exitcodes import EXIT_EXCLUDED, EXIT_FAILED, retryable
from trainguard.policy import (
    Action,
    PolicySettings,
    decide_before_start,
    decide_on_failure,
    guard_restart_loop,
    history_kind,
)

CORE = SCRIPTS / "core_job.py"
KILL = "signal SIGKILL"


def rec(attempt, step, kind=KILL, node="n0", own=True, nnodes=1, source="log"):
    return AttemptRecord(attempt, node, kind, step, source, own, nnodes)


# --------------------------------------------------------------------------- the detector (pure)


def test_loop_needs_k_consecutive_same_kind_attempts_that_never_pass_the_step():
    assert find_restart_loop([rec(0, 6), rec(1, 6), rec(2, 6)], 3).steps == [6, 6, 6]
    assert find_restart_loop([rec(0, 9), rec(1, 6), rec(2, 4)], 3) is not None  # earlier each time
    assert find_restart_loop([rec(0, 6), rec(1, 6)], 3) is None  # not K yet
    assert find_restart_loop([rec(0, 6), rec(1, 6), rec(2, 6)], 0) is None  # off
    assert find_restart_loop([rec(0, 6), rec(1, 7), rec(2, 7)], 3) is None  # attempt 1 passed step 6: progress
    assert find_restart_loop([rec(0, 6), rec(1, 6, "exit exit code 3"), rec(2, 6)], 3) is None  # another kind
    assert find_restart_loop([rec(0, 6), rec(1, None), rec(2, 6)], 3) is None  # a step not seen: no proof
    assert find_restart_loop([rec(0, 6), rec(2, 6), rec(3, 6)], 3) is None  # an attempt between (a new round)
    assert find_restart_loop([rec(0, 6), rec(1, 6, own=False), rec(2, 6)], 3) is None  # only lost a peer
    assert find_restart_loop([rec(0, 6), rec(1, 6, source="spans"), rec(2, 6)], 3) is None  # steps not comparable
    # the last K count: an old progressing attempt does not hide a loop after it
    assert find_restart_loop([rec(0, 2), rec(1, 8), rec(2, 8), rec(3, 8)], 3).attempts[0].attempt == 1


def test_loop_follows_a_node_only_when_others_trained_with_it():
    assert find_restart_loop([rec(i, 6) for i in range(3)], 3).node is None
    assert find_restart_loop([rec(i, 6, node="b", nnodes=2) for i in range(3)], 3).node == "b"


def test_the_step_of_an_attempt_is_the_jobs_own_numbering_in_the_rank_logs():
    from trainguard.agent.elastic import steps_in_logs

    tail = ("2026-11-25T19:14:33.1 [rank1]: resume step=5", "2026-11-25T19:14:33.2 [rank1]: step=6 rank=1 t=1795634073.2")
    fs = {1: RankFailure(1, 5, -9, "SIGKILL", log_tail=tail),
          0: RankFailure(0, 4, -15, "SIGTERM", log_tail=("[rank0]: saving step=5", "[rank0]: step=6 rank=0"), collateral=True)}
    assert steps_in_logs(fs) == 6
    assert steps_in_logs({1: RankFailure(1, 5, -9, "SIGKILL", log_tail=("loading data",))}) is None


# --------------------------------------------------------------------------- the policy (pure)


def _killed() -> dict[int, RankFailure]:
    return {1: RankFailure(1, 123, -9, "SIGKILL")}


def test_policy_stops_a_loop_with_a_permanent_exit_and_isolates_the_node_it_follows():
    settings = PolicySettings(nnodes="1:2")
    restart = decide_on_failure(_killed(), remaining_restarts=5)
    assert restart.action == Action.RESTART
    loop = [rec(i, 6) for i in range(3)]
    stop = guard_restart_loop(restart, loop, settings, nnodes=1)
    assert stop.action == Action.STOP_JOB and stop.source == "restart_loop"
    assert stop.evidence["restart_loop"]["steps"] == [6, 6, 6] and "restart loop" in stop.reason
    assert not retryable(EXIT_FAILED)  # what a STOP_JOB without faulty nodes exits with (launch.py)
    assert guard_restart_loop(restart, loop[:2], settings, nnodes=1) is restart  # not yet
    assert guard_restart_loop(restart, loop, PolicySettings(restart_loop_attempts=0), 1) is restart
    # elastic job (--nnodes 1:2), the failures follow node b: b leaves, the job goes on
    on_b = [rec(i, 6, node="b", nnodes=2) for i in range(3)]
    out = guard_restart_loop(restart, on_b, settings, nnodes=2)
    assert out.action == Action.EXCLUDE_NODE and out.exit_message
    assert history_kind(out) == node_history.RESTART_LOOP
    # not elastic (--nnodes 2): excluding b would leave too few nodes, the job stops instead
    assert guard_restart_loop(restart, on_b, PolicySettings(nnodes="2"), nnodes=2).action == Action.STOP_JOB
    assert history_kind(stop) is None  # a loop that did not follow a node says nothing about the host


def test_policy_never_loops_past_its_own_stop():
    """A user error stops at once (no restart to guard); a failure without restarts left ends as before."""
    stopped = decide_on_failure(_killed(), remaining_restarts=0)
    assert guard_restart_loop(stopped, [rec(i, 6) for i in range(3)], PolicySettings(), 1) is stopped


def test_history_refusal_on_an_elastic_job_isolates_only_that_node():
    outcomes = {"0": {"passed": True, "node": "good"},
                "1": {"passed": False, "node": "bad", "history_refused": True, "hardware_fault": True}}
    outcome = CheckOutcome("precheck", {1: "pre-check failed: item node-history ... failed"}, hardware_faulty=frozenset({1}),
                           names={0: "good", 1: "bad"}, details={"outcomes": outcomes})
    bad = decide_before_start(outcome, node_rank=1, nnodes=2, min_nodes=1)
    good = decide_before_start(outcome, node_rank=0, nnodes=2, min_nodes=1)
    assert bad.action == Action.EXCLUDE_NODE and bad.evidence["scenario"] == 1
    assert good.action == Action.RERENDEZVOUS  # the job goes on on the others
    assert history_kind(bad) == node_history.EXCLUSION  # a refusal is not a new fault (no counting itself up)
    assert history_kind(good) is None


# --------------------------------------------------------------------------- the history file (real SQLite)


def test_history_counts_concurrent_writers_and_survives_a_bad_file(tmp_path):
    path = tmp_path / "site" / node_history.DEFAULT_NAME
    hist = NodeHistory(path)
    assert hist.faults(0) == []  # no file yet: no history, nothing created

    def write(i):
        NodeHistory(path).record(f"h{i % 2}", node_history.HARDWARE, f"xid {i}", "run")

    threads = [threading.Thread(target=write, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    hist.record("h0", node_history.EXCLUSION, "straggler", "run")
    faults = hist.faults(0)
    assert len(faults) == 9
    refused = node_history.refused_hosts(faults, 2)
    assert sorted(refused) == ["h0", "h1"] and len(refused["h0"]) == 4  # the exclusion does not count
    assert node_history.refused_hosts(hist.faults(0), 5) == {}
    assert node_history.refused_hosts(hist.faults(0), 0) == {}
    assert hist.faults(10**12) == []  # outside the window
    path.write_bytes(b"this is not a database" * 100)
    with pytest.raises(HistoryUnavailable, match="going on without node history"):
        hist.faults(0)
    with pytest.raises(HistoryUnavailable):
        hist.record("h0", node_history.HARDWARE, "x", "run")


# --------------------------------------------------------------------------- real jobs


@pytest.mark.slow
def test_same_step_crash_stops_after_three_attempts(jobs, tmp_path):
    """Rank 1 SIGKILLs itself at step 7 in every attempt; the job resumes from step 5's snapshot
    each time: three attempts die at step 6, the job stops with exit 1 (restarts were left). A
    corrupt node history costs one line, not the job."""
    run = tmp_path / "run"
    bad_history = tmp_path / "history.sqlite"
    bad_history.write_bytes(b"garbage" * 200)
    job = jobs("run", "--standalone", "--nproc-per-node", "2", "--max-restarts", "5", "--run-dir", run,
               "--node-history", bad_history, CORE, "--kill-at", "7", "--step-time-ms", "5")
    assert job.wait() == EXIT_FAILED, job.output()
    out = job.output()
    assert out.count("going on without node history") == 1, out
    assert [e.evidence["restart_count"] for e in events(run, "restart")] == [1, 2]
    loop = events(run, "restart_loop")
    assert len(loop) == 1, out
    ev = loop[0].evidence
    assert ev["steps"] == [6, 6, 6] and ev["kind"] == KILL and ev["node"] is None and ev["action"] == "stop_job"
    assert [a["attempt"] for a in ev["attempts"]] == [0, 1, 2] and ev["remaining_restarts"] == 3
    assert [a["ranks"] for a in ev["attempts"]] == [[1], [1], [1]]  # the rank that killed itself, not rank 0
    final = events(run, "job_failed")
    assert len(final) == 1 and "restart loop" in final[0].message
    assert "resume step=5" in rank_log(run, 2, 0).read_text()
    print(loop[0].message)


@pytest.mark.slow
def test_node_history_refuses_a_repeat_offender_before_it_trains(jobs, tmp_path):
    run = tmp_path / "runs" / "job"
    history = tmp_path / "runs" / node_history.DEFAULT_NAME  # the default place: next to the run dir
    for detail in ("Xid 79: GPU has fallen off the bus", "ECC uncorrectable error"):
        NodeHistory(history).record("badnode", node_history.HARDWARE, detail, "earlier-run")
    job = jobs("run", "--standalone", "--nproc-per-node", "2", "--run-dir", run, "--node-name", "badnode",
               CORE, "--steps", "3")
    assert job.wait() == EXIT_EXCLUDED, job.output()
    out = job.output()
    assert "The node is down." in out and "item node-history ... failed" in out, out
    assert not events(run, "job_started")  # refused before it trained
    failed = events(run, "precheck_failed")
    assert len(failed) == 1 and "badnode had 2 hardware-class fault(s)" in failed[0].message
    assert (run / "exclude-nodes").read_text().split() == ["badnode"]  # the Slurm exclude list
    kinds = [f.kind for f in NodeHistory(history).faults(0, host="badnode")]
    assert kinds == ["hardware", "hardware", "exclusion"]  # the refusal itself counts nothing
    status = subprocess.run(trainguard_cmd("status", run, "--once"), capture_output=True, text=True, timeout=120)
    assert status.returncode == 0, status.stderr
    line = next(ln for ln in status.stdout.splitlines() if ln.startswith("node history:"))
    assert "badnode 2 fault(s)" in line and "refused at the pre-check" in line
    print(failed[0].message, line, sep="\n", file=sys.stderr)
    with sqlite3.connect(history) as conn:  # a plain SQLite file others can read
        assert conn.execute("SELECT count(*) FROM node_faults").fetchone()[0] == 3


@pytest.mark.slow
def test_elastic_job_goes_on_without_the_host_the_history_refuses(jobs, tmp_path):
    """Two agents (--nnodes 1:2): the history refuses badnode at its pre-check, node0 trains alone."""
    run = tmp_path / "run"
    history = tmp_path / "site.sqlite"
    for detail in ("Xid 79", "Xid 48"):
        NodeHistory(history).record("badnode", node_history.HARDWARE, detail, "earlier-run")
    port = free_port()
    common = ["--nnodes", "1:2", "--nproc-per-node", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
              "--rdzv-id", "hist", "--rdzv-conf", "last_call_timeout=1", "--max-restarts", "2", "--run-dir", run,
              "--node-history", history]  # fmt: skip
    # badnode first: it hosts the rendezvous store, forms a round alone (--nnodes 1:2), is refused at
    # its pre-check and keeps serving the store; node0 then trains in the same job without it (an
    # order that never races: node0 finishing before badnode joined would close the rendezvous).
    bad = jobs("run", *common, "--node-name", "badnode", EXAMPLE, "--steps", "8", name="bad")
    wait_for(lambda: events(run, "node_excluded"), 180, "badnode refused")
    good = jobs("run", *common, "--node-name", "node0", EXAMPLE, "--steps", "8", name="node0")
    assert good.wait() == 0, good.output()
    assert bad.wait() == EXIT_EXCLUDED, bad.output()
    assert "The node is down." in bad.output()
    assert {e.node for e in events(run, "node_excluded")} == {"badnode"}
    assert {e.node for e in events(run, "job_succeeded")} == {"node0"}
    assert not [e for e in events(run, "job_started") if e.node == "badnode"]  # it never trained
    assert [f.kind for f in NodeHistory(history).faults(0)] == ["hardware", "hardware", "exclusion"]

