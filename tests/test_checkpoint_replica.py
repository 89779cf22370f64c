"""Buddy replication (checkpoint/replica.py) with real parts: a Checkpointer's snapshots in a real
shm dir, sent by a Replicator thread over TCP on loopback to a ReplicaServer that keeps them in its
own shm dir, then persisted from there as the buddy does after a node loss."""

from __future__ import annotations

import socket
from pathlib import Path

import torch
from tgtest import wait_for

from trainguard.checkpoint import disk
from trainguard.checkpoint.client import Checkpointer, _read_disk
from trainguard.checkpoint.format import unflatten
from trainguard.checkpoint.replica import (
    MAGIC,
    REPLICAS,
    Buddy,
    ReplicaServer,
    Replicator,
    persist_replicas,
    replica_files,
    send_snapshot,
)
from trainguard.checkpoint.shm import Slot, make_shm_dir, read_header, release_shm_dir, slot_path
from trainguard.cluster.stores import JobKey


def _state(step: int, rank: int) -> dict:
    return {"w": torch.full((1000,), float(step * 10 + rank)), "b": torch.arange(7) + rank, "step": step}


def test_snapshots_reach_the_buddy_signed_bounded_and_persist_from_there(tmp_path, shm_root):
    key = JobKey.for_job("replica-test", single_node=False).derive("checkpoint-replica")
    src_shm, dst_shm = make_shm_dir(shm_root), make_shm_dir(shm_root)
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    events: list[tuple] = []
    rejected: list[str] = []
    server = ReplicaServer(dst_shm / REPLICAS, "127.0.0.1", key, rejected.append)
    second = ReplicaServer(dst_shm / "second", "127.0.0.1", key, rejected.append)
    sender = Replicator(src_shm, "n3", key, lambda *a, **k: events.append((a, k)))
    workers = [Checkpointer(src_shm, ckpt, r, 2) for r in (0, 1)]
    try:
        # Two buddies: the MAC computed while sending to the first is reused for the second.
        sender.set_buddies([Buddy("n1", server.addr, server.port), Buddy("n2", second.addr, second.port)])
        sender.start()
        def kept(srv: ReplicaServer = server) -> dict[int, set[int]]:
            out: dict[int, set[int]] = {}
            for p, rank in replica_files(srv.root):
                out.setdefault(rank, set()).add(read_header(p).step)
            return out

        for step in (1, 2, 3):
            for r, w in enumerate(workers):
                assert w.save(_state(step, r), step, overlap=False)
            wait_for(lambda s=step: all(s in kept(srv).get(r, set()) for r in (0, 1) for srv in (server, second)),
                     what=f"both ranks' step {step} at both buddies")
        # Bounded: the two newest replicas per source rank (steps 2 and 3), no temp files left;
        # beside them one spare file, the displaced replica the next transfer is received into.
        assert kept() == kept(second) == {0: {2, 3}, 1: {2, 3}}, (kept(), kept(second))
        assert len(list((server.root / "n3").iterdir())) == 4
        assert sorted(p.name for p in server.root.iterdir()) == [".spare", "n3"]
        spare_size = (server.root / ".spare").stat().st_size
        assert sender.stats.bytes > 0 and sender.stats.snapshots >= 4, sender.stats
        assert not rejected, rejected
        assert any(a[0] == "checkpoint_replicated" for a, _ in events), events

        # A sender without the job's key is refused with one line, and nothing it sent is kept.
        slot = Slot.open(slot_path(src_shm, 0, workers[0]._latest))
        try:
            try:
                send_snapshot(Buddy("n1", server.addr, server.port), slot, slot.header(), "evil", b"x" * 32)
                raise AssertionError("a replica signed with another key was kept")
            except OSError as exc:
                assert "refused" in str(exc)
        finally:
            slot.close()
        wait_for(lambda: rejected, what="the refusal reported")
        assert len(rejected) == 1 and "MAC does not match" in rejected[0] and "\n" not in rejected[0], rejected
        assert not (server.root / "evil").exists() or not list((server.root / "evil").iterdir())
        assert (server.root / ".spare").stat().st_size <= spare_size  # no more memory held than before
        with socket.create_connection((server.addr, server.port)) as c:  # not even our frame
            c.sendall(b"GET / HTTP/1.0\r\n\r\n")
            assert c.recv(1) == b"\x00"
        assert MAGIC not in b"GET"
        wait_for(lambda: len(rejected) == 2, what="the stray client refused")

        # The buddy persists what it keeps: the lost node's ranks, verified on disk, equal to what was saved.
        done = persist_replicas(server.root, ckpt, lambda *a, **k: None)
        assert {("n3", 0, 3), ("n3", 1, 3)} <= {(node, p.rank, p.step) for node, p in done}
        for r in (0, 1):
            meta, tensors = _read_disk(ckpt, r, 3)
            got = unflatten(meta["tree"], tensors)
            assert torch.equal(got["w"], _state(3, r)["w"]) and torch.equal(got["b"], _state(3, r)["b"])
        assert disk.ranks_at(ckpt, 3) == [0, 1]
        assert persist_replicas(server.root, ckpt, lambda *a, **k: None) == []  # already there: not again
    finally:
        sender.stop()
        for w in workers:
            w.close()
        server.close()
        second.close()
        release_shm_dir(src_shm)
        release_shm_dir(dst_shm)


