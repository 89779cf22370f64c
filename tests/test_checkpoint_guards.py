"""Checkpoint pruning never leaves the checkpoint dir, and never deletes the newest checkpoint
whatever ``TRAINGUARD_CKPT_KEEP`` says; bad settings are one warning, never an exception out of
``save()``."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from trainguard.checkpoint import disk
from trainguard.checkpoint.client import Checkpointer
from trainguard.checkpoint.persist import Persister
from trainguard.checkpoint.shm import make_shm_dir, release_shm_dir


def _persist_steps(ckpt_dir: Path, shm_root: Path, steps: list[int], keep: int) -> None:
    """Snapshots of ``steps`` taken by a real Checkpointer, each persisted (and pruned) by a real Persister."""
    shm = make_shm_dir(shm_root)
    persister = Persister(shm, ckpt_dir, keep, lambda *a, **k: None)
    w = Checkpointer(shm, ckpt_dir, 0, 1)
    try:
        for step in steps:
            assert w.save({"w": torch.full((64,), float(step)), "step": step}, step, overlap=False)
            persister.run_pass()
    finally:
        w.close()
        persister.stop(flush=False)
        release_shm_dir(shm)


def test_pruning_never_follows_a_symlinked_step_dir(tmp_path, shm_root):
    """A ``step-*`` link in the checkpoint dir pointing at another dir's checkpoint: pruning the
    job's old steps leaves the files behind the link alone."""
    elsewhere, ckpt = tmp_path / "elsewhere", tmp_path / "ckpt"
    _persist_steps(elsewhere, shm_root, [1], keep=3)
    outside = disk.step_dir(elsewhere, 1)
    victims = sorted(p.name for p in outside.iterdir())
    assert victims == ["rank-00000.bin", "rank-00000.json"]
    ckpt.mkdir()
    disk.step_dir(ckpt, 1).symlink_to(outside, target_is_directory=True)
    _persist_steps(ckpt, shm_root, [2, 3, 4], keep=2)
    assert sorted(p.name for p in outside.iterdir()) == victims  # nothing deleted through the link
    assert disk.step_dir(ckpt, 1).is_symlink()
    assert [s for s in disk.list_steps(ckpt, 0) if s > 1] == [4, 3]  # the job's own steps pruned as usual


def test_a_snapshot_is_never_written_through_a_planted_symlink(tmp_path, shm_root):
    """A ``step-*`` link, or a link at the temp name this process will write, planted in a shared
    checkpoint dir: the persist refuses that step (or writes around the link) and writes nothing
    outside; the other steps persist as usual."""
    elsewhere, ckpt = tmp_path / "elsewhere", tmp_path / "ckpt"
    elsewhere.mkdir()
    ckpt.mkdir()
    disk.step_dir(ckpt, 2).symlink_to(elsewhere, target_is_directory=True)
    bait = elsewhere / "bait"
    disk.step_dir(ckpt, 3).mkdir()
    tmp = disk.step_dir(ckpt, 3) / (disk.manifest_name(0) + f"{disk._TMP_MARK}{disk.socket.gethostname()}-{os.getpid()}")
    tmp.symlink_to(bait)
    _persist_steps(ckpt, shm_root, [1, 2, 3], keep=5)
    assert list(elsewhere.iterdir()) == []  # nothing reached through either link
    assert disk.list_steps(ckpt, 0) == [3, 1]  # step 2 refused; step 3 written beside the planted name
    assert disk.verify_checkpoint(ckpt, 0, 3)["step"] == 3


@pytest.mark.parametrize("keep", [0, 1, -1])
def test_prune_keeps_the_newest_whatever_keep_says(tmp_path, shm_root, keep):
    ckpt = tmp_path / "ckpt"
    _persist_steps(ckpt, shm_root, [1, 2, 3], keep=keep)
    assert disk.list_steps(ckpt, 0)[:1] == [3]


