from __future__ import annotations

import shutil
import sys
import uuid
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


@pytest.fixture
def shm_root():
    """A private tmpfs directory for checkpoint snapshots (never the shared /dev/shm itself)."""
    root = Path("/dev/shm") / f"tg-ckpt-test-{uuid.uuid4().hex[:8]}"
    root.mkdir()
    yield root
    shutil.rmtree(root, ignore_errors=True)
