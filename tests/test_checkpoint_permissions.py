"""Checkpoints hold a model's weights: every file and directory trainguard makes for them is its
owner's only (0600 / 0700, whatever the umask). A snapshot directory in shared memory is rescued
only when it is this user's own, private and real (no links), and only into this job's own
checkpoint dir: another local user who plants one decides nothing."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

SAVER = textwrap.dedent("""
    import os, sys
    os.umask(0)  # the modes must not come from the umask
    import torch
    from trainguard import checkpoint as ckpt
    from trainguard.checkpoint import disk, persist
    ckpt_dir = disk.Path(sys.argv[1])
    for step in (1, 2, 3, 4):
        assert ckpt.save({"w": torch.full((256,), float(step)), "step": step}, step) is True
        ckpt.wait()
    ck = ckpt._checkpointer()
    persist.write_report(ck.shm_dir, "checkpoint_note", "x", "info", 0, {})  # the worker-report path
    disk.quarantine(ckpt_dir, 0, 2)
    ckpt.export_dcp(sys.argv[2], ckpt_dir, 4)
    print("SHM", ck.shm_dir, flush=True)
    sys.stdin.readline()  # the test looks at the shm dir while it exists
""")


def _loose(paths: list[Path]) -> list[str]:
    """The paths with a group or other permission bit, with their modes."""
    out = []
    for p in paths:
        mode = os.lstat(p).st_mode
        if stat.S_IMODE(mode) & 0o077:
            out.append(f"{p} {stat.filemode(mode)}")
    return out


def _tree(top: Path) -> list[Path]:
    found = [top]
    for root, dirs, files in os.walk(top):
        found += [Path(root) / n for n in dirs + files]
    return found


def test_checkpoint_files_and_dirs_are_private_whatever_the_umask(tmp_path, shm_root):
    ckpt, export = tmp_path / "job" / "ckpt", tmp_path / "export"
    env = {**os.environ, "TRAINGUARD_CKPT_DIR": str(ckpt), "TRAINGUARD_CKPT_SHM_ROOT": str(shm_root),
           "TRAINGUARD_CKPT_OVERLAP": "0"}
    for k in ("TRAINGUARD_CKPT_SHM_DIR", "TRAINGUARD_RUN_DIR"):  # local mode: this process persists
        env.pop(k, None)
    proc = subprocess.Popen([sys.executable, "-c", SAVER, str(ckpt), str(export)], env=env, text=True,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        line = proc.stdout.readline()  # the script ends (EOF) if it fails
        assert line.startswith("SHM "), proc.communicate(timeout=120)[1]
        shm = Path(line.split(" ", 1)[1].strip())
        in_shm = _tree(shm)
        assert any(p.name.startswith("rank-") for p in in_shm) and (shm / "reports").is_dir()
        assert _loose(in_shm) == []
        on_disk = _tree(tmp_path / "job") + _tree(export)
        assert {p.name for p in on_disk} >= {"rank-00000.bin", "rank-00000.json", "quarantine"}
        assert _loose(on_disk) == []
    finally:
        out, err = proc.communicate(input="\n", timeout=120)
    assert proc.returncode == 0, err