SCRIPT = textwrap.dedent("""
    import torch
    from trainguard import checkpoint as ckpt
    from trainguard.checkpoint import disk
    for step in (1, 2, 3, 4):
        assert ckpt.save({"w": torch.full((64,), float(step)), "step": step}, step) is True
        ckpt.wait()  # on disk (and pruned) before the next
    print("steps", disk.list_steps(disk.Path("CKPT"), 0))
""")


def _local_mode(tmp_path: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    ckpt = tmp_path / "ckpt"
    env = {**os.environ, "TRAINGUARD_CKPT_DIR": str(ckpt), "TRAINGUARD_CKPT_OVERLAP": "0", **env}
    for k in ("TRAINGUARD_CKPT_SHM_DIR", "TRAINGUARD_RUN_DIR"):  # local mode: no agent
        env.pop(k, None)
    return subprocess.run([sys.executable, "-c", SCRIPT.replace("CKPT", str(ckpt))], env=env, capture_output=True,
                          text=True, timeout=300)  # fmt: skip


@pytest.mark.parametrize("value", ["0", "-1", "abc", ""])
def test_a_bad_keep_setting_warns_once_and_keeps_the_default(tmp_path, shm_root, value):
    res = _local_mode(tmp_path, {"TRAINGUARD_CKPT_KEEP": value, "TRAINGUARD_CKPT_SHM_ROOT": str(shm_root)})
    assert res.returncode == 0, res.stderr
    assert "steps [4, 3, 2]" in res.stdout  # the default 3, newest first
    warnings = [ln for ln in res.stderr.splitlines() if "TRAINGUARD_CKPT_KEEP" in ln]
    assert len(warnings) == 1 and "Traceback" not in res.stderr, res.stderr


def test_a_missing_shm_root_warns_once_and_snapshots_go_to_the_default(tmp_path):
    missing = tmp_path / "no-such-tmpfs"
    res = _local_mode(tmp_path, {"TRAINGUARD_CKPT_KEEP": "2", "TRAINGUARD_CKPT_SHM_ROOT": str(missing)})
    assert res.returncode == 0, res.stderr
    assert "steps [4, 3]" in res.stdout
    warnings = [ln for ln in res.stderr.splitlines() if "TRAINGUARD_CKPT_SHM_ROOT" in ln]
    assert len(warnings) == 1 and "Traceback" not in res.stderr, res.stderr
    assert not missing.exists()  # never created behind the user's back


@pytest.mark.parametrize("step, error, words", [
    (float("nan"), TypeError, "integer"),
    (1.5, TypeError, "integer"),
    (2.0, TypeError, "integer"),
    (True, TypeError, "integer"),
    ("3", TypeError, "integer"),
    (None, TypeError, "integer"),
    (-1, ValueError, "from 0"),
    (1 << 62, ValueError, "from 0"),
])  # fmt: skip
def test_save_refuses_a_step_that_is_not_a_non_negative_integer(tmp_path, shm_root, step, error, words):
    """One clear error naming the step, and nothing taken: no slot written, no save counted."""
    shm = make_shm_dir(shm_root)
    w = Checkpointer(shm, tmp_path / "ckpt", 0, 1)
    try:
        with pytest.raises(error, match=words) as exc:
            w.save({"w": torch.zeros(4)}, step, overlap=False)
        assert "checkpoint step" in str(exc.value)
        assert w.saves == 0 and not any(p.name.startswith("rank-") for p in shm.iterdir())
        assert w.save({"w": torch.zeros(4)}, 0, overlap=False)  # a good step still saves
    finally:
        w.close()
        release_shm_dir(shm)


def test_module_save_refuses_a_bad_step_even_without_shared_memory(monkeypatch):
    from trainguard import checkpoint as ckpt

    monkeypatch.setattr(ckpt, "_unavailable", True)  # snapshots off: still the caller's bug, said so
    with pytest.raises(TypeError, match="checkpoint step must be an integer"):
        ckpt.save({}, float("nan"))
    assert ckpt.save({}, 3) is False
