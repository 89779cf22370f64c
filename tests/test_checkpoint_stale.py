"""A snapshot written out of band (a dead owner's rescued slots, a buddy's replicas at a breakpoint)
that is older than a step of its rank on disk is skipped: pruning keeps the most recently persisted
checkpoints (how an abandoned timeline's higher steps go after a rollback), so writing it would
count as the newest and prune the later steps. The soak bench's standby row (2026-11-28) resumed
from step 0 that way: a promoted standby rescued its own stale step 342 and a buddy persisted old
replicas of steps 204 and 343, which pruned rank 2's steps 589-591.

Real parts: a Checkpointer's slots in a real shm dir, the agent's Persister, the checkpoint dir."""

from __future__ import annotations

from pathlib import Path

import torch

from trainguard.checkpoint import disk
from trainguard.checkpoint.client import Checkpointer
from trainguard.checkpoint.persist import Persister, rescue_orphan
from trainguard.checkpoint.replica import persist_replicas
from trainguard.checkpoint.shm import make_shm_dir, release_shm_dir


def _state(step: int) -> dict:
    return {"w": torch.full((64,), float(step)), "step": step}


def _persisted(ckpt: Path, shm_root: Path, steps: list[int], rank: int = 0, world: int = 1) -> None:
    """A rank's checkpoints of ``steps`` on disk, written as the agent writes them (keep 3)."""
    shm = make_shm_dir(shm_root)
    worker = Checkpointer(shm, ckpt, rank, world)
    persister = Persister(shm, ckpt, 3, lambda *a, **k: None, idle_priority=False)
    try:
        for step in steps:
            worker.save(_state(step), step)
            worker.wait()
            persister.run_pass()
    finally:
        worker.close()
        persister.stop(flush=False)
        release_shm_dir(shm)


def _in_memory(shm: Path, ckpt: Path, steps: list[int], rank: int = 0, world: int = 1) -> None:
    """Snapshots of ``steps`` in the slots under ``shm``, left there (their process is gone)."""
    worker = Checkpointer(shm, ckpt, rank, world, nslots=2)
    for step in steps:
        worker.save(_state(step), step)
    worker.wait()
    worker.close()


def _resumes_from(ckpt: Path, shm_root: Path) -> int:
    shm = make_shm_dir(shm_root)
    worker = Checkpointer(shm, ckpt, 0, 1)
    try:
        return worker.load_latest()["step"]
    finally:
        worker.close()
        release_shm_dir(shm)


def test_a_dead_owners_older_snapshots_are_not_rescued_over_newer_steps(tmp_path, shm_root):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    _persisted(ckpt, shm_root, [8, 9, 10])
    stale = make_shm_dir(shm_root, info={"ckpt_dir": str(ckpt), "keep": 3})
    _in_memory(stale, ckpt, [4, 5])  # a node's snapshots from an earlier role of its rank
    said: list[str] = []
    assert rescue_orphan(stale, lambda kind, message, **_: said.append(kind), ckpt, 3) == []
    assert said == [] and disk.list_steps(ckpt, 0) == [10, 9, 8]
    assert _resumes_from(ckpt, shm_root) == 10

    newer = make_shm_dir(shm_root, info={"ckpt_dir": str(ckpt), "keep": 3})
    _in_memory(newer, ckpt, [11, 12])  # what the disk lacks is still rescued
    assert sorted(p.step for p in rescue_orphan(newer, lambda *a, **k: None, ckpt, 3)) == [11, 12]
    assert disk.list_steps(ckpt, 0) == [12, 11, 10]
    release_shm_dir(stale)
    release_shm_dir(newer)


def test_a_buddys_older_replicas_are_not_persisted_over_newer_steps(tmp_path, shm_root):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    _persisted(ckpt, shm_root, [8, 9, 10])
    held = make_shm_dir(shm_root)  # a buddy's replicas dir: one source node's slot files, as received
    node = held / "replicas" / "n3"
    node.mkdir(parents=True)
    _in_memory(node, ckpt, [4, 5])
    assert persist_replicas(held / "replicas", ckpt, lambda *a, **k: None) == []
    assert disk.list_steps(ckpt, 0) == [10, 9, 8]
    assert _resumes_from(ckpt, shm_root) == 10

    _in_memory(node, ckpt, [11, 12])  # newer than the disk: the lost node's state, persisted
    assert sorted(p.step for _, p in persist_replicas(held / "replicas", ckpt, lambda *a, **k: None)) == [11, 12]
    assert _resumes_from(ckpt, shm_root) == 12
    release_shm_dir(held)


def test_a_replica_older_than_a_partial_step_is_persisted(tmp_path, shm_root):
    """Only a complete later step makes a replica stale. Three ranks, nodes n1 (rank 0) and n3
    (rank 2) lost: the survivor holds n1's replica of step 16 only, and rank 2's 17 is already on
    disk, so 16 is the newest step every shard of which exists. Skipping rank 2's 16 for the partial
    17 made bench/faults.py's kill-buddy-then-node fall back 8 steps to disk (2026-11-28)."""
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    _persisted(ckpt, shm_root, [16, 17], rank=1, world=3)  # the survivor's own rank
    _persisted(ckpt, shm_root, [16], rank=0, world=3)  # n1's replica, written just before
    _persisted(ckpt, shm_root, [17], rank=2, world=3)  # n3's newest, on disk
    assert not disk.complete(ckpt, 17, 1) and not disk.complete(ckpt, 16, 1)
    held = make_shm_dir(shm_root)
    node = held / "replicas" / "n3"
    node.mkdir(parents=True)
    _in_memory(node, ckpt, [16], rank=2, world=3)
    written = persist_replicas(held / "replicas", ckpt, lambda *a, **k: None)
    assert [(src, p.step) for src, p in written] == [("n3", 16)]
    assert disk.complete(ckpt, 16, 0) and disk.complete(ckpt, 16, 2)

    _persisted(ckpt, shm_root, [17], rank=0, world=3)  # now 17 is complete: an older replica is stale
    again = make_shm_dir(shm_root)
    (again / "replicas" / "n3").mkdir(parents=True)
    _in_memory(again / "replicas" / "n3", ckpt, [15], rank=2, world=3)
    assert persist_replicas(again / "replicas", ckpt, lambda *a, **k: None) == []
    release_shm_dir(held)
    release_shm_dir(again)
