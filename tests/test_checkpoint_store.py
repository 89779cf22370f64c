"""Snapshots in shared memory and checkpoints on disk, in one process: double buffering, torn
snapshots, persist/prune, corrupt and partial checkpoints, a full disk, events."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import torch
from tgtest import wait_for

from trainguard.checkpoint import disk
from trainguard.checkpoint.client import Checkpointer
from trainguard.checkpoint.format import FORMAT
from trainguard.checkpoint.shm import (
    COMPLETE,
    WRITING,
    Slot,
    make_shm_dir,
    release_shm_dir,
    remove_stale_dirs,
    slot_path,
)
from trainguard.events import EventBus, EventStore
from trainguard.monitors.api import MonitorContext, StepTracker
from trainguard.monitors.checkpoint import CheckpointMonitor


@pytest.fixture(autouse=True)
def copy_inside_save(monkeypatch):
    """These tests look at the slots right after ``save``: copies inside the call (the overlapped
    default is tested where it says ``overlap=True``, and by the real jobs)."""
    monkeypatch.setenv("TRAINGUARD_CKPT_OVERLAP", "0")


@pytest.fixture
def shm_root(tmp_path):
    # A private root under /dev/shm (real tmpfs), removed whatever happens.
    root = Path("/dev/shm") / f"tg-ckpt-test-{uuid.uuid4().hex[:8]}"
    root.mkdir()
    yield root
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def monitor(tmp_path, shm_root):
    """A checkpoint monitor driven by hand, as the agent would, with a real event store."""
    run_dir = tmp_path / "run"
    mon = CheckpointMonitor(keep=2, shm_root=shm_root)
    env = mon.worker_env(run_dir)
    store = EventStore(run_dir)
    ctx = MonitorContext(
        run_dir=run_dir,
        node="n0",
        node_rank=0,
        nnodes=1,
        nproc_per_node=1,
        world_size=1,
        restart_count=0,
        workers=[],
        events=EventBus(store, "n0"),
        steps=StepTracker(),
    )
    mon.on_workers_started(ctx)
    try:
        yield mon, env, store, ctx
    finally:
        mon.close()
        store.close()


def state_at(step: int, n: int = 1000) -> dict:
    return {"w": torch.full((n,), float(step)), "step": step, "meta": {"lr": 0.1 * step}}


def worker(env: dict[str, str], rank: int = 0) -> Checkpointer:
    return Checkpointer(Path(env["TRAINGUARD_CKPT_SHM_DIR"]), Path(env["TRAINGUARD_CKPT_DIR"]), rank, 1)


def kinds(store: EventStore, kind: str):
    return store.query(kinds=[kind])


def test_checkpoint_save_persist_load_and_keep_k(monitor):
    mon, env, store, ctx = monitor
    w = worker(env)
    for step in (1, 2, 3):
        assert w.save(state_at(step), step)
        mon._persister.run_pass()
    ckpt_dir = Path(env["TRAINGUARD_CKPT_DIR"])
    assert disk.list_steps(ckpt_dir, 0) == [3, 2]  # keep K=2
    assert {e.evidence["step"] for e in kinds(store, "checkpoint_persisted")} == {1, 2, 3}
    # A restarted process (same node) adopts the in-memory snapshot.
    w.close()
    w2 = worker(env)
    got = w2.load_latest()
    assert (
        got["step"] == 3 and torch.equal(got["w"], torch.full((1000,), 3.0)) and got["meta"]["lr"] == 0.1 * 3
    )
    w2.close()


def test_checkpoint_double_buffer_keeps_last_complete_snapshot_when_a_save_is_torn(monitor):
    _, env, _, _ = monitor
    w = worker(env)
    for step in (1, 2, 3):  # one per slot
        assert w.save(state_at(step), step)
    # The worker dies in the middle of writing step 4: that slot (step 1's) is left WRITING, half copied.
    index = w._target_slot()
    slot = w._slots[index]
    slot.begin_write(99)
    slot.mm[slot.size - 8 :] = b"garbage!"
    w.close()
    w2 = worker(env)
    assert w2.load_latest()["step"] == 3
    states = [Slot.open(slot_path(Path(env["TRAINGUARD_CKPT_SHM_DIR"]), 0, i)).header().state for i in range(3)]
    assert sorted(states) == [WRITING, COMPLETE, COMPLETE]
    # The next save goes to the torn slot, not over step 2 or 3.
    assert w2.save(state_at(4), 4)
    assert sorted(w2._memory_steps()) == [2, 3, 4]
    w2.close()


def test_checkpoint_state_that_grows_gets_a_bigger_slot(monitor):
    _, env, _, _ = monitor
    w = worker(env)
    for step, n in ((1, 10), (2, 300_000), (3, 600_000)):  # e.g. Adam state appears after step 1
        assert w.save(state_at(step, n), step)
        assert w.load_latest(agree=False)["w"].numel() == n
    w.close()


def test_checkpoint_pinned_slot_is_not_overwritten_and_neither_is_the_newest(monitor):
    """The agent pins the slot it persists; the rank writes another one, and never the slot of its
    newest snapshot: a death in that write would leave it only older steps (test_checkpoint_common_step)."""
    _, env, _, _ = monitor
    w = worker(env)
    for step in (1, 2, 3):
        assert w.save(state_at(step), step)
    agent_view = Slot.open(w._slots[w._memory_steps()[2]].path)
    agent_view.set_pin(agent_view.header().seq)  # the agent is persisting step 2 right now
    assert w.save(state_at(4), 4)  # goes over step 1
    assert w.save(state_at(5), 5)  # goes over step 3, leaves the pinned step 2 and the newest (4) alone
    assert sorted(w._memory_steps()) == [2, 4, 5]
    other = Slot.open(w._slots[w._memory_steps()[4]].path)
    other.set_pin(other.header().seq)  # every slot but the newest held (a test only: the agent pins one)
    assert not w.save(state_at(6), 6)  # skipped, nothing torn, the newest not written over
    assert w.skipped == 1 and sorted(w._memory_steps()) == [2, 4, 5]
    other.set_pin(0)
    agent_view.set_pin(0)
    assert w.save(state_at(6), 6)
    assert sorted(w._memory_steps()) == [4, 5, 6]
    agent_view.close()
    other.close()
    w.close()


def test_checkpoint_persist_discards_a_snapshot_overwritten_midway(tmp_path):
    data = memoryview(bytes(1000))
    meta = {"format": FORMAT, "rank": 0, "step": 5, "tree": {"T": 0}, "tensors": []}
    with pytest.raises(disk.SnapshotChanged):
        disk.write_checkpoint(tmp_path, meta, data, still_valid=lambda: False)
    assert list(tmp_path.iterdir()) == []  # no temp file, no step dir


def test_checkpoint_corrupt_newest_falls_back_with_warning_event(monitor):
    mon, env, store, _ = monitor
    w = worker(env)
    for step in (1, 2):
        assert w.save(state_at(step), step)
        mon._persister.run_pass()
    w.close()
    ckpt_dir = Path(env["TRAINGUARD_CKPT_DIR"])
    newest = disk.step_dir(ckpt_dir, 2) / disk.data_name(0)
    raw = bytearray(newest.read_bytes())
    raw[100] ^= 0xFF
    newest.write_bytes(bytes(raw))
    # The node was replaced: no in-memory snapshot, only the disk.
    for p in Path(env["TRAINGUARD_CKPT_SHM_DIR"]).glob("rank-*"):
        p.unlink()
    w2 = worker(env)
    got = w2.load_latest()
    assert got["step"] == 1 and torch.equal(got["w"], torch.full((1000,), 1.0))
    mon._persister.run_pass()  # relays the worker's report
    (ev,) = kinds(store, "checkpoint_fallback")
    assert ev.severity.label == "warning" and ev.evidence["loaded_step"] == 1
    assert ev.evidence["corrupt"][0]["step"] == 2 and "CRC32" in ev.evidence["corrupt"][0]["error"]
    w2.close()


@pytest.mark.parametrize("damage", ["truncate", "no_manifest", "bad_manifest", "no_data"])  # crafted files: test_checkpoint_integrity
def test_checkpoint_partial_newest_is_skipped(tmp_path, damage):
    for step in (1, 2):
        tree_tensors = {
            "format": FORMAT,
            "rank": 0,
            "world_size": 1,
            "step": step,
            "tree": {"D": [["w", {"T": 0}], ["step", step]]},
            "tensors": [{"dtype": "int64", "shape": [4], "offset": 0, "nbytes": 32, "device": "cpu"}],
        }
        data = torch.full((4,), step, dtype=torch.int64)
        disk.write_checkpoint(tmp_path, tree_tensors, memoryview(bytearray(data.view(torch.uint8).tolist())))
    sdir = disk.step_dir(tmp_path, 2)
    if damage == "truncate":
        (sdir / disk.data_name(0)).write_bytes(b"\0" * 16)
    elif damage == "no_manifest":
        (sdir / disk.manifest_name(0)).unlink()
    elif damage == "bad_manifest":
        (sdir / disk.manifest_name(0)).write_bytes(b'{"format": "trainguard-ckpt/2", "tree"')
    else:
        (sdir / disk.data_name(0)).unlink()
    shm = make_shm_dir(tmp_path)
    w = Checkpointer(shm, tmp_path, 0, 1)
    got = w.load_latest()
    assert got["step"] == 1 and got["w"].tolist() == [1, 1, 1, 1]
    w.close()


def test_checkpoint_unwritable_dir_is_an_error_event_and_training_goes_on(tmp_path, shm_root):
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    run_dir = tmp_path / "run"
    mon = CheckpointMonitor(ckpt_dir=blocker / "ckpt", shm_root=shm_root)
    env = mon.worker_env(run_dir)
    store = EventStore(run_dir)
    ctx = MonitorContext(
        run_dir=run_dir,
        node="n0",
        node_rank=0,
        nnodes=1,
        nproc_per_node=1,
        world_size=1,
        restart_count=0,
        workers=[],
        events=EventBus(store, "n0"),
        steps=StepTracker(),
    )
    mon.on_workers_started(ctx)
    try:
        w = worker(env)
        assert w.save(state_at(1), 1)
        mon._persister.run_pass()
        (ev,) = kinds(store, "checkpoint_failed")
        assert ev.severity.label == "error" and ev.evidence["step"] == 1
        assert w.save(state_at(2), 2)  # snapshots keep working in memory
        assert w.load_latest()["step"] == 2
        w.close()
    finally:
        mon.close()
        store.close()


def test_checkpoint_full_disk_keeps_previous_checkpoint_valid(tmp_path, shm_root):
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mnt = tmp_path / "small"
    mnt.mkdir()
    if subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1M", "tmpfs", str(mnt)], capture_output=True
    ).returncode:
        pytest.skip("cannot mount a tmpfs here")
    run_dir = tmp_path / "run"
    mon = CheckpointMonitor(ckpt_dir=mnt, keep=3, shm_root=shm_root)
    store = EventStore(run_dir)
    try:
        env = mon.worker_env(run_dir)
        ctx = MonitorContext(
            run_dir=run_dir,
            node="n0",
            node_rank=0,
            nnodes=1,
            nproc_per_node=1,
            world_size=1,
            restart_count=0,
            workers=[],
            events=EventBus(store, "n0"),
            steps=StepTracker(),
        )
        mon.on_workers_started(ctx)
        w = worker(env)
        assert w.save(state_at(1, 50_000), 1)  # 200 KB: fits
        mon._persister.run_pass()
        assert w.save(state_at(2, 500_000), 2)  # 2 MB: does not fit in 1 MB
        mon._persister.run_pass()
        (failed,) = kinds(store, "checkpoint_failed")
        assert failed.severity.label == "error" and failed.evidence["step"] == 2
        assert "No space left" in failed.evidence["error"]
        # Nothing half-written is left, and step 1 still verifies.
        assert disk.list_steps(mnt, 0) == [1]
        assert sorted(p.name for p in mnt.rglob("*")) == [
            "rank-00000.bin",
            "rank-00000.json",
            "step-0000000001",
        ]
        meta, _ = disk.read_checkpoint(mnt, 0, 1)
        assert meta["step"] == 1
        # Training went on and a later, smaller snapshot persists again.
        assert w.save(state_at(3, 50_000), 3)
        mon._persister.run_pass()
        assert disk.list_steps(mnt, 0) == [3, 1]
        w.close()
    finally:
        mon.close()
        store.close()
        subprocess.run(["umount", str(mnt)], check=False)


def test_checkpoint_monitor_close_removes_shared_memory(tmp_path, shm_root):
    mon = CheckpointMonitor(shm_root=shm_root)
    env = mon.worker_env(tmp_path / "run")
    w = worker(env)
    assert w.save(state_at(1), 1)
    w.close()
    assert Path(env["TRAINGUARD_CKPT_SHM_DIR"]).exists()
    mon.close()  # persists the last snapshot, then unlinks the segments
    assert list(shm_root.iterdir()) == []
    assert disk.list_steps(Path(env["TRAINGUARD_CKPT_DIR"]), 0) == [1]


def test_checkpoint_stale_shm_dirs_of_dead_agents_are_removed(shm_root):
    # A directory whose owner process died (its flock is gone) is removed; a live one is kept.
    code = ("import sys; from pathlib import Path; from trainguard.checkpoint.shm import make_shm_dir; "
            "print(make_shm_dir(Path(sys.argv[1])))")
    dead = Path(subprocess.run([sys.executable, "-c", code, str(shm_root)], capture_output=True, text=True,
                               check=True).stdout.strip())
    assert dead.exists()
    live = make_shm_dir(shm_root)  # removes the dead one on the way
    assert live.exists() and not dead.exists()
    assert remove_stale_dirs(shm_root) == []
    release_shm_dir(live)
    assert not live.exists()


def test_checkpoint_big_state_is_persisted_with_direct_io_and_reads_back_identical(monitor):
    """Past 8 MB the agent writes with O_DIRECT (straight from shared memory, no page cache),
    including a tail that is not a whole block."""
    mon, env, store, _ = monitor
    w = worker(env)
    big = torch.randn((8 << 20) // 4 + 250)
    assert w.save({"w": big, "step": 1}, 1)
    w.wait()
    mon._persister.run_pass()
    w.close()
    (ev,) = kinds(store, "checkpoint_persisted")
    assert ev.evidence["direct_io"] is True and ev.evidence["bytes"] % 4096
    for p in Path(env["TRAINGUARD_CKPT_SHM_DIR"]).glob("rank-*"):
        p.unlink()  # no in-memory copy: the disk only
    got = worker(env).load_latest()
    assert got["step"] == 1 and torch.equal(got["w"], big)


def test_checkpoint_overlapped_copy_discards_a_snapshot_changed_in_place_and_stops_overlapping(monitor):
    """The overlapped copy trusts the optimizer/forward hooks to hold changes back; a change made
    elsewhere before the copy (its version counter moved) must not produce a torn snapshot."""
    import threading

    mon, env, store, _ = monitor
    w = worker(env)
    assert w.save(state_at(1), 1, overlap=True)
    w.wait()
    from trainguard.checkpoint import client

    gate = threading.Event()
    copy = client._copy_item

    def held_copy(p, item, fast):  # the helper copies only once the test has changed the state
        if not fast:
            gate.wait(30)
        copy(p, item, fast)

    client._copy_item = held_copy
    try:
        state = state_at(2)
        assert w.save(state, 2, overlap=True)
        state["w"].add_(100.0)  # an in-place change outside optimizer.step() and forward
        gate.set()
        w.wait()
    finally:
        client._copy_item = copy
    assert sorted(w._memory_steps()) == [1]  # the changed snapshot was never published
    assert w.load_latest(agree=False)["step"] == 1
    mon._persister.run_pass()
    (ev,) = kinds(store, "checkpoint_overlap_off")
    assert ev.severity.label == "warning" and ev.evidence["step"] == 2
    # Later saves copy inside save(): the state at the call, whatever happens after it.
    state = state_at(3)
    assert w.save(state, 3, overlap=True)
    state["w"].add_(100.0)
    got = w.load_latest(agree=False)
    assert got["step"] == 3 and torch.equal(got["w"], torch.full((1000,), 3.0))
    w.close()


def test_checkpoint_persist_thread_runs_at_idle_priority_until_it_starves(tmp_path, shm_root):
    import time

    from trainguard.checkpoint.persist import Persister

    shm = make_shm_dir(shm_root)
    p = Persister(shm, tmp_path / "ckpt", 3, lambda *a, **k: None, interval_s=0.01)
    p.start()
    try:
        tid = wait_for(lambda: p._tid)
        wait_for(lambda: os.sched_getscheduler(tid) == os.SCHED_IDLE)
        assert not p.boost_if_starved(max_lag_s=30)  # it makes progress: left alone
        p._heartbeat = time.monotonic() - 60  # as if it had got no CPU for a minute
        assert p.boost_if_starved(max_lag_s=30)
        assert os.sched_getscheduler(tid) == os.SCHED_OTHER and os.getpriority(os.PRIO_PROCESS, tid) == 10
        wait_for(lambda: os.sched_getscheduler(tid) == os.SCHED_IDLE)  # caught up: idle again
    finally:
        p.stop(flush=False)
        release_shm_dir(shm)



def test_checkpoint_overlapped_copy_shared_with_the_training_thread_is_exact(monitor):
    """The helper copies pieces at idle priority; the optimizer step takes over the rest. Whatever
    the split, the snapshot is bit-identical to the state at the call."""
    _, env, _, _ = monitor
    w = worker(env)
    model = torch.nn.Linear(1500, 1500)  # a 9 MB weight: three pieces
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    odd = torch.arange(24.0).view(4, 6).t()  # not contiguous: one piece, copied with its strides
    for step in (1, 2, 3):
        state = {"model": model.state_dict(), "odd": odd, "n": torch.tensor(step)}
        expect = {k: v.clone() for k, v in model.state_dict().items()}
        assert w.save(state, step, overlap=True)
        model(torch.randn(2, 1500)).sum().backward()
        opt.step()  # waits for (or finishes) the copy before changing the weights
        opt.zero_grad()
        got = w.load_latest(agree=False)
        assert got["n"].item() == step and torch.equal(got["odd"], odd)
        assert all(torch.equal(got["model"][k], expect[k]) for k in expect)
    w.close()


def test_checkpoint_old_world_snapshots_are_freed_once_every_new_rank_saved(monitor):
    """A node that hosted ranks 0 and 1 of a world of 2 now hosts rank 0 of a world of 1: rank 1's
    snapshots stay while rank 0 may still load from them, and go once it saved at the new size."""
    mon, env, _, _ = monitor
    shm, ckpt = Path(env["TRAINGUARD_CKPT_SHM_DIR"]), Path(env["TRAINGUARD_CKPT_DIR"])
    old = [Checkpointer(shm, ckpt, r, 2) for r in (0, 1)]
    for w in old:
        assert w.save(state_at(1), 1)
        w.close()
    new = Checkpointer(shm, ckpt, 0, 1)
    assert new.load_latest()["step"] == 1  # replicated state from the old ranks' memory
    assert mon._persister.drop_stale_slots({0}, 1) == []  # rank 0 has no snapshot at world 1 yet
    assert new.save(state_at(2), 2)
    assert mon._persister.drop_stale_slots({0}, 1) == [1]
    assert sorted(p.name for p in shm.glob("rank-*")) == ["rank-00000.slot0", "rank-00000.slot1"]
    assert new.load_latest()["step"] == 2
    new.close()


def test_checkpoint_nan_replay_skips_states_holding_non_finite_values(monitor, monkeypatch):
    """A NaN replay (TRAINGUARD_CKPT_FINITE_ONLY, set by the agent) resumes from the newest state
    before the NaN, in memory and on disk; without it the newest state is taken as always."""
    mon, env, store, ctx = monitor
    w = worker(env)
    spoilt = state_at(3)
    spoilt["w"][7] = float("nan")
    for step, state in ((1, state_at(1)), (2, state_at(2)), (3, spoilt)):
        assert w.save(state, step)
        mon._persister.run_pass()
    assert w.load_latest()["step"] == 3
    monkeypatch.setenv("TRAINGUARD_CKPT_FINITE_ONLY", "1")
    got = w.load_latest()
    assert got["step"] == 2 and torch.equal(got["w"], torch.full((1000,), 2.0))
    mon._persister.run_pass()  # relays the worker's report
    (fallback,) = kinds(store, "checkpoint_fallback")
    assert fallback.evidence["loaded_step"] == 2 and "non-finite" in fallback.evidence["corrupt"][0]["error"]
    w.close()
