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


@pytest.mark.slow
def test_hf_trainer_spans_and_resume_after_sigkill(jobs, tmp_path):
    pytest.importorskip("transformers")
    run = tmp_path / "run"
    job = jobs("run", "--standalone", "--nproc-per-node", "2", "--max-restarts", "1", "--run-dir", run,
               SCRIPTS / "hf_trainer_job.py", "--steps", "30", "--kill-step", "17", "--out", tmp_path / "hf")  # fmt: skip
    assert job.wait() == 0, job.output()[-4000:]
    (failed,) = events(run, "worker_failed")
    assert (failed.rank, failed.evidence["signal"]) == (1, "SIGKILL")
    loaded = events(run, "checkpoint_loaded")
    assert loaded and all("resumed from step 15" in e.message for e in loaded), [e.message for e in loaded]
    for rank in (0, 1):
        log = rank_log(run, 1, rank).read_text()
        assert "train begins at step 15" in log and "train ends at step 30" in log, log[-3000:]
        records = profiling_records(run, rank)
        kinds = Counter((r["kind"], r["name"]) for r in records)
        # Saves at steps 10 (attempt 0), 20 and 30; evaluations likewise: one span each. The
        # Trainer's torch.save calls (optimizer, scheduler, RNG) are inside the save's span.
        assert kinds[("User", "Evaluation")] == 3 and kinds[("SaveCheckpoint", "SaveCheckpoint")] == 3, kinds
        assert kinds[("Step", "Step")] >= 15 + 15, "zero-code Step spans from the Trainer's optimizer"
        assert kinds[("FP", "FP")] >= 30