def test_agents_find_their_buddy_in_the_round_store_and_the_survivor_persists_the_lost_ranks(tmp_path, shm_root):
    """Two checkpoint monitors driven as two nodes' agents would be, through a real TCPStore seen
    through SignedStore: each publishes where it takes replicas and finds the next node's; rank 1's
    snapshot (node b) reaches node a, which writes it to the checkpoint dir at its breakpoint. A
    forged buddy address (unsigned) is never used. ``--ckpt-replicas`` reaches the settings."""
    import argparse

    from torch.distributed import TCPStore

    from trainguard.cluster.stores import SignedStore
    from trainguard.events import EventBus, EventStore
    from trainguard.monitors.api import MonitorContext, StepTracker
    from trainguard.monitors.checkpoint import (
        REPLICA_KEY,
        CheckpointMonitor,
        CheckpointSettings,
        add_run_arguments,
    )

    parser = argparse.ArgumentParser()
    add_run_arguments(parser.add_argument_group())
    assert CheckpointSettings.from_options(parser.parse_args([])).replicas is None
    assert CheckpointSettings.from_options(parser.parse_args(["--ckpt-replicas", "0"])).replicas == 0

    server = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    key = JobKey.for_job("buddies", single_node=False)
    run_dir, ckpt = tmp_path / "run", tmp_path / "ckpt"
    events = EventStore(run_dir)
    mons = {n: CheckpointMonitor(ckpt_dir=ckpt, keep=2, shm_root=shm_root) for n in ("a", "b")}
    ctxs, envs = {}, {}
    try:
        for rank, (n, mon) in enumerate(mons.items()):
            envs[n] = mon.worker_env(run_dir)
            store = SignedStore(TCPStore("127.0.0.1", server.port, is_master=False), key)
            ctxs[n] = MonitorContext(run_dir=run_dir, node=n, node_rank=rank, nnodes=2, nproc_per_node=1, world_size=2,
                                     restart_count=0, workers=[], events=EventBus(events, n), steps=StepTracker(),
                                     store=store, addr="127.0.0.1")  # fmt: skip
        server.set(f"{REPLICA_KEY}1", '{"node": "evil", "addr": "127.0.0.1", "port": 9}')  # unsigned: ignored
        mons["a"].on_workers_started(ctxs["a"])
        mons["a"].poll(ctxs["a"])
        assert mons["a"]._buddies == []  # the forged address was not taken
        mons["b"].on_workers_started(ctxs["b"])  # overwrites it with its own, signed
        wait_for(lambda: (mons["a"].poll(ctxs["a"]), mons["b"].poll(ctxs["b"]), mons["a"]._buddies and mons["b"]._buddies)[2],
                 what="both buddies found")  # fmt: skip
        assert [b.node for b in mons["a"]._buddies] == ["b"] and [b.node for b in mons["b"]._buddies] == ["a"]

        worker = Checkpointer(Path(envs["b"]["TRAINGUARD_CKPT_SHM_DIR"]), ckpt, 1, 2)
        try:
            assert worker.save(_state(5, 1), 5, overlap=False)
            a_replicas = mons["a"]._server.root
            wait_for(lambda: any(read_header(p).step == 5 for p, r in replica_files(a_replicas) if r == 1), what="step 5 at a")
        finally:
            worker.close()
        mons["a"].on_workers_failed(ctxs["a"], {})  # node b is gone: a's breakpoint
        meta, tensors = _read_disk(ckpt, 1, 5)
        assert torch.equal(unflatten(meta["tree"], tensors)["w"], _state(5, 1)["w"])
    finally:
        for mon in mons.values():
            mon.close()
        events.close()


def test_with_three_slots_the_step_before_the_newest_survives_a_pinned_older_one(tmp_path, shm_root):
    """With replication a rank keeps three slots (TRAINGUARD_CKPT_SLOTS=3): while the agent pins an
    old snapshot to persist it, saves rotate through the other two, so the newest two steps stay
    in memory (a lost node's replica may be one step behind the survivors' newest)."""
    shm = make_shm_dir(shm_root)
    w = Checkpointer(shm, tmp_path / "ckpt", 0, 1, nslots=3)
    try:
        assert w.save(_state(1, 0), 1, overlap=False)
        pinned = Slot.open(slot_path(shm, 0, w._latest))
        try:
            pinned.set_pin(pinned.header().seq)  # the agent persisting step 1 (slowly)
            for step in range(2, 7):
                assert w.save(_state(step, 0), step, overlap=False)
            held = sorted(w._memory_steps())
            assert held == [1, 5, 6], held
        finally:
            pinned.set_pin(0)
            pinned.close()
        assert w.save(_state(7, 0), 7, overlap=False)  # unpinned: the oldest (step 1) goes
        assert sorted(w._memory_steps()) == [5, 6, 7]
    finally:
        w.close()
        release_shm_dir(shm)
