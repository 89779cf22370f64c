"""Every line a worker writes reaches its rank log and the console, including the one line of a
process that is not Python and exits at once (a lost line is lost data)."""

from __future__ import annotations

import re

import pytest
from tgtest import rank_log

pytestmark = pytest.mark.slow

NPROC = 100


def test_no_line_of_100_short_lived_workers_is_lost(jobs, tmp_path):
    """100 `--no-python` bash workers that each write one line to stdout and one to stderr and exit:
    their pipes were read before the agent knew their ranks, and those lines used to go to the
    agent log only (0-8 of 16 ranks per run lost from the console and the rank logs)."""
    run = tmp_path / "run"
    job = jobs("run", "--standalone", "--nproc-per-node", NPROC, "--precheck", "off", "--run-dir", run,
               "--no-python", "bash", "-c", "echo out-$RANK-of-$WORLD_SIZE; echo err-$RANK >&2")  # fmt: skip
    assert job.wait() == 0, job.output()
    console = job.output()
    for rank in range(NPROC):
        assert console.count(f"[rank{rank}]: out-{rank}-of-{NPROC}\n") == 1, (rank, console)
        assert console.count(f"[rank{rank}]: err-{rank}\n") == 1, (rank, console)
        lines = [re.sub(r"^\S+ ", "", ln) for ln in rank_log(run, 0, rank).read_text().splitlines()]
        assert sorted(lines) == sorted([f"[rank{rank}]: out-{rank}-of-{NPROC}", f"[rank{rank}]: err-{rank}"]), lines
