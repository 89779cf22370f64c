"""NaN triage: a NaN failure is replayed once from the newest finite snapshot with
every rank's gradients checked before their reduction; a NaN that does not come back is a
transient fault (``nan_transient``, training goes on), one that does is the code or the data
(stop), or the hardware when the same rank and node reproduce it on a node whose check found a
fault (exclude). Pure decision tests, then two real 2-rank gloo jobs under `trainguard run`."""

from __future__ import annotations

import argparse
import re

from tgtest import SCRIPTS, events

from trainguard.agent.nantriage import NanTriage
from trainguard.cluster import node_history
from trainguard.cluster.node_history import NodeHistory
from trainguard.evidence import Diagnosis, HardwareReport, NanEvidence
from trainguard.monitors.api import StepSample, StepTracker
from trainguard.policy import (
    Action,
    NanVerdict,
    PolicySettings,
    decide_after_nan_replay,
    decide_nan_replay,
    triage_nan,
)
from trainguard.worker.nancheck import first_nonfinite

WORKER = SCRIPTS / "nan_worker.py"
HEALTHY = HardwareReport(True, [], [])
FAULTY = HardwareReport(False, ["gpu 1: double-bit ECC errors"], [])


def seen(rank: int | None, node: str = "n0", source: str = "gradient_check", nodes: tuple[str, ...] = ()) -> NanEvidence:
    return NanEvidence(1, rank, node, source, step=3, ranks=(rank,) if rank is not None else (),
                       nodes=nodes or ((node,) if node else ()))


def test_triage_verdicts_over_first_attempt_replay_and_hardware():
    first = seen(1, source="diagnosis")
    assert triage_nan(first, None, None, "n0") == NanVerdict.TRANSIENT
    assert triage_nan(first, None, FAULTY, "n0") == NanVerdict.TRANSIENT  # no NaN: nothing to pin on the GPU
    # Reproduced on the same rank and node, whose check found a fault: the hardware.
    assert triage_nan(first, seen(1), FAULTY, "n0") == NanVerdict.HARDWARE
    # Reproduced on healthy hardware, or no check ran: the code or the data.
    assert triage_nan(first, seen(1), HEALTHY, "n0") == NanVerdict.CODE_OR_DATA
    assert triage_nan(first, seen(1), None, "n0") == NanVerdict.CODE_OR_DATA
    # Reproduced on another rank, on another node, or on every node at once: not this GPU.
    assert triage_nan(first, seen(0), FAULTY, "n0") == NanVerdict.CODE_OR_DATA
    assert triage_nan(seen(1, "n1"), seen(1, "n1"), FAULTY, "n0") == NanVerdict.CODE_OR_DATA
    assert triage_nan(first, seen(1, nodes=("n0", "n1")), FAULTY, "n0") == NanVerdict.CODE_OR_DATA
    assert triage_nan(seen(None, ""), seen(None, ""), FAULTY, "n0") == NanVerdict.CODE_OR_DATA


def test_triage_decisions_replay_once_then_continue_exclude_or_stop():
    first = seen(1, source="diagnosis")
    d = decide_nan_replay(first, replays_left=1)
    assert d.action == Action.RESTART and d.source == "nan_triage" and d.evidence["replays_left"] == 0
    assert decide_nan_replay(first, replays_left=0) is None  # decided as before: the user's code, stop
    assert decide_after_nan_replay(first, None, None, "n0", 1, 1).action == Action.CONTINUE
    stop = decide_after_nan_replay(first, seen(0), HEALTHY, "n0", 1, 1)
    assert stop.action == Action.STOP_JOB and stop.rank == 0 and stop.evidence["nan_replay"]["rank"] == 0
    assert decide_after_nan_replay(first, seen(1), FAULTY, "n0", 2, 1).action == Action.EXCLUDE_NODE
    # The last node of a job cannot leave it: the hardware verdict stops the job with the reason.
    assert decide_after_nan_replay(first, seen(1), FAULTY, "n0", 1, 1).action == Action.STOP_JOB


def test_first_nonfinite_takes_the_lowest_step_then_the_earliest_time():
    records = [
        {"rank": 0, "node": "a", "step": 5, "time": 10.0, "where": "before_reduction"},  # the NaN spread to it
        {"rank": 3, "node": "b", "step": 4, "time": 9.5, "where": "before_reduction"},
        {"rank": 2, "node": "b", "step": 4, "time": 9.0, "where": "before_reduction"},
    ]
    e = first_nonfinite(records, attempt=2)
    assert (e.rank, e.node, e.step, e.ranks, e.nodes, e.source) == (2, "b", 4, (2, 3), ("b",), "gradient_check")
    assert first_nonfinite([], 2) is None


