"""Checkpoints hold a model's weights: every file and directory trainguard makes for them is its
owner's only (0600 / 0700, whatever the umask). A snapshot directory in shared memory is rescued
only when it is this user's own, private and real (no links), and only into this job's own
checkpoint dir: another local user who plants one decides nothing."""

from __future__ import annotations

import grp
import json
import logging
import os
import pwd
import shutil
import stat
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path

import pytest
import torch

from trainguard.checkpoint import disk
from trainguard.checkpoint.client import Checkpointer
from trainguard.checkpoint.persist import Persister
from trainguard.checkpoint.shm import DIR_PREFIX, make_shm_dir, release_shm_dir
from trainguard.monitors.checkpoint import CheckpointMonitor

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


# --- planted snapshot directories ------------------------------------------------------------------
def _need(why: str) -> None:
    if os.environ.get("CI"):
        pytest.fail(why)  # CI runs as root with useradd: a skip there would hide the test
    pytest.skip(why)


@pytest.fixture
def other_user():
    """A second local user made for the test (removed after), as a planter on the node would be."""
    if os.geteuid() != 0:
        _need("needs root to create a second local user")
    missing = [t for t in ("useradd", "userdel", "setpriv") if shutil.which(t) is None]
    if missing:
        _need(f"needs {', '.join(missing)} to create and act as a second local user")
    name = f"tgplant{uuid.uuid4().hex[:8]}"
    subprocess.run(["useradd", "-M", "-U", "-s", "/usr/sbin/nologin", name], check=True, capture_output=True)
    try:
        yield pwd.getpwnam(name)
    finally:
        subprocess.run(["userdel", name], capture_output=True)
        if _group_exists(name):
            subprocess.run(["groupdel", name], capture_output=True)


def _group_exists(name: str) -> bool:
    try:
        grp.getgrnam(name)
    except KeyError:
        return False
    return True


def _dead_pid() -> int:
    """A pid no process can have (above pid_max): the planted directory's owner looks dead."""
    return int(Path("/proc/sys/kernel/pid_max").read_text()) + 1


def _our_steps(ckpt: Path, shm_root: Path, steps: list[int]) -> None:
    shm = make_shm_dir(shm_root)
    worker = Checkpointer(shm, ckpt, 0, 1)
    persister = Persister(shm, ckpt, 3, lambda *a, **k: None, idle_priority=False)
    try:
        for step in steps:
            assert worker.save({"w": torch.full((64,), float(step)), "step": step}, step, overlap=False)
            worker.wait()
            persister.run_pass()
    finally:
        worker.close()
        persister.stop(flush=False)
        release_shm_dir(shm)


def _stage_plant(stage: Path, info: dict) -> None:
    """What a planter puts in its directory: real slots holding its own weights (step 99) and an
    owner.json naming where they should go."""
    stage.mkdir()
    worker = Checkpointer(stage, stage / "unused", 0, 1, nslots=2)
    for step in (98, 99):
        assert worker.save({"w": torch.full((64,), -7.0), "step": step}, step, overlap=False)
    worker.wait()
    worker.close()
    (stage / "owner.json").write_text(json.dumps(info))


def _contents(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir())}


def _start_as_agent(ckpt: Path, shm_root: Path, run: Path) -> None:
    mon = CheckpointMonitor(ckpt_dir=ckpt, shm_root=shm_root)
    try:
        mon.worker_env(run)  # makes the agent's shm dir: stale ones are rescued or refused first
    finally:
        mon.close()


def _start_local(ckpt: Path, shm_root: Path, run: Path) -> str:
    """A training process without an agent (local mode) doing its first save; returns its stderr."""
    env = {**os.environ, "TRAINGUARD_CKPT_DIR": str(ckpt), "TRAINGUARD_CKPT_SHM_ROOT": str(shm_root),
           "TRAINGUARD_CKPT_OVERLAP": "0"}
    for k in ("TRAINGUARD_CKPT_SHM_DIR", "TRAINGUARD_RUN_DIR"):
        env.pop(k, None)
    code = "import torch; from trainguard import checkpoint as c; print(c.load_latest()['step'])"
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300, cwd=run)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "3"  # resumed from our own step, not the planted one
    return res.stderr


def _refusals(text: str, plant: Path) -> list[str]:
    return [ln for ln in text.splitlines() if "refused to rescue" in ln and str(plant) in ln]


