"""Hang verdicts that hold on real workloads (gloo, CPU, real processes).

The healthy matrix — long legitimate phases in one job (tests/scripts/healthy_phases.py): a first
step 30 s slower, rank-0-only evaluation of 40 s while the others wait in a barrier (through
model.module, then the unwrapped model), all ranks evaluating 30 s with no collective, a rank-0
save of 1 GB then a barrier, a DataLoader blocking 20 s at an epoch boundary while its worker
computes, gradient accumulation (an optimizer step every 8 micro-batches) throughout. Under the
production settings it must finish with no ``hang_detected`` and no restart (the suite runs
the phases at 0.6 of these lengths, the first step and the all-rank evaluation at 0.4;
``bench/hang.py`` at full length).

The fault matrix — each must be detected with the right culprit and the job restarted: a rank
blocked forever in a C call, a rank frozen just after a torch.save of a large-ish state (and just
after a Hugging Face Trainer save), a rank idle before the all-reduce the others wait in.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from tgtest import SCRIPTS, events

from trainguard.detect.hang import HangConfig
from trainguard.monitors.hang.monitor import HangMonitor

sys.path.insert(0, str(SCRIPTS))
from hang_harness import hang_events, run_job  # noqa: E402

pytestmark = pytest.mark.slow

HEALTHY = SCRIPTS / "healthy_phases.py"
SCALE = 0.6
# The first step and the all-rank evaluation at 12 s, as long as the DataLoader's phase (20 s x
# SCALE): still past the fast-verdict window. eval0 stays at SCALE: each of its halves (through
# model.module, then the unwrapped model) must outlast the window by itself.
OWN_SCALE = {"first": 0.4, "evalall": 0.4}


def test_hang_healthy_phases_never_detected(tmp_path: Path) -> None:
    # 0.6 (0.4) of the script's phase lengths: each still outlasts the fast-verdict window (10 s +
    # 3 x p99 step) by itself; the full lengths run in bench/hang.py (the suite has to stay near 20 minutes)
    args = ["--scale", str(SCALE), *(a for k, x in OWN_SCALE.items() for a in ("--phase-scale", f"{k}={x}"))]
    attempts, detected = run_job(tmp_path, HangMonitor(HangConfig()), 2, args, deadline_s=600.0, worker=HEALTHY)
    seen = [(e.kind, e.rank, e.message) for e in hang_events(tmp_path)]
    assert detected == [], seen
    assert len(attempts) == 1 and attempts[0].decision is None, seen
    a = attempts[0]
    assert a.returncodes == {0: 0, 1: 0}, {r: out[-10:] for r, out in a.output.items()}
    phases = {}
    for line in a.output[0]:
        if line.startswith("phase="):
            name, _, secs = line.split()
            phases[name.split("=")[1]] = float(secs.split("=")[1])
    # the phases really were long (far over the step threshold of about 5 s)
    assert phases["eval0"] >= 40 * SCALE and phases["evalall"] >= 30 * OWN_SCALE["evalall"], phases
    assert phases["loader"] >= 20 * SCALE, phases
    assert "save" in phases and any(line.startswith("done") for line in a.output[1])
    # a suspicion is a warning at most, and any suspicion was cleared when steps resumed
    suspected = [e for e in hang_events(tmp_path) if e.kind == "hang_suspected"]
    cleared = [e for e in hang_events(tmp_path) if e.kind == "hang_cleared"]
    assert len(cleared) == len(suspected), seen


FAST = HangConfig(period=0.5, detect_time=120.0, step_slack=3.0)


@pytest.mark.parametrize(
    ("fault", "kind", "progress"),
    [("cblock", "user", "idle"), ("savestop", "stopped", "stopped")],
)
def test_hang_fault_detected_with_culprit(tmp_path: Path, fault: str, kind: str, progress: str) -> None:
    args = ["--steps", "30", "--step-time-ms", "50", "--fault", fault, "--fault-rank", "1", "--fault-step", "10"]
    attempts, detected = run_job(tmp_path, HangMonitor(FAST), 2, args, deadline_s=150.0)
    assert len(attempts) == 2 and len(detected) == 1, [(e.kind, e.message) for e in hang_events(tmp_path)]
    ev = detected[0]
    assert ev.rank == 1 and ev.evidence["rule"] == "steps", ev.message
    assert ev.evidence["ranks"]["1"]["kind"] == kind and ev.evidence["progress"]["kind"] == progress, ev.message
    assert attempts[0].decision is not None and attempts[0].decision.rank == 1
    assert Path(ev.evidence["report"]).exists()
    second = attempts[1]
    assert second.decision is None and second.returncodes == {0: 0, 1: 0}


def test_hang_stopped_rank_detected_before_the_step_threshold(tmp_path: Path) -> None:
    """A SIGSTOP'd rank while its peer waits in the all-reduce is proof once it stayed
    stopped for the progress window; the step threshold (here over a minute: a slack of 90 s
    stands in for slow steps under load) is not waited for."""
    cfg = HangConfig(period=0.5, detect_time=300.0, step_slack=90.0)
    args = ["--steps", "30", "--step-time-ms", "50", "--fault", "stop", "--fault-rank", "1", "--fault-step", "10"]
    attempts, detected = run_job(tmp_path, HangMonitor(cfg), 2, args, deadline_s=60.0, max_attempts=1)
    seen = [(e.kind, e.message) for e in hang_events(tmp_path)]
    assert len(detected) == 1, seen
    ev = detected[0]
    assert ev.rank == 1 and ev.evidence["rule"] == "steps" and "while its peers wait" in ev.message, ev.message
    assert ev.evidence["progress"]["kind"] == "stopped", ev.message
    assert attempts[0].decision is not None and attempts[0].decision.rank == 1


def test_hang_hf_trainer_rank_frozen_after_save(jobs, tmp_path: Path) -> None:
    """A once-missed hang: a Trainer rank stopped just after its save is not 'saving a
    checkpoint': detected from the stopped state, named, restarted; the job resumes and ends."""
    run = tmp_path / "run"
    job = jobs("run", "--standalone", "--nproc-per-node", "2", "--max-restarts", "1", "--run-dir", run,
               "--hang-period", "0.5", SCRIPTS / "hf_trainer_job.py", "--steps", "30",
               "--stop-after-save", "10", "--out", tmp_path / "out")  # fmt: skip
    assert job.wait(timeout=400) == 0, job.output()[-4000:]
    hangs = events(run, "hang_detected")
    assert len(hangs) == 1, [e.message for e in hangs]
    ev = hangs[0]
    assert ev.rank == 1 and ev.evidence["ranks"]["1"]["kind"] == "stopped", ev.message
    assert "stopped" in ev.evidence["doing"] and ev.evidence["progress"]["kind"] == "stopped", ev.message
    assert events(run, "job_succeeded")


