"""Pulling snapshots before the workers start (checkpoint/pull.py, the fetch side of
checkpoint/replica.py) with real parts: checkpoint monitors driven as two nodes' agents through a
real TCPStore seen through SignedStore, real shm dirs, TCP on loopback; node-local checkpoint
dirs, so that the lost rank's state can only come over the network."""

from __future__ import annotations

import json
import os
import socket
import struct
import threading

import pytest
import torch
from tgtest import wait_for

from trainguard.checkpoint.client import Checkpointer
from trainguard.checkpoint.pull import choose, needed
from trainguard.checkpoint.replica import (
    _FETCH_REQUEST,
    FETCH_MAGIC,
    NONCE_LEN,
    REPLICAS,
    Buddy,
    Held,
    ReplicaServer,
    _fetch_mac,
    list_held,
    replica_files,
)
from trainguard.checkpoint.shm import make_shm_dir, read_header, release_shm_dir
from trainguard.cluster.stores import JobKey


def _state(step: int, rank: int) -> dict:
    return {"w": torch.full((500,), float(step * 10 + rank)), "step": step}


def _held(node: str, rank: int, step: int, t: float = 0.0) -> Held:
    return Held(node, rank, 2, step, step, t, 100)


def test_needed_ranks_are_the_new_ones_and_those_held_nowhere_here():
    assert needed((0, 1), (0, 1), {0: {5}, 1: {5}}) == []  # a survivor whose ranks stayed
    assert needed((1,), (), {}) == [1]  # a standby's first round
    assert needed((2, 3), (0, 1), {2: {1}}) == [2, 3]  # ranks moved: what is held of 2 may be stale
    assert needed((0, 1), (0, 1), {0: {5}}) == [1]  # nothing of rank 1 any more


def test_choose_takes_the_newest_steps_newer_than_held_here_one_holder_each():
    a, b = Buddy("a", "127.0.0.1", 1), Buddy("b", "127.0.0.1", 2)
    offers = [(a, _held("n3", 1, 7, 1.0)), (a, _held("n3", 1, 8, 2.0)), (b, _held("n3", 1, 8, 3.0)),
              (b, _held("b", 0, 9)), (a, _held("n3", 1, 6))]
    got = choose(offers, {0: {9}})
    # rank 0: held here already at step 9; rank 1: steps 7 and 8 (oldest first), step 8 from b (saved last)
    assert [(p.node, h.rank, h.step) for p, h in got] == [("a", 1, 7), ("b", 1, 8)]
    assert choose(offers, {0: {9}, 1: {8}}) == []  # nothing newer than held
    assert [h.step for _, h in choose(offers, {}, per_rank=1) if h.rank == 1] == [8]


@pytest.mark.parametrize("moved", [False, True], ids=["standby-takes-the-lost-ranks", "survivor-ranks-moved"])
def test_a_standby_pulls_the_lost_ranks_newest_steps_from_the_buddy_and_resumes_from_memory(tmp_path, shm_root, moved):
    """Round 1: nodes a (rank 0) and b (rank 1), b's snapshots replicated to a. Round 2: b is
    gone, standby c joins. Every node has its own checkpoint dir (nothing of rank 1 on c's disk).
    c runs rank 1: c's agent pulls rank 1's two newest steps from a's replicas before its worker
    starts. ``moved``: c sorts first in the rendezvous and runs rank 0, a runs rank 1: a takes b's
    steps from its own replicas, c takes rank 0's from a's own slots. Every worker's load_latest
    finds the newest step in its node's memory, equal to what was saved."""
    from torch.distributed import TCPStore

    from trainguard.cluster.stores import SignedStore
    from trainguard.events import EventBus, EventStore
    from trainguard.monitors.api import MonitorContext, StepTracker
    from trainguard.monitors.checkpoint import CheckpointMonitor

    key = JobKey.for_job("pull", single_node=False)
    run_dir = tmp_path / "run"
    events = EventStore(run_dir)
    mons = {n: CheckpointMonitor(ckpt_dir=tmp_path / f"ckpt-{n}", keep=2, shm_root=shm_root)
            for n in ("a", "b", "c")}
    stores = []

    def ctx(node: str, node_rank: int, ranks: tuple[int, ...], port: int) -> MonitorContext:
        store = SignedStore(TCPStore("127.0.0.1", port, is_master=False), key)
        return MonitorContext(run_dir=run_dir, node=node, node_rank=node_rank, nnodes=2, nproc_per_node=1,
                              world_size=2, restart_count=0, workers=[], events=EventBus(events, node),
                              steps=StepTracker(), store=store, addr="127.0.0.1", ranks=ranks)  # fmt: skip

    try:
        round1 = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        stores.append(round1)
        a1, b1 = ctx("a", 0, (0,), round1.port), ctx("b", 1, (1,), round1.port)
        _at_once([(mons["a"].on_before_start, a1), (mons["b"].on_before_start, b1)])  # first round: nothing to pull
        for mon, c in ((mons["a"], a1), (mons["b"], b1)):
            mon.worker_env(run_dir)
            mon.on_workers_started(c)
        wait_for(lambda: (mons["a"].poll(a1), mons["b"].poll(b1), mons["a"]._buddies and mons["b"]._buddies)[2],
                 what="both buddies found")  # fmt: skip
        shm = {n: mons[n].shm_dir for n in ("a", "b")}
        workers = [Checkpointer(shm["a"], tmp_path / "ckpt-a", 0, 2), Checkpointer(shm["b"], tmp_path / "ckpt-b", 1, 2)]
        try:
            for step in (1, 2, 3):
                for r, w in enumerate(workers):
                    assert w.save(_state(step, r), step, overlap=False)
                wait_for(lambda s=step: s in {read_header(p).step for p, r in replica_files(shm["a"] / REPLICAS) if r == 1},
                         what=f"rank 1's step {step} at a")
        finally:
            for w in workers:
                w.close()
        mons["b"].close()  # node b is lost with its memory and its disk
        assert not any((tmp_path / "ckpt-c").glob("**/rank-00001*"))

        round2 = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        stores.append(round2)
        runs = {"a": 1, "c": 0} if moved else {"a": 0, "c": 1}  # node -> the rank it runs in round 2
        round2_ctx = {n: ctx(n, r, (r,), round2.port) for n, r in runs.items()}
        _at_once([(mons[n].on_before_start, c) for n, c in round2_ctx.items()])
        fetched = {(e.node, e.rank, tuple(e.evidence["steps"]), e.evidence["from_node"], e.evidence["of_node"])
                   for e in events.query() if e.kind == "checkpoint_fetched"}
        expected = {("a", 1, (2, 3), "a", "b"), ("c", 0, (2, 3), "a", "a")} if moved else {("c", 1, (2, 3), "a", "b")}
        assert fetched == expected, fetched
        assert not [e for e in events.query() if e.kind == "checkpoint_fetch_failed"]
        for n, rank in runs.items():
            mons[n].worker_env(run_dir)
            worker = Checkpointer(mons[n].shm_dir, tmp_path / f"ckpt-{n}", rank, 2)
            try:
                found = worker._candidates(None, [], [])
                assert {c.step for c in found.values() if c.sources[0].kind == "memory"} >= {2, 3}, (n, found)
                got = worker.load_latest(agree=False)
                assert got["step"] == 3 and torch.equal(got["w"], _state(3, rank)["w"]), (n, got)
                assert worker.save(_state(4, rank), 4, overlap=False)  # numbered on above what was pulled
                assert worker.load_latest(agree=False)["step"] == 4
            finally:
                worker.close()
            assert not [f for f in os.listdir(mons[n].shm_dir) if f.startswith(".fetch")]
    finally:
        for mon in mons.values():
            mon.close()
        events.close()


