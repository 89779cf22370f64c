"""The agent's parts that are not torch: failure ordering (spawn/failures.py) and messages between
agents through a real TCPStore on 127.0.0.1 (cluster/peers.py)."""

from __future__ import annotations

import threading

from tgtest import wait_for
from torch.distributed import TCPStore

from trainguard.cluster.peers import LEAVING_KEY, STOP_KEY, Peers
from trainguard.cluster.stores import JobKey
from trainguard.evidence import PeerLeft, PeerStop, RankFailure
from trainguard.spawn import failures as F

PEER_GONE = "RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:4312"


def failure(local_rank, t, tail=(), message=None, collateral=False, exit_time=None):
    return RankFailure(local_rank=local_rank, pid=100 + local_rank, exitcode=1, timestamp=t, exit_time=exit_time,
                       log_tail=tuple(tail), message=message, collateral=collateral)  # fmt: skip


def test_first_failure_first_and_its_cascade_left_out():
    fs = F.order({
        0: failure(0, 10.0, tail=["step=5", PEER_GONE]),  # died of losing rank 1
        1: failure(1, 10.5, exit_time=9.0),  # the exact exit time says it went first
        2: failure(2, 11.0, tail=["ValueError: bad batch"]),  # its own error, later
        3: failure(3, 12.0, collateral=True),  # stopped by the agent
    })  # fmt: skip
    assert list(fs.failures) == [1, 2]
    assert fs.failures[1].first_failure and not fs.failures[2].first_failure
    assert fs.stopped == [0, 3] and not fs.remote


def test_only_lost_peers_here_means_the_cause_is_on_another_node():
    message = {"message": PEER_GONE, "extraInfo": {"py_callstack": "...", "timestamp": "1795250000"}}
    fs = F.order({0: failure(0, 10.0, message=message), 1: failure(1, 10.2, tail=[PEER_GONE])})
    assert list(fs.failures) == [0] and fs.remote and fs.stopped == [1]


def test_a_killed_rank_noted_just_after_the_peer_that_lost_it_is_the_first_failure():
    """Two waiter threads under load note rank 3's SIGKILL 2 ms after rank 2's exit of losing it
    (seen in the full suite): the cause is here, rank 3, not on another node."""
    lost = failure(0, 10.0, tail=["step=6 rank=2", PEER_GONE], exit_time=43.490)
    killed = RankFailure(local_rank=1, pid=101, exitcode=-9, signal="SIGKILL", timestamp=10.0, exit_time=43.492,
                         log_tail=("step=6 rank=3",))  # fmt: skip
    fs = F.order({2: lost, 3: killed})
    assert list(fs.failures) == [3] and fs.failures[3].first_failure and not fs.remote and fs.stopped == [2]
    # a signal death long after the loss is not taken for its cause: the cause stays elsewhere
    later = RankFailure(local_rank=1, pid=101, exitcode=-9, signal="SIGKILL", timestamp=10.0, exit_time=45.0)
    fs = F.order({2: lost, 3: later})
    assert list(fs.failures)[0] == 2 and fs.remote


def test_a_rank_that_raised_noted_just_after_the_peer_that_lost_it_is_the_first_failure():
    """The same race with an exception (seen in a full-suite run of .ci/run): rank 1 raised
    ValueError, rank 0 lost it, and rank 0's exit was noted 6 ms earlier. The cause is rank 1,
    here: not "a peer on another node" on a single-node job."""
    lost = failure(0, 10.0, tail=["step=3 rank=0", PEER_GONE], exit_time=40.9071)
    raised = failure(1, 10.0, tail=["ValueError: bad batch shape"], exit_time=40.9133)
    fs = F.order({0: lost, 1: raised})
    assert list(fs.failures) == [1] and fs.failures[1].first_failure and not fs.remote and fs.stopped == [0]
    assert fs.own == [1]
    # past the slack, the times order them again: the peer loss came first, its cause elsewhere
    fs = F.order({0: lost, 1: failure(1, 10.0, tail=["ValueError: bad batch shape"], exit_time=42.0)})
    assert list(fs.failures) == [0, 1] and fs.remote


