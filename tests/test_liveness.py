"""The liveness monitor on a real TCPStore: a node that stops heartbeating is lost only while this
node's ranks make no progress; a node that finished is never lost."""

from __future__ import annotations

import contextlib
import time

from tgtest import wait_for
from torch.distributed import TCPStore

from trainguard.detect.nodeloss import DONE, Beat, late_nodes, to_probe
from trainguard.events import EventBus, EventStore
from trainguard.evidence import RankFailure
from trainguard.monitors.api import MonitorContext, StepSample, StepTracker, WorkerInfo
from trainguard.monitors.liveness import LivenessMonitor, LivenessSettings

FAST = LivenessSettings(interval_s=0.05, lost_after_s=0.6)


def contexts(tmp_path, server, db):
    return [
        MonitorContext(run_dir=tmp_path, node=f"n{n}", node_rank=n, nnodes=2, nproc_per_node=1, world_size=2,
                       restart_count=0, workers=[WorkerInfo(0, n, 1)], events=EventBus(db, f"n{n}"), steps=StepTracker(),
                       store=server, rdzv_backend="c10d", addr="127.0.0.1", rdzv_node=f"desc-{n}")  # fmt: skip
        for n in (0, 1)
    ]


@contextlib.contextmanager
def two_agents(tmp_path, settings: LivenessSettings):
    """Two liveness monitors beating through one real TCPStore, each seen by the other."""
    server = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    db = EventStore(tmp_path)
    a, b = LivenessMonitor(settings), LivenessMonitor(settings)
    try:
        ca, cb = contexts(tmp_path, server, db)
        a.on_workers_started(ca)
        b.on_workers_started(cb)
        wait_for(lambda: a._peers.get(1), 10, "node 1 seen")
        yield server, db, a, b, ca
    finally:
        a.close()
        b.close()
        db.close()
        del server


def test_silent_node_is_lost_only_while_training_is_blocked(tmp_path):
    with two_agents(tmp_path, FAST) as (_, db, a, b, ca):
        b._halt()  # node 1 goes silent (its agent died)
        step = 0
        end = time.monotonic() + 2 * FAST.lost_after_s
        while time.monotonic() < end:  # our rank keeps stepping: a silent node is only late
            step += 1
            ca.steps.record(StepSample(0, step, time.time(), 0.01))
            assert a.poll(ca) is None
            time.sleep(0.05)
        lost = wait_for(lambda: a.poll(ca), 10, "node_lost once training blocks")
        assert list(lost.nodes) == ["n1"] and lost.rdzv_nodes == ["desc-1"]
        assert "no heartbeat" in lost.nodes["n1"] and "127.0.0.1 answers" in lost.nodes["n1"]
        assert [e.kind for e in db.query(kinds=["node_lost"])] == ["node_lost"]
        assert a.poll(ca) is None  # reported once per round


def test_a_node_that_finished_is_not_lost(tmp_path):
    with two_agents(tmp_path, FAST) as (_, _db, a, b, ca):
        b.close()  # finished: marks itself done
        wait_for(lambda: a._seen.get(1, (0,))[0] == -1, 10, "node 1 seen done")
        time.sleep(2 * FAST.lost_after_s)  # longer than --node-lost-after, no steps here
        assert a.poll(ca) is None


def test_a_node_slow_to_start_its_workers_is_not_lost(tmp_path):
    """A rejoining node whose first start was slow under load was declared lost after the
    4 s heartbeat deadline. A node that has not started its workers in this round gets the start-up
    allowance; once it has started, its silence counts from the heartbeat deadline again."""
    server = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    db = EventStore(tmp_path)
    settings = LivenessSettings(interval_s=0.05, lost_after_s=0.6, startup_s=60.0)
    a, b = LivenessMonitor(settings), LivenessMonitor(settings)
    try:
        ca, cb = contexts(tmp_path, server, db)
        b.on_before_start(cb)  # the round formed; node 1's workers are still starting
        a.on_workers_started(ca)
        wait_for(lambda: a._peers.get(1) and 1 in a._seen, 10, "node 1 published, its counter read")
        wait_for(lambda: a._late() == {} and time.monotonic() - a._seen[1][1] > 3 * settings.lost_after_s, 10,
                 "node 1 silent well past --node-lost-after")  # fmt: skip
        assert a.poll(ca) is None  # no step here either: before the fix, node_lost
        b.on_workers_started(cb)
        wait_for(lambda: a._seen[1][0] > 0, 10, "node 1 beats")
        b._halt()  # started, then silent: the heartbeat deadline again
        lost = wait_for(lambda: a.poll(ca), 10, "node_lost after the heartbeat deadline")
        assert list(lost.nodes) == ["n1"] and "no heartbeat" in lost.nodes["n1"]
    finally:
        a.close()
        b.close()
        db.close()
        del server


def test_node_loss_rule_over_samples():
    """detect.nodeloss: the heartbeat deadline for a node that beat this round; the start-up
    allowance for one that has not, unless its address is proven unreachable; never a finished one."""
    beats = {
        1: Beat(count=5, moved=0.0),  # beat, then silent
        2: Beat(count=0, moved=0.0),  # still starting its workers
        3: Beat(count=0, moved=0.0, unreachable=True),  # starting, address unreachable: proof
        4: Beat(count=DONE, moved=0.0),  # finished
    }
    assert late_nodes(beats, now=3.9, lost_after_s=4.0, startup_s=30.0) == {}
    assert late_nodes(beats, now=4.0, lost_after_s=4.0, startup_s=30.0) == {1: 4.0, 3: 4.0}
    assert late_nodes(beats, now=30.0, lost_after_s=4.0, startup_s=30.0) == {1: 30.0, 2: 30.0, 3: 30.0}
    assert late_nodes(beats, now=5.0, lost_after_s=4.0, startup_s=1.0) == {1: 5.0, 2: 5.0, 3: 5.0}  # never below the deadline
    assert to_probe(beats, now=4.0, lost_after_s=4.0) == [2]  # 3 is proven already; 1 beat
    assert to_probe(beats, now=3.0, lost_after_s=4.0) == []


PEER_LOST = RankFailure(0, 1, 1, log_tail=("RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:534] "
                                           "Connection closed by peer [127.0.0.1]:40123",), first_failure=True)


def test_a_lost_peer_whose_agent_still_beats_is_a_worker_failure_there(tmp_path):
    """This node's rank only lost its peer: the other agent beats on (its worker failed, its agent
    restarts it), so no node is lost; proven from reads that began after the failure."""
    from trainguard.spawn.failures import lost_peer

    assert lost_peer(PEER_LOST)
    with two_agents(tmp_path, LivenessSettings(interval_s=0.2, lost_after_s=3.0)) as (_, db, a, _b, ca):
        assert a.on_workers_failed(ca, {0: PEER_LOST}) is None
        assert db.query(kinds=["node_lost"]) == []
        assert not a._hurry.is_set()  # back to its own pace


def test_a_node_that_beat_just_before_it_died_is_named_lost(tmp_path):
    """The race the baseline guards against: node 1's last beat lands just before it dies and our
    rank notices; that beat must not count as a sign of life."""
    with two_agents(tmp_path, LivenessSettings(interval_s=0.2, lost_after_s=1.0)) as (server, db, a, b, ca):
        b._halt()  # dies right after its last beat ...
        server.add("trainguard/alive/n1", 1)  # ... which reaches the store as our rank fails
        lost = a.on_workers_failed(ca, {0: PEER_LOST})
        assert lost is not None and list(lost.nodes) == ["n1"]
        assert [e.kind for e in db.query(kinds=["node_lost"])] == ["node_lost"]