def test_fetches_are_signed_over_the_servers_nonce_and_listings_checked(tmp_path, shm_root):
    """Without the job's key nothing is listed; a request recorded on one connection is refused on
    the next (another nonce); a listing signed with another key is not believed."""
    key = JobKey.for_job("fetch-auth", single_node=False).derive("checkpoint-replica")
    own = make_shm_dir(shm_root)
    rejected: list[str] = []
    server = ReplicaServer(own / REPLICAS, "127.0.0.1", key, rejected.append, own_dir=own, node="a")
    forger = _forging_server(key)
    worker = Checkpointer(own, tmp_path / "ckpt", 0, 2)
    peer = Buddy("a", server.addr, server.port)
    try:
        assert worker.save(_state(1, 0), 1, overlap=False)
        assert [(h.node, h.rank, h.step) for h in list_held(peer, key, [0], 2)] == [("a", 0, 1)]
        assert list_held(peer, key, [0], 3) == [] and list_held(peer, key, [1], 2) == []

        with pytest.raises((OSError, ValueError)):
            list_held(peer, b"x" * 32, [0], 2)
        wait_for(lambda: rejected, what="the unsigned fetch reported")
        assert "fetch request not signed" in rejected[0] and "\n" not in rejected[0], rejected

        body = json.dumps({"op": "list", "ranks": [0], "world": 2}).encode()
        with socket.create_connection((server.addr, server.port)) as c:
            c.sendall(FETCH_MAGIC)
            nonce = c.recv(NONCE_LEN, socket.MSG_WAITALL)
            signed = struct.pack("<I", len(body)) + body + _fetch_mac(key, _FETCH_REQUEST, nonce, body)
            c.sendall(signed)
            assert len(c.recv(4, socket.MSG_WAITALL)) == 4  # answered
        with socket.create_connection((server.addr, server.port)) as c:  # the same bytes again
            c.sendall(FETCH_MAGIC)
            assert c.recv(NONCE_LEN, socket.MSG_WAITALL) != nonce
            c.sendall(signed)
            assert c.recv(1) == b"\x00"
        wait_for(lambda: len(rejected) == 2, what="the replayed request refused")

        with pytest.raises(ValueError, match="not signed"):  # it takes our request, signs its listing with another key
            list_held(Buddy("forger", "127.0.0.1", forger.getsockname()[1]), key, [0], 2)
    finally:
        worker.close()
        server.close()
        forger.close()
        release_shm_dir(own)


def _at_once(calls: list) -> None:
    """The agents' pre-start hooks at the same time, as after a rendezvous: a node that pulls waits
    for the others to say where they serve."""
    threads = [threading.Thread(target=fn, args=(arg,)) for fn, arg in calls]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
        assert not t.is_alive()


def _forging_server(key: bytes) -> socket.socket:
    """Answers one fetch: reads the request and lists a snapshot, signed with a key not the job's."""
    sock = socket.create_server(("127.0.0.1", 0))

    def answer() -> None:
        try:
            conn, _ = sock.accept()
        except OSError:
            return
        with conn:
            conn.recv(len(FETCH_MAGIC), socket.MSG_WAITALL)
            nonce = os.urandom(NONCE_LEN)
            conn.sendall(nonce)
            (n,) = struct.unpack("<I", conn.recv(4, socket.MSG_WAITALL))
            conn.recv(n + 32, socket.MSG_WAITALL)
            body = json.dumps([_held("a", 0, 99).to_json()]).encode()
            conn.sendall(struct.pack("<I", len(body)) + body + _fetch_mac(b"z" * 32, b"\x00trainguard fetch response\x00", nonce, body))

    threading.Thread(target=answer, daemon=True).start()
    return sock