def test_all_collateral_keeps_everything():
    fs = F.order({0: failure(0, 2.0, collateral=True), 1: failure(1, 1.0, collateral=True)})
    assert list(fs.failures) == [1, 0] and fs.stopped == []


def test_failure_evidence_keys_stay_the_same():
    d = failure(0, 1.0, tail=["x"]).to_dict()
    assert set(d) == {"local_rank", "pid", "exitcode", "signal", "error_file_data", "message", "timestamp",
                      "exit_time", "log_tail", "collateral", "first_failure"}  # fmt: skip
    assert d["log_tail"] == ["x"]


def test_agents_tell_each_other_through_the_store():
    server = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    try:
        key = JobKey.for_job("job-1", single_node=False)
        a, b = Peers("node-a", key), Peers("node-b", key)
        assert b.news(server, 2, force=True) is None
        assert a.news(None, 2, force=True) is None and a.news(server, 1, force=True) is None  # alone: no one to hear
        a.announce_leaving(server)
        assert b.news(server, 2, force=True) == PeerLeft("node-a")
        assert b.news(server, 2) is None  # looked up at most once a second unless forced
        # the stopping agent waits until the other has read the stop (it may host the store)
        stopper = threading.Thread(target=b.stop_everywhere, args=(server, 2, "user code failed", 600.0), daemon=True)
        stopper.start()
        assert wait_for(lambda s=server: a.news(s, 2, force=True) == PeerStop("user code failed (decided on node-b)"))
        stopper.join(60)
        assert not stopper.is_alive()  # returned on the acknowledgement, long before its 600 s
        b.stop_everywhere(None, 2, "nothing happens without a store")
        Peers.leave_rendezvous(object())  # a handler torch cannot leave: logged, never raised
    finally:
        del server


def test_a_stray_stop_without_the_job_key_is_ignored_and_reported():
    server = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    try:
        rejected = []
        mine = Peers("node-a", JobKey.for_job("job-1", single_node=False), on_rejected=lambda k, v: rejected.append((k, v)))
        other_job = Peers("node-x", JobKey.for_job("job-2", single_node=False))
        server.set(STOP_KEY, "stop now")  # a stray client: no MAC at all
        assert mine.news(server, 2, force=True) is None
        other_job.stop_everywhere(server, 2, "another job's decision", wait_s=0)  # signed, with another job's key
        assert mine.news(server, 2, force=True) is None
        other_job.announce_leaving(server)
        assert mine.news(server, 2, force=True) is None
        assert [k for k, _ in rejected] == [STOP_KEY, STOP_KEY, LEAVING_KEY]  # each forged value reported once
        assert mine.news(server, 2, force=True) is None and len(rejected) == 3
        # this job's own LEAVING value replayed as STOP does not verify: the MAC covers the key's name
        Peers("node-b", mine.key).announce_leaving(server)
        server.set(STOP_KEY, server.get(LEAVING_KEY))
        assert mine.news(server, 2, force=True) == PeerLeft("node-b")
    finally:
        del server


def test_own_failures_are_those_that_neither_the_agent_stopped_nor_only_lost_a_peer():
    """FailureSet.own (the restart-loop guard's "failed of its own accord") from what order() found."""
    killed = RankFailure(local_rank=1, pid=101, exitcode=-9, signal="SIGKILL", timestamp=10.0, exit_time=43.492)
    cases = [
        {0: failure(0, 10.0, tail=["step=5", PEER_GONE]), 1: failure(1, 10.5, exit_time=9.0),
         2: failure(2, 11.0, tail=["ValueError: bad batch"]), 3: failure(3, 12.0, collateral=True)},
        {0: failure(0, 10.0, tail=[PEER_GONE]), 1: failure(1, 10.2, tail=[PEER_GONE])},
        {2: failure(0, 10.0, tail=[PEER_GONE], exit_time=43.490), 3: killed},
        {0: failure(0, 2.0, collateral=True), 1: failure(1, 1.0, collateral=True)},
    ]  # fmt: skip
    owns = [F.order(c).own for c in cases]
    assert owns == [[1, 2], [], [3], []]
    for c, own in zip(cases, owns, strict=True):  # the same as judging every kept failure again
        kept = F.order(c).failures
        assert own == sorted(r for r, f in kept.items() if not f.collateral and not F.lost_peer(f))
