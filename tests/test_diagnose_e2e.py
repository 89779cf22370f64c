"""End to end: `trainguard run` diagnoses a real worker failure from its own logs."""

from __future__ import annotations

import json

import pytest
from tgtest import EXAMPLE

from trainguard.cli import main as cli_main
from trainguard.events import EventStore


@pytest.mark.slow
def test_run_records_a_diagnosis_event_and_the_cli_agrees(jobs, tmp_path, capsys):
    run_dir = tmp_path / "run"
    job = jobs("run", "--standalone", "--nproc-per-node", "2", "--max-restarts", "0", "--run-dir", run_dir,
               EXAMPLE, "--steps", "12", "--fail-rank", "1", "--fail-step", "4", "--fail-mode", "zerodiv")  # fmt: skip
    assert job.wait() != 0
    store = EventStore(run_dir, readonly=True)
    try:
        (ev,) = store.query(kinds=["diagnosis"])
    finally:
        store.close()
    d = ev.evidence
    assert d["category"] == "python_exception" and ev.rank == 1
    assert "ZeroDivisionError: division by zero" in d["first_failure"]["line"]
    assert d["evidence"] and d["fix"]
    # the same logs, offline
    assert cli_main(["diagnose", str(run_dir / "logs" / "attempt-0"), "--json"]) == 0
    offline = json.loads(capsys.readouterr().out)
    assert offline["category"] == "python_exception" and offline["first_failure"]["rank"] == 1