@pytest.mark.parametrize("who", ["agent", "local"])
def test_a_snapshot_dir_planted_by_another_user_is_refused_and_left_alone(tmp_path, shm_root, other_user, who, caplog):
    """Another local user plants a dead-looking ``trainguard-ckpt-*`` dir whose owner.json names our
    checkpoint dir, keep 1 and a run dir. Starting (as root) neither persists the planted weights
    into our checkpoint dir, nor prunes it, nor creates an event DB where the plant says, nor
    removes the plant: one warning line names it and its owner."""
    ckpt, run, victim_run = tmp_path / "ckpt", tmp_path / "run", tmp_path / "victim-run"
    run.mkdir()
    victim_run.mkdir()
    _our_steps(ckpt, shm_root, [1, 2, 3])
    stage = shm_root / "stage"
    _stage_plant(stage, {"ckpt_dir": str(ckpt.resolve()), "keep": 1, "run_dir": str(victim_run)})
    for p in [stage, *stage.iterdir()]:
        p.chmod(0o755 if p.is_dir() else 0o644)  # readable by the planter, who copies it
    shm_root.chmod(0o1777)  # as /dev/shm: anyone may create a directory there
    plant = shm_root / f"{DIR_PREFIX}{_dead_pid()}-{uuid.uuid4().hex[:8]}"
    as_planter = ["setpriv", f"--reuid={other_user.pw_uid}", f"--regid={other_user.pw_gid}", "--clear-groups", "--"]
    subprocess.run([*as_planter, "sh", "-c", f'mkdir -m 700 "{plant}" && cp "{stage}"/* "{plant}"/'],
                   check=True, capture_output=True, text=True)
    assert os.stat(plant).st_uid == other_user.pw_uid
    planted = _contents(plant)

    if who == "agent":
        with caplog.at_level(logging.WARNING):
            _start_as_agent(ckpt, shm_root, run)
        said = "\n".join(r.getMessage() for r in caplog.records)
    else:
        said = _start_local(ckpt, shm_root, run)

    assert disk.list_steps(ckpt, 0) == [3, 2, 1]  # nothing persisted from the plant, nothing pruned
    assert list(victim_run.iterdir()) == []  # no event DB where the plant pointed
    assert _contents(plant) == planted and os.stat(plant).st_uid == other_user.pw_uid  # untouched
    lines = _refusals(said, plant)
    assert len(lines) == 1, said
    assert f"owned by uid {other_user.pw_uid}, not us" in lines[0]


def _own_orphan(shm_root: Path, info: dict) -> Path:
    """A dead process's snapshot dir of this user's, as make_shm_dir leaves it (minus the lock)."""
    d = shm_root / f"{DIR_PREFIX}{_dead_pid()}-{uuid.uuid4().hex[:8]}"
    _stage_plant(d, info)
    d.chmod(0o700)
    return d


def test_an_orphan_of_ours_that_names_another_checkpoint_dir_is_left_for_its_own_job(tmp_path, shm_root, caplog):
    """Never written where owner.json says (nor pruned with its keep): the other dir and ours stay
    as they were, the orphan stays for the job whose checkpoint dir it names, one warning says so."""
    ckpt, elsewhere, run = tmp_path / "ckpt", tmp_path / "elsewhere", tmp_path / "run"
    run.mkdir()
    _our_steps(ckpt, shm_root, [1, 2, 3])
    _our_steps(elsewhere, shm_root, [5, 6])
    orphan = _own_orphan(shm_root, {"ckpt_dir": str(elsewhere.resolve()), "keep": 1, "run_dir": str(run)})
    with caplog.at_level(logging.WARNING):
        _start_as_agent(ckpt, shm_root, run)
    assert disk.list_steps(ckpt, 0) == [3, 2, 1] and disk.list_steps(elsewhere, 0) == [6, 5]
    assert orphan.is_dir() and any(p.name.startswith("rank-") for p in orphan.iterdir())
    lines = _refusals("\n".join(r.getMessage() for r in caplog.records), orphan)
    assert len(lines) == 1 and str(elsewhere.resolve()) in lines[0], lines


@pytest.mark.parametrize("damage", ["dir is a symlink", "group-writable", "reports is a symlink"])
def test_a_snapshot_dir_that_is_not_private_and_real_is_never_followed(tmp_path, shm_root, damage, caplog):
    """A symlinked or group-writable orphan is refused and left as it is; a ``reports`` symlink in a
    real orphan of ours is not followed (the files it points at are neither read nor deleted),
    while its snapshots are rescued into our checkpoint dir."""
    ckpt, run, target = tmp_path / "ckpt", tmp_path / "run", tmp_path / "target"
    run.mkdir()
    _our_steps(ckpt, shm_root, [1, 2, 3])
    info = {"ckpt_dir": str(ckpt.resolve()), "keep": 1, "run_dir": str(run)}
    target.mkdir()
    victim = target / "0001-victim.json"
    victim.write_text(json.dumps({"kind": "checkpoint_x", "message": "read through a link"}))
    if damage == "dir is a symlink":
        real = _own_orphan(tmp_path, info)
        orphan = shm_root / f"{DIR_PREFIX}{_dead_pid()}-{uuid.uuid4().hex[:8]}"
        orphan.symlink_to(real, target_is_directory=True)
    else:
        orphan = _own_orphan(shm_root, info)
        if damage == "group-writable":
            orphan.chmod(0o770)
        else:
            (orphan / "reports").symlink_to(target, target_is_directory=True)
    with caplog.at_level(logging.WARNING):
        _start_as_agent(ckpt, shm_root, run)
    said = "\n".join(r.getMessage() for r in caplog.records)
    assert victim.exists() and "read through a link" not in said
    if damage == "reports is a symlink":
        assert disk.list_steps(ckpt, 0) == [99, 98, 3]  # rescued, with our keep (3), not its 1
        assert not os.path.lexists(orphan)
        return
    assert disk.list_steps(ckpt, 0) == [3, 2, 1]
    assert os.path.lexists(orphan)
    lines = _refusals(said, orphan)
    assert len(lines) == 1, said
    assert ("symlink" if damage == "dir is a symlink" else "writable by group or others") in lines[0]
