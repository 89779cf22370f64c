"""Shared memory failing under a running job is loud and loses nothing newer: the snapshot directory
removed (tmpwatch, systemd's RemoveIPC) and a tmpfs with room for one snapshot per rank (Kubernetes'
64 MB /dev/shm). Each is an error event and a console warning at the first failed save and every
``REPORT_EVERY`` after, each names its fallback, and the newest steps still reach the disk."""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from pathlib import Path

import pytest
import torch
from tgtest import DEADLINE, tmpfs, wait_for

from trainguard.checkpoint import disk, shmfault
from trainguard.checkpoint.client import Checkpointer
from trainguard.checkpoint.shm import DIR_PREFIX, make_shm_dir, release_shm_dir
from trainguard.events.store import read_all

MLP = Path(__file__).resolve().parents[1] / "examples" / "train_mlp.py"


def _shm_dirs(root: Path) -> list[Path]:
    return [p for p in root.iterdir() if p.name.startswith(DIR_PREFIX)] if root.is_dir() else []


def _rank_logs(run_dir: Path) -> str:
    return "".join(p.read_text(errors="replace") for p in sorted((run_dir / "logs").glob("attempt-*/rank-*.log")))


@pytest.mark.slow
def test_shm_dir_removed_under_a_running_job_is_recreated_reported_and_newer_steps_reach_disk(tmp_path, jobs):
    run_dir, ckpt_dir, steps = tmp_path / "run", tmp_path / "ckpt", 400
    job = jobs("run", "--standalone", "--nproc-per-node", "2", "--quiet", "--run-dir", str(run_dir),
               "--ckpt-dir", str(ckpt_dir), "--ckpt-shm-dir", str(jobs.shm_root), str(MLP), "--steps", str(steps),
               "--step-time-ms", "20", "--ckpt-every", "1", "--ckpt", "trainguard")
    wait_for(lambda: disk.list_steps(ckpt_dir, 0) if ckpt_dir.is_dir() else [], what="a first checkpoint on disk")
    [shm_dir] = _shm_dirs(jobs.shm_root)
    shutil.rmtree(shm_dir)  # what tmpwatch or systemd-logind's RemoveIPC do
    removed_at = max(disk.list_steps(ckpt_dir, 0))
    assert removed_at < steps, "the job ended before the directory was removed: give it more steps"
    assert job.wait(DEADLINE) == 0, job.output()
    lost = [e for e in read_all(run_dir) if e.kind == "checkpoint_shm_lost" and e.rank is not None]
    assert sorted(e.rank for e in lost) == [0, 1], [e.message for e in lost]
    assert all(e.severity.label == "error" and e.evidence["fallback"] == "recreated" for e in lost)
    assert "[checkpoint_shm_lost]" in job.output()  # the agent's console
    assert "was removed: new slots in the recreated (owner-only) directory" in _rank_logs(run_dir)  # each worker's console
    for rank in (0, 1):
        assert disk.list_steps(ckpt_dir, rank)[0] == steps  # nothing newer was lost


@pytest.fixture
def small_tmpfs():
    """A 64 MB tmpfs of the test's own (Kubernetes' default /dev/shm size), unmounted at the end."""
    mnt = Path(tempfile.mkdtemp(prefix="tg-ckpt-small-"))
    try:
        with tmpfs(mnt, "64m"):
            yield mnt
    finally:
        mnt.rmdir()


@pytest.mark.slow
def test_a_tmpfs_with_room_for_one_snapshot_per_rank_keeps_one_slot_and_says_so(tmp_path, jobs, small_tmpfs):
    # --hidden 2300: about 21 MB of weights per rank, so two ranks' first slots fit in 64 MB, no third
    run_dir, ckpt_dir, steps = tmp_path / "run", tmp_path / "ckpt", 16
    job = jobs("run", "--standalone", "--nproc-per-node", "2", "--quiet", "--run-dir", str(run_dir),
               "--ckpt-dir", str(ckpt_dir), "--ckpt-shm-dir", str(small_tmpfs), str(MLP), "--steps", str(steps),
               "--hidden", "2300", "--ckpt-every", "2", "--ckpt", "trainguard")
    assert job.wait(DEADLINE) == 0, job.output()
    full = [e for e in read_all(run_dir) if e.kind == "checkpoint_shm_full"]
    assert full, job.output()
    assert all(e.severity.label == "error" and e.evidence["fallback"] == "evicted_oldest" for e in full)
    assert len(full) == len({e.rank for e in full}), "one eviction per rank, reported once: no retry for ever"
    assert "[checkpoint_shm_full]" in job.output()
    assert "evicted this rank's oldest snapshot" in _rank_logs(run_dir)
    for rank in (0, 1):
        assert disk.list_steps(ckpt_dir, rank)[0] == steps
    assert _shm_dirs(small_tmpfs) == []  # the agent cleaned up


def test_shm_that_cannot_be_recreated_goes_to_disk_and_is_reported_every_tenth_save(tmp_path, shm_root, caplog):
    """The directory replaced by a symlink (nothing is written through it): every save goes straight
    to disk; the warning comes at the 1st, 11th and 21st failed save, not only once."""
    shm = make_shm_dir(shm_root)
    ckpt_dir = tmp_path / "ckpt"
    ck = Checkpointer(shm, ckpt_dir, rank=0, world=1)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    try:
        assert ck.save({"w": torch.zeros(64)}, 0)
        shutil.rmtree(shm)
        os.symlink(elsewhere, shm)
        with caplog.at_level(logging.WARNING, logger="trainguard.checkpoint.client"):
            for step in range(1, 26):
                assert ck.save({"w": torch.full((64,), float(step))}, step) is True
        said = [r.getMessage() for r in caplog.records if "written straight to" in r.getMessage()
                and r.getMessage().startswith("checkpoint: rank 0")]
        assert [m.split(" step ")[1].split(":")[0] for m in said] == ["1", "11", "21"]
        assert shmfault.REPORT_EVERY == 10
        assert list(elsewhere.iterdir()) == []  # no slot and no report through the link
        assert disk.list_steps(ckpt_dir, 0)[0] == 25
        meta, data = disk.read_checkpoint(ckpt_dir, 0, 25)
        assert meta["step"] == 25 and data.numel() == 64 * 4
        os.unlink(shm)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="trainguard.checkpoint.client"):
            assert ck.save({"w": torch.ones(64)}, 26)
        assert any("recreated (owner-only) directory" in r.getMessage() for r in caplog.records)
        assert shm.is_dir() and not shm.is_symlink() and (os.stat(shm).st_mode & 0o777) == 0o700
    finally:
        ck.close()
        if shm.is_symlink():
            shm.unlink()
        release_shm_dir(shm)
