"""A real job under ``umask 022`` leaves nothing that group or others can read: not in its run dir
(event databases and their journals, logs, profiling files, status files), not in its checkpoint
dir, not in the shared memory it used. Checkpoints and logs hold the model and the job's output."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
from tgtest import DEADLINE

MLP = Path(__file__).resolve().parents[1] / "examples" / "train_mlp.py"
UMASK_022 = ["sh", "-c", 'umask 022 && exec "$@"', "sh"]


def _loose(top: Path) -> list[str]:
    """Every path under ``top`` (itself included) with a group or other permission bit."""
    found = [top]
    for root, dirs, files in os.walk(top):
        found += [Path(root) / n for n in dirs + files]
    out = []
    for p in found:
        try:
            mode = os.lstat(p).st_mode
        except FileNotFoundError:  # removed while we walked
            continue
        if stat.S_IMODE(mode) & 0o077:
            out.append(f"{stat.filemode(mode)} {p}")
    return out


@pytest.mark.slow
def test_a_real_job_under_umask_022_leaves_only_private_files(tmp_path, jobs):
    run_dir, ckpt_dir = tmp_path / "runs" / "demo", tmp_path / "ckpt"
    shm_root = jobs.shm_root
    os.chmod(shm_root, 0o700)  # the test's own root; what the job makes inside it is what is checked
    job = jobs("run", "--standalone", "--nproc-per-node", "2", "--quiet", "--run-dir", str(run_dir),
               "--ckpt-dir", str(ckpt_dir), "--ckpt-shm-dir", str(shm_root), str(MLP), "--steps", "12",
               "--step-time-ms", "20", "--ckpt-every", "3", "--ckpt", "trainguard", prefix=UMASK_022)
    assert job.wait(DEADLINE) == 0, job.output()
    assert (run_dir / "events").is_dir() and any((run_dir / "events").iterdir())
    assert any(ckpt_dir.iterdir()), "no checkpoint reached the disk"
    loose = _loose(tmp_path / "runs") + _loose(ckpt_dir) + _loose(shm_root)
    assert loose == [], "\n".join(loose)
