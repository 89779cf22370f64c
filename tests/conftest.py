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
    """Start `trainguard ...` jobs; whatever they leave running is killed at teardown.

    The test's jobs keep their snapshots in a tmpfs dir of the test's own (``start.shm_root``,
    removed at teardown): an agent that a test SIGKILLs leaves its snapshots for the next agent on
    the node to rescue, and in the shared /dev/shm that would be an agent of a later test."""
    started: list[Job] = []
    root = Path("/dev/shm") / f"tg-ckpt-test-{uuid.uuid4().hex[:8]}"
    root.mkdir()

    def start(*args, env=None, name=None, prefix=None) -> Job:
        env = {"TRAINGUARD_CKPT_SHM_ROOT": str(root), **(env or {})}
        job = Job(list(args), tmp_path / f"{name or 'job'}-{len(started)}.out", env=env, prefix=prefix)
        started.append(job)
        return job

    start.shm_root = root
    yield start
    for job in started:
        job.kill()
    for p in processes_of(tmp_path):
        kill_tree(p.pid)
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def shm_root():
    """A private tmpfs directory for checkpoint snapshots (never the shared /dev/shm itself)."""
    root = Path("/dev/shm") / f"tg-ckpt-test-{uuid.uuid4().hex[:8]}"
    root.mkdir()
    yield root
    shutil.rmtree(root, ignore_errors=True)
