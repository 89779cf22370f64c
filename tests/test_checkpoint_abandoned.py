"""After a restart a rank still holds its snapshots from the attempt that died, steps beyond the
one the job resumed from among them (rank 0 was a save ahead of rank 1 when it died). Those are an
abandoned timeline: once rank 1 has saved that step again in the new attempt, a second restart would
agree on it, and rank 0 would load the dead attempt's state beside rank 1's new one. A rank that
resumes from step S drops its own snapshots of later steps (memory slots, files moved to
CKPT_DIR/abandoned/), and of two copies of one step the newer save wins.

Real Checkpointers over a real tmpfs directory and checkpoint dir; the agreed loads are real gloo
ranks (tests/scripts/checkpoint_resume_save.py); the disk copies are written by the agent's Persister."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch
from tgtest import SCRIPTS, free_port, kill_tree

from trainguard.checkpoint import disk
from trainguard.checkpoint.client import Checkpointer
from trainguard.checkpoint.persist import Persister
from trainguard.checkpoint.shm import make_shm_dir, read_header, release_shm_dir, slot_files

RESUME = SCRIPTS / "checkpoint_resume_save.py"
NSLOTS = 3


def state(step: int, value: float) -> dict:
    return {"w": torch.full((256,), value), "step": step}


def held(shm: Path, rank: int) -> set[int]:
    return {h.step for path, r in slot_files(shm) if r == rank and (h := read_header(path)) is not None and h.complete}


def dead_attempt(shm: Path, ckpt: Path) -> None:
    """Both ranks saved step 1; rank 0 also saved step 2 (weights 2.0), then the attempt died."""
    ranks = [Checkpointer(shm, ckpt, r, 2, nslots=NSLOTS) for r in (0, 1)]
    try:
        for ck in ranks:
            assert ck.save(state(1, 1.0), 1, overlap=False)
        assert ranks[0].save(state(2, 2.0), 2, overlap=False)
    finally:
        for ck in ranks:
            ck.close()


def attempt(shm: Path, ckpt: Path, saves: dict[int, tuple[int, float]] | None = None) -> list[dict]:
    """A restarted attempt of two gloo ranks: each loads, then saves what ``saves`` gives it."""
    port = str(free_port())
    procs = []
    try:
        for rank in (0, 1):
            env = dict(os.environ, RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=port,
                       OMP_NUM_THREADS="1", SHM_DIR=str(shm), CKPT_DIR=str(ckpt), NSLOTS=str(NSLOTS))
            if saves and rank in saves:
                env.update(SAVE_STEP=str(saves[rank][0]), VALUE=str(saves[rank][1]))
            procs.append(subprocess.Popen([sys.executable, str(RESUME)], env=env, stdout=subprocess.PIPE,
                                          stderr=subprocess.STDOUT, text=True, start_new_session=True))
        outs = [p.communicate(timeout=240)[0] for p in procs]
    finally:
        for p in procs:
            kill_tree(p.pid)
    for p, out in zip(procs, outs, strict=True):
        assert p.returncode == 0, out
    return [json.loads(out.strip().splitlines()[-1])["loaded"] for out in outs]


def persist_all(shm: Path, ckpt: Path) -> None:
    """The agent at a breakpoint: every slot of every rank to disk."""
    persister = Persister(shm, ckpt, 3, lambda *a, **k: None, idle_priority=False)
    try:
        persister.run_pass(every_slot=True, trigger="breakpoint")
    finally:
        persister.stop(flush=False)


def assert_same_state(loaded: list[dict]) -> None:
    assert loaded[0] is not None and loaded[1] is not None, loaded
    assert loaded[0] == loaded[1], f"rank 0 loaded {loaded[0]}, rank 1 {loaded[1]}: different states"


def test_a_rank_does_not_resume_its_dead_attempts_snapshot_beside_the_other_ranks_new_one(tmp_path, shm_root):
    """In memory: rank 0 holds steps 1 and 2 (dead attempt), rank 1 step 1; both resume from 1; in
    the new attempt rank 1 saves step 2 anew (200.0) and rank 0 dies before its save. The next
    restart agreed on 2 and rank 0 loaded its stale 2.0 beside rank 1's 200.0."""
    shm = make_shm_dir(shm_root)
    ckpt = tmp_path / "ckpt"
    try:
        dead_attempt(shm, ckpt)
        assert held(shm, 0) == {1, 2}
        first = attempt(shm, ckpt, saves={1: (2, 200.0)})
        assert [x["step"] for x in first] == [1, 1], first
        assert held(shm, 0) == {1}, f"rank 0 still holds {sorted(held(shm, 0))} after resuming from 1"
        assert_same_state(attempt(shm, ckpt))
    finally:
        release_shm_dir(shm)


def test_a_rank_does_not_resume_its_dead_attempts_checkpoint_on_disk(tmp_path, shm_root):
    """The same on disk: the agent persisted every slot at the breakpoint, and each attempt runs
    on fresh shared memory (a replaced node): rank 0's file of step 2 is from the dead attempt."""
    ckpt = tmp_path / "ckpt"
    shms = [make_shm_dir(shm_root) for _ in range(3)]
    try:
        dead_attempt(shms[0], ckpt)
        persist_all(shms[0], ckpt)
        assert disk.list_steps(ckpt, 0) == [2, 1]
        first = attempt(shms[1], ckpt, saves={1: (2, 200.0)})
        assert [x["step"] for x in first] == [1, 1], first
        persist_all(shms[1], ckpt)
        assert disk.list_steps(ckpt, 0) == [1]
        assert list(ckpt.glob(f"{disk.ABANDONED}/step-0000000002.*/rank-00000.json"))
        assert_same_state(attempt(shms[2], ckpt))
    finally:
        for shm in shms:
            release_shm_dir(shm)


def test_of_two_copies_of_one_step_in_memory_the_newer_save_is_loaded(shm_root, tmp_path):
    """Slot 0 holds an older save of step 2, slot 2 a newer one (the step was saved again): the
    newer copy is the state to resume, whichever slot comes first by name."""
    shm = make_shm_dir(shm_root)
    ck = Checkpointer(shm, tmp_path / "ckpt", 0, 1, nslots=NSLOTS)
    try:
        assert ck.save(state(2, 2.0), 2, overlap=False)
        assert ck.save(state(1, 1.0), 1, overlap=False)
        assert ck.save(state(2, 200.0), 2, overlap=False)
        assert float(ck.load_latest(agree=False)["w"][0]) == 200.0
    finally:
        ck.close()
        release_shm_dir(shm)