def test_agent_state_arms_one_replay_gives_its_switches_and_sees_it_pass_the_nan(tmp_path):
    triage = NanTriage(tmp_path, "n0", replays_left=1)
    steps = StepTracker()
    for step in (1, 2, 3, 4):
        steps.record(StepSample(1, step, 0.0, 0.1))
    first = triage.first_from(Diagnosis("nan_loss", "loss is nan", "high", {"rank": 1}), 0, {0, 1})
    assert (first.rank, first.node, first.source) == (1, "n0", "diagnosis")
    assert triage.worker_env(0) == {"TRAINGUARD_NAN_CHECK": "", "TRAINGUARD_CKPT_FINITE_ONLY": ""}
    triage.arm(first, steps)
    assert triage.replays_left == 0 and triage.first_steps == 4
    triage.on_start(1)
    assert triage.replaying(1) and triage.worker_env(1) == {
        "TRAINGUARD_NAN_CHECK": str(tmp_path / "nan-check" / "attempt-1"), "TRAINGUARD_CKPT_FINITE_ONLY": "1"}
    steps.clear()
    for step in range(1, 9):
        steps.record(StepSample(0, step, 0.0, 0.1))
        assert triage.past_the_nan(steps) == (step > 8)
    steps.record(StepSample(0, 9, 0.0, 0.1))
    assert triage.past_the_nan(steps)
    # The replay failed: the gradient check's records are its evidence; else a NaN diagnosis.
    assert triage.replay_evidence(1, Diagnosis("python_exception"), {0, 1}) is None
    assert triage.replay_evidence(1, Diagnosis("nan_loss", confidence="high", first_failure={"rank": 0}), {0, 1}).rank == 0
    out = tmp_path / "nan-check" / "attempt-1"
    out.mkdir(parents=True)
    (out / "rank-1.json").write_text('{"rank": 1, "node": "n0", "step": 2, "time": 5.0, "where": "before_reduction"}')
    (out / "rank-0.json").write_text("{torn")
    assert triage.replay_evidence(1, None, {0, 1}).rank == 1
    assert triage.done() == first and not triage.replaying(1)


def test_nan_replays_flag_follows_the_settings_pattern():
    base = {"nnodes": "1", "exclude_straggler": False, "node_check_exclude_straggler": False}
    assert PolicySettings.from_options(argparse.Namespace(**base, nan_replays=None)).nan_replays == PolicySettings.nan_replays
    assert PolicySettings.from_options(argparse.Namespace(**base, nan_replays=0)).nan_replays == 0


def node_of(run_dir):
    return events(run_dir, "job_started")[0].node


def _run(jobs, tmp_path, *script_args):
    run_dir = tmp_path / "run"
    job = jobs("run", "--standalone", "--nproc-per-node", "2", "--run-dir", str(run_dir), "--quiet",
               str(WORKER), *script_args)  # fmt: skip
    return job, run_dir


def test_transient_nan_on_one_rank_is_replayed_named_and_training_finishes(jobs, tmp_path):
    """Rank 1's gradient turns NaN at step 10 of the first attempt only: the job replays from the
    step-9 snapshot, the NaN does not come back, ``nan_transient`` names rank 1, exit 0."""
    job, run_dir = _run(jobs, tmp_path, "--flip-step", "10", "--steps", "30")
    assert job.wait() == 0, job.output()
    (transient,) = events(run_dir, "nan_transient")
    assert transient.rank == 1 and transient.evidence["rank"] == 1 and transient.evidence["node"]
    assert transient.evidence["nan_attempt"] == 0 and transient.evidence["replay_attempt"] == 1
    decisions = [e.evidence for e in events(run_dir, "policy_decision")]
    assert [(d["action"], d["source"]) for d in decisions] == [("restart", "nan_triage"), ("continue", "nan_triage")]
    replay_log = (run_dir / "logs" / "attempt-1" / "rank-1.log").read_text()
    # From before the NaN: step 9 mostly; an older one (or the start) when under load the ranks'
    # snapshots had no newer step in common (checkpoint.load_latest agrees on one every rank has).
    assert int(re.search(r"resume step=(\d+)", replay_log)[1]) < 10
    assert "done" in replay_log and "nan-check" not in replay_log
    (restart,) = events(run_dir, "restart")
    assert "NaN replay, no restart used" in restart.message  # --max-restarts 0: the replay is not a retry
    # the site's node history (next to the run dir) keeps it, not counted against the host
    (kept,) = NodeHistory(node_history.default_path(run_dir)).faults(0)
    assert kept.kind == node_history.NAN_TRANSIENT and kept.host == node_of(run_dir) and "rank 1" in kept.detail


def test_nan_that_reproduces_everywhere_stops_with_the_replays_first_rank(jobs, tmp_path):
    """A learning rate that diverges on every rank: the replay reproduces the NaN, the gradient
    check names the first rank, and the job stops, diagnosed as NaN (exit 1)."""
    job, run_dir = _run(jobs, tmp_path, "--lr", "1e4")
    assert job.wait() == 1, job.output()
    assert not events(run_dir, "nan_transient")
    stop = events(run_dir, "policy_decision")[-1].evidence
    assert stop["action"] == "stop_job" and stop["source"] == "nan_triage" and stop["verdict"] == "code_or_data"
    replay = stop["nan_replay"]
    assert replay["source"] == "gradient_check" and replay["rank"] in (0, 1) and replay["attempt"] == 1
    assert replay["rank"] in replay["ranks"] and replay["nodes"] == [node_of(run_dir)]
    assert [d.evidence["category"] for d in events(run_dir, "diagnosis")] == ["nan_loss", "nan_loss"]
