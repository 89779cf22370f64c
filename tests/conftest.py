from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from tgtest import Job, kill_tree, processes_of  # noqa: E402


@pytest.fixture
def jobs(tmp_path):
    """Start `trainguard ...` jobs; whatever they leave running is killed at teardown."""
    started: list[Job] = []

    def start(*args, env=None, name=None, prefix=None) -> Job:
        job = Job(list(args), tmp_path / f"{name or 'job'}-{len(started)}.out", env=env, prefix=prefix)
        started.append(job)
        return job

    yield start
    for job in started:
        job.kill()
    for p in processes_of(tmp_path):
        kill_tree(p.pid)
