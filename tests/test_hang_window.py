"""Busy work past --hang-detect-time is never killed; the same shapes made dead are found, with the
right culprit, in seconds (a proof) or at the window (a spin). Real gloo jobs (CPU) through the
hang monitor, a short window (20 s) and work that outlasts it (28 s): a part of the window matrix
(tests/scripts/window_patterns.py) that bench/hang.py --matrix window runs whole."""

from __future__ import annotations

import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from tgtest import SCRIPTS

from trainguard.detect.hang import HangConfig
from trainguard.monitors.hang.monitor import HangMonitor

sys.path.insert(0, str(SCRIPTS))
from hang_harness import hang_events, run_job  # noqa: E402

pytestmark = pytest.mark.slow

WINDOW = SCRIPTS / "window_patterns.py"
CFG = HangConfig(detect_time=20.0)  # production settings but the window
WORK_S = 28.0
HEALTHY = ("eval_cpu", "broadcast_pickle", "loader_decode")
FAULTS = {"thread_deadlock": 0, "pipe_cycle": 1, "loader_fork_lock": 0, "spin": 0}


def _run(tmp: Path, pattern: str):
    run = tmp / pattern
    run.mkdir()
    attempts, detected = run_job(run, HangMonitor(CFG), 2, ["--pattern", pattern, "--wait-s", str(WORK_S)],
                                 deadline_s=300.0, max_attempts=1, worker=WINDOW)  # fmt: skip
    return attempts[0], detected, hang_events(run)


def test_window_matrix_part(tmp_path: Path) -> None:
    names = [*HEALTHY, *FAULTS]
    with ThreadPoolExecutor(max_workers=2) as pool:
        results = dict(zip(names, pool.map(lambda n: _run(tmp_path, n), names), strict=True))
    for name in HEALTHY:
        a, detected, seen = results[name]
        notes = [(e.kind, e.message[:400]) for e in seen]
        assert detected == [] and a.decision is None, (name, notes)
        assert all(any(ln.startswith("done") for ln in out) for out in a.output.values()), (name, notes)
        # past the window it is a named suspicion, with what the rank does
        window = [e for e in seen if e.kind == "hang_suspected" and e.evidence.get("rule") == "window"]
        assert window and "--hang-detect-time" in window[0].message, (name, notes)
    for name, culprit in FAULTS.items():
        a, detected, seen = results[name]
        notes = [(e.kind, e.message[:400]) for e in seen]
        assert a.decision is not None and a.decision.rank == culprit, (name, notes)
        assert len(detected) == 1 and detected[0].rank == culprit, (name, notes)
        if name == "spin":  # only the window judges a spin: no I/O, flat CPU, one frame
            assert detected[0].evidence["rule"] == "detect-time" and "no rank progressing" in detected[0].message
        else:  # a proof, long before the window
            assert detected[0].evidence["rule"] == "steps" and a.decided_at - a.fault_time() < CFG.detect_time, notes
    proofs = {n: results[n][1][0].evidence["wait"]["proof"] for n in ("thread_deadlock", "pipe_cycle")}
    assert "lock-order deadlock" in proofs["thread_deadlock"], proofs
    assert "wait-for cycle" in proofs["pipe_cycle"], proofs
    assert "process-private locks" in results["loader_fork_lock"][1][0].message
