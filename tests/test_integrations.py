"""trainguard's callbacks with the real frameworks (CPU, gloo, tiny models, no downloads), under
`trainguard run` with 2 workers: evaluation and save phases as spans in the profiling records,
Step spans zero-code, and a resume from trainguard.checkpoint after a SIGKILL."""

from __future__ import annotations

import json
import sys
from collections import Counter
from pathlib import Path

import pytest
from tgtest import SCRIPTS, events, rank_log


def profiling_records(run: Path, rank: int) -> list[dict]:
    d = run / "profiling" / str(rank)
    return [json.loads(x) for f in sorted(d.iterdir()) if f.name.isdigit() for x in f.read_text().splitlines()]


def test_callbacks_import_without_the_frameworks():
    """The modules import nothing heavy; using a callback is what needs the framework."""
    import subprocess

    code = ("import sys, trainguard.integrations.hf, trainguard.integrations.lightning;"
            "print('transformers' in sys.modules, 'lightning' in sys.modules, 'torch' in sys.modules)")  # fmt: skip
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.split() == ["False", "False", "False"], out.stderr


def run_killed_and_resumed(jobs, tmp_path: Path, script: str) -> tuple[dict[int, list[dict]], Path]:
    """Run ``script`` (30 steps; rank 1 SIGKILLs itself at step 17 of the first attempt) on 2
    workers; check it resumed from the snapshot of step 15 and finished; return the records."""
    run = tmp_path / "run"
    job = jobs("run", "--standalone", "--nproc-per-node", "2", "--max-restarts", "1", "--run-dir", run,
               SCRIPTS / script, "--steps", "30", "--kill-step", "17", "--out", tmp_path / "out")  # fmt: skip
    assert job.wait() == 0, job.output()[-4000:]
    (failed,) = events(run, "worker_failed")
    assert (failed.rank, failed.evidence["signal"]) == (1, "SIGKILL")
    loaded = events(run, "checkpoint_loaded")
    assert loaded and all("resumed from step 15" in e.message for e in loaded), [e.message for e in loaded]
    records = {}
    for rank in (0, 1):
        log = rank_log(run, 1, rank).read_text()
        assert "train begins at step 15" in log and "train ends at step 30" in log, log[-3000:]
        records[rank] = profiling_records(run, rank)
    return records, run


def profiling_story(run: Path, records: dict[int, list[dict]]) -> str:
    """What to read when a phase count is off: each rank's Step spans per attempt (the step numbers
    restart at 1 in each attempt's ring) and the agent's profiling lines."""
    lines = []
    for rank, recs in records.items():
        steps = [r["step"] for r in recs if r["kind"] == "Step"]
        lines.append(f"rank {rank}: {len(recs)} records, Step spans at steps {steps}")
    for log in sorted(run.glob("agent-*.log")):
        lines += [x for x in log.read_text(errors="replace").splitlines() if "profil" in x or "ring" in x]
    lines += [f"{e.kind}: {e.message}" for e in events(run) if "profiling" in e.kind]
    return "\n".join(lines[-60:])


def check_phases(records: list[dict], story: str = "") -> None:
    """Evaluations and saves at steps 10 (first attempt), 20 and 30: one span each (the framework's
    torch.save calls are inside its save's span, not counted again); an evaluation spans its loop
    (2 batches); Step spans zero-code from the framework's optimizer step. The callback's own
    trainguard.checkpoint.save every 5 steps (5, 10, 15, then 20, 25, 30 after the resume) is a
    SaveCheckpoint span of its own too: 3 framework saves + 6 snapshots."""
    kinds = Counter((r["kind"], r["name"]) for r in records)
    assert kinds[("User", "Evaluation")] == 3 and kinds[("SaveCheckpoint", "SaveCheckpoint")] == 3 + 6, (kinds, story)
    for ev in (r for r in records if r["name"] == "Evaluation"):
        inside = [r for r in records if r["kind"] == "DataLoader" and ev["start_ns"] <= r["start_ns"] <= ev["end_ns"]]
        assert len(inside) == 2, (ev, inside)
    assert kinds[("Step", "Step")] >= 15 + 15


@pytest.mark.slow
def test_hf_trainer_spans_and_resume_after_sigkill(jobs, tmp_path):
    ranks, run = run_killed_and_resumed(jobs, tmp_path, "hf_trainer_job.py")
    for records in ranks.values():
        check_phases(records, profiling_story(run, ranks))
        assert Counter(r["kind"] for r in records)["FP"] >= 30


@pytest.mark.slow
def test_lightning_spans_and_resume_after_sigkill(jobs, tmp_path):
    ranks, run = run_killed_and_resumed(jobs, tmp_path, "lightning_job.py")
    for records in ranks.values():
        check_phases(records, profiling_story(run, ranks))
    assert sorted(p.name for p in (tmp_path / "out").glob("*.ckpt"))[-1].endswith("step=30.ckpt")