def test_hang_before_the_first_step_uses_the_learned_first_step_allowance(tmp_path: Path) -> None:
    """A restarted attempt whose rank hangs before its first step: judged once the first step
    takes longer than the allowance learned from the earlier attempt's first step (not the
    seed's 30 minutes)."""
    from hang_harness import run_attempt

    from trainguard.events import EventBus
    from trainguard.events.store import EventStore

    cfg = HangConfig(period=0.5, step_slack=3.0, first_step_floor=5.0)
    monitor = HangMonitor(cfg)
    store = EventStore(tmp_path)
    bus = EventBus(store, node="testnode")
    args = ["--steps", "10", "--step-time-ms", "50", "--fault", "sleep", "--fault-rank", "1", "--fault-step", "1",
            "--fault-attempt", "1"]  # fmt: skip
    try:
        healthy = run_attempt(monitor, tmp_path, bus, 2, 0, args)
        assert healthy.decision is None and healthy.returncodes == {0: 0, 1: 0}
        hung = run_attempt(monitor, tmp_path, bus, 2, 1, args, deadline_s=150.0)
    finally:
        monitor.close()
        store.close()
    assert hung.decision is not None and hung.decision.rank == 1, [e.message for e in hang_events(tmp_path)]
    assert not any(hung.steps.values())  # no step at all in the hung attempt
    (ev,) = [e for e in hang_events(tmp_path) if e.kind == "hang_detected"]
    assert ev.evidence["progress"]["kind"] == "idle" and ev.evidence["rule"] == "steps", ev.message
