"""The step every rank holds survives the agent pinning a slot to persist it.

A DDP job's ranks are at most one save apart; a restart resumes from the newest step every rank
holds. That step exists only if each rank, at any moment it can die, still holds its newest
committed snapshot and, once the next one is committed, the one before it too. The agent's
persister pins the slot it writes (possibly for seconds at idle priority on a busy machine); a
rank that then overwrote its newest snapshot instead held only the pinned older step, and the
other rank had already rotated past it: no common step, a restart from scratch.

Real Checkpointers on a real tmpfs directory, two ranks in one process (``save`` makes no
collective call), with the slot count the agent gives its workers; the pin is set the way the
persister sets it. A death inside a save is a save whose commit (``_publish``) never runs, as in
tests/scripts/checkpoint_worker.py --die-in-save."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch

from trainguard.checkpoint import disk
from trainguard.checkpoint.client import ENV_SLOTS, Checkpointer
from trainguard.checkpoint.persist import Persister
from trainguard.checkpoint.shm import Slot, make_shm_dir, read_header, release_shm_dir, slot_files
from trainguard.monitors.checkpoint import CheckpointMonitor


@pytest.fixture
def job(tmp_path, shm_root, monkeypatch):
    """(shm dir, checkpoint dir, slots per rank) as the agent hands them to its workers."""
    monkeypatch.setenv("TRAINGUARD_CKPT_OVERLAP", "0")  # the slots are looked at right after save
    mon = CheckpointMonitor(keep=3, shm_root=shm_root)
    env = mon.worker_env(tmp_path / "run")
    try:
        yield Path(env["TRAINGUARD_CKPT_SHM_DIR"]), tmp_path / "ckpt", int(env[ENV_SLOTS])
    finally:
        mon.close()


def state(step: int) -> dict:
    return {"w": torch.full((256,), float(step)), "step": step}


def held(shm: Path, rank: int) -> set[int]:
    """Steps of a rank's complete snapshots in the directory (what a restart could resume)."""
    return {h.step for path, r in slot_files(shm) if r == rank and (h := read_header(path)) is not None and h.complete}


class Recording(Checkpointer):
    """Records, at each commit, what the rank holds just before it (what a death inside this save
    leaves) and can die there instead of committing."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.before_commit: dict[int, set[int]] = {}
        self.die_at: int | None = None

    def _publish(self, p) -> None:
        self.before_commit[p.step] = held(self.shm_dir, self.rank)
        if p.step != self.die_at:
            super()._publish(p)


def pin_newest(ck: Checkpointer) -> Slot:
    """The agent's persister starts writing this rank's newest snapshot: it pins that slot."""
    slot = Slot.open(ck._slots[ck._latest].path)
    slot.set_pin(slot.header().seq)
    return slot


def test_rank_dying_in_a_save_while_the_other_rank_is_pinned_leaves_a_common_step(job):
    """Rank 1's step 2 is being persisted (pinned) while both ranks save 3 and rank 1 saves 4;
    rank 0 dies inside its save of 4. Rank 0 holds 3 at most: rank 1 must still hold 3 (it used to
    write 4 over 3, since the only other slot was pinned, and held {2, 4}: nothing in common)."""
    shm, ckpt, nslots = job
    ranks = [Recording(shm, ckpt, r, 2, nslots=nslots) for r in (0, 1)]
    pin = None
    try:
        for step in (1, 2):
            assert all(ck.save(state(step), step) for ck in ranks)
        pin = pin_newest(ranks[1])
        assert all(ck.save(state(3), 3) for ck in ranks)
        assert ranks[1].save(state(4), 4)
        ranks[0].die_at = 4
        ranks[0].save(state(4), 4)
        common = held(shm, 0) & held(shm, 1)
        assert 3 in common, f"rank 0 holds {sorted(held(shm, 0))}, rank 1 {sorted(held(shm, 1))}: no step 3 in common"
    finally:
        if pin is not None:
            pin.set_pin(0)
            pin.close()
        for ck in ranks:
            ck.close()


@pytest.mark.parametrize("pinned_at,pinned_for", list(itertools.product((1, 2, 3), (1, 2, 3, 5))))
def test_a_rank_always_holds_its_newest_step_and_the_one_before_while_a_slot_is_pinned(job, pinned_at, pinned_for):
    """One rank, saving every step; the persister pins its newest slot after step ``pinned_at``
    and holds it for ``pinned_for`` saves. At every commit the rank still held its previous step
    (a death there leaves it), and after it holds its newest two steps: with the other rank at
    most one save away, that is the step they have in common."""
    shm, ckpt, nslots = job
    ck = Recording(shm, ckpt, 0, 1, nslots=nslots)
    pin = None
    try:
        for step in range(1, pinned_at + pinned_for + 4):
            if step == pinned_at + 1:
                pin = pin_newest(ck)
            if pin is not None and step == pinned_at + 1 + pinned_for:
                pin.set_pin(0)
            assert ck.save(state(step), step), f"save of step {step} skipped"
            if step > 1:
                assert step - 1 in ck.before_commit[step], f"dying in save {step} leaves {ck.before_commit[step]}"
                assert {step - 1, step} <= held(shm, 0), f"after save {step} holds {sorted(held(shm, 0))}"
    finally:
        if pin is not None:
            pin.set_pin(0)
            pin.close()
        ck.close()


def test_breakpoint_persist_of_older_snapshots_does_not_make_pruning_drop_the_newest(tmp_path, shm_root):
    """The background pass persists a rank's newest snapshot (3); at a breakpoint the agent also
    writes its older ones (1, 2), so that the step every rank holds is on disk. The restart resumes
    from 3 and the next checkpoint (4) is pruned to keep=3: 3 must stay. Pruning by the time a
    checkpoint was written kept 1 and 2 (written last) and deleted 3, the step the job resumed from."""
    shm = make_shm_dir(shm_root)
    ckpt = tmp_path / "ckpt"
    ck = Checkpointer(shm, ckpt, 0, 1, nslots=3)
    persister = Persister(shm, ckpt, 3, lambda *a, **k: None)
    try:
        for step in (1, 2, 3):
            assert ck.save(state(step), step, overlap=False)
        assert [p.step for p in persister.run_pass()] == [3]
        assert [p.step for p in persister.run_pass(every_slot=True, trigger="breakpoint")] == [1, 2]
        assert ck.save(state(4), 4, overlap=False)
        assert [p.step for p in persister.run_pass()] == [4]
        assert disk.list_steps(ckpt, 0) == [4, 3, 2]
    finally:
        persister.stop(flush=False)
        ck.close()
        release_shm_dir(shm)
