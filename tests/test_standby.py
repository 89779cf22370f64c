"""--standby (agent/standby.py) against torch's real c10d rendezvous, without processes:
a standby joins only once the job's round has formed (so it never takes an active node's place),
says so, and ends quietly when the job ended first. The whole path (a node killed, the standby
promoted, the world size kept) is the fault matrix's kill-node-standby row (bench/faults.py)."""

from __future__ import annotations

import threading
from itertools import count

import pytest
from tgtest import wait_for
from torch.distributed.elastic.rendezvous import RendezvousGracefulExitError, RendezvousParameters
from torch.distributed.elastic.rendezvous import registry as rdzv_registry

from trainguard import torch_compat
from trainguard.agent import standby
from trainguard.cluster.stores import JobKey, SignedStore, bound_store

_ids = count()


@pytest.fixture
def job():
    """Two handlers of one c10d rendezvous (--nnodes 1:1) on a loopback store: the job's node and a standby's."""
    server = bound_store("127.0.0.1", multi_tenant=True)
    params = dict(backend="c10d", endpoint=f"127.0.0.1:{server.port}", run_id=f"standby-{next(_ids)}", min_nodes=1,
                  max_nodes=1, join_timeout=60, last_call_timeout=1, is_host=False)  # fmt: skip
    handlers = [rdzv_registry.get_rendezvous_handler(RendezvousParameters(**params)) for _ in range(2)]
    yield handlers
    handlers[0].shutdown()
    del server


def test_a_standby_joins_once_the_round_formed_and_says_so(job):
    node, spare = job
    said: list[tuple[str, str, dict]] = []
    done = threading.Event()

    def emit(kind: str, message: str, evidence: dict) -> None:
        said.append((kind, message, evidence))

    waiter = threading.Thread(target=lambda: (standby.await_formed_round(spare, emit, "n2", poll_s=0.05), done.set()),
                              daemon=True)  # fmt: skip
    waiter.start()
    assert not said and not done.is_set()  # no round yet: it cannot have joined (that would take a place)
    node.next_rendezvous()
    wait_for(done.is_set, what="the standby to see the round formed")
    (kind, message, evidence), = said
    assert kind == "standby_joined" and "node n2 waits as a standby" in message and "1 of 1 nodes" in message
    assert evidence == {"node": "n2", "participants": 1, "max_nodes": 1}


def test_a_standby_whose_job_ended_first_leaves_quietly(job):
    node, spare = job
    node.next_rendezvous()
    node.shutdown()  # the job ended: its rendezvous is closed
    with pytest.raises(RendezvousGracefulExitError):  # torch's agent ends its run on it, without a failure
        standby.await_formed_round(spare, lambda *a, **k: pytest.fail("joined a closed job"), "n2", poll_s=0.05)


# ------------------------------------------------------------------ a standby takes only a place freed for good
# A whole-job restart takes every participant out of the round for a moment; torch moves a standby
# off its redundancy list at the first gap, and it raced a slower healthy node into the next round
# (bench/soak.py's standby row, 2026-11-29: n4 took rank 2 from n3, whose newest snapshot then had to
# come back from disk). Healthy case: a restart keeps the round's own nodes. Faulty cases: a node
# lost, said by a survivor (at once) or not said at all (after the grace), lets the standby in.


class _State:
    def __init__(self, participants=(), wait_list=(), complete=True, round=3):
        self.participants = {p: 0 for p in participants}
        self.wait_list = set(wait_list)
        self.complete, self.round = complete, round


def test_vacancy_ignores_a_participant_on_its_way_back():
    asked: list[int] = []
    v = standby.Vacancy(lambda r: asked.append(r) or False, grace_s=5.0, clock=lambda: 0.0)
    assert not v(_State(["a", "b"]), 2)  # full round
    assert not v(_State(["b"], wait_list=["a"]), 2)  # a restarts: it is on the wait list
    assert not v(_State([], wait_list=["a", "b"], complete=False, round=4), 2)  # the round emptied, both come back
    assert asked == []  # nothing short: no need to ask whether a place was freed


def test_vacancy_takes_a_place_said_freed_at_once_and_an_unsaid_one_after_the_grace():
    now = [100.0]
    said: set[int] = set()
    v = standby.Vacancy(lambda r: r in said, grace_s=5.0, clock=lambda: now[0])
    assert not v(_State(["a", "b"], round=7), 2)
    assert not v(_State(["a"], round=7), 2)  # b gone from the state, nobody said so yet
    now[0] += 4.9
    assert not v(_State(["a"], round=7), 2)
    said.add(7)
    assert v(_State(["a"], round=7), 2)  # a survivor's word for round 7: at once
    w = standby.Vacancy(lambda r: False, grace_s=5.0, clock=lambda: now[0])
    assert not w(_State(["a"], round=7), 2)
    now[0] += 5.0
    assert w(_State(["a"], round=7), 2)  # unsaid (the node died before anyone could say): after the grace
    assert not w(_State(["a", "c"], round=8), 2)  # full again: the grace starts over
    assert not w(_State(["a"], round=8), 2)


def test_vacancy_takes_a_place_said_freed_when_it_first_sees_the_gap_in_the_next_round():
    """The survivors say the round they lost a node in (7); a standby that polls once a second may
    first see the gap after they left it, while the next round (8) forms: it remembers 7 from
    its looks at the full round (fault matrix, kill-node-standby: the world shrank to 2 first)."""
    said = {7}
    v = standby.Vacancy(lambda r: r in said, grace_s=600.0, clock=lambda: 0.0)
    assert not v(_State(["a", "b", "c"], round=7), 3)
    assert v(_State(["a"], wait_list=["b"], complete=False, round=8), 3)


def _state(handler):
    holder = handler._state_holder
    with handler._heartbeat_lock:
        holder.sync()
        return holder.state


def _in_thread(fn) -> threading.Thread:
    t = threading.Thread(target=fn, daemon=True)
    t.start()
    return t


def _rejoin(handler) -> threading.Thread:
    """A node's next round, as the agent joins it (rank 0 publishes the round's address afresh)."""
    torch_compat.forget_rendezvous_bootstrap(handler)
    return _in_thread(handler.next_rendezvous)


@pytest.fixture
def pair_and_spare():
    """A job of two nodes (--nnodes 2) on a real c10d rendezvous, its round formed, and a third
    handler for the standby."""
    server = bound_store("127.0.0.1", multi_tenant=True)
    params = dict(backend="c10d", endpoint=f"127.0.0.1:{server.port}", run_id=f"spare-{next(_ids)}", min_nodes=2,
                  max_nodes=2, join_timeout=120, last_call_timeout=1, is_host=False)  # fmt: skip
    a, b, s = (rdzv_registry.get_rendezvous_handler(RendezvousParameters(**params)) for _ in range(3))
    joining = _in_thread(b.next_rendezvous)
    a.next_rendezvous()
    joining.join(timeout=120)
    assert not joining.is_alive() and _state(a).complete and len(_state(a).participants) == 2
    yield a, b, s
    a.shutdown()
    del server


def _hold(spare, said_freed, grace_s: float):
    asked = [0]
    vacancy = standby.Vacancy(said_freed, grace_s=grace_s)

    def may_leave(state, max_nodes):
        asked[0] += 1
        return vacancy(state, max_nodes)

    torch_compat.hold_on_redundancy_list(spare, may_leave)
    ended: list[BaseException] = []

    def wait_as_standby() -> None:
        try:
            spare.next_rendezvous()
        except BaseException as exc:  # the job closed while it waited: said by the test
            ended.append(exc)

    waiter = _in_thread(wait_as_standby)
    waiter.ended = ended
    wait_for(lambda: torch_compat.rendezvous_standbys(spare) == 1, what="the standby on the redundancy list")
    return waiter, asked


def _rejoin_and_see_the_standby_in(a, spare, waiter) -> None:
    """The survivor ``a`` forms the next round: the standby is in it, in the lost node's place."""
    back_a = _rejoin(a)
    waiter.join(timeout=120)
    back_a.join(timeout=120)
    state = _state(a)
    assert not waiter.is_alive() and not waiter.ended and not back_a.is_alive()
    assert state.complete and set(state.participants) == {a._this_node, spare._this_node}


def test_a_restart_keeps_the_rounds_own_nodes_ahead_of_a_standby(pair_and_spare):
    a, b, spare = pair_and_spare
    waiter, asked = _hold(spare, lambda r: False, grace_s=3.0)
    back_a = _rejoin(a)  # a restarts first; b is slower to stop its workers
    wait_for(lambda: a._this_node in _state(b).wait_list, what="a on the wait list")
    seen = asked[0]
    # torch alone moves the standby off its redundancy list at once; held, it looks at the gap a few times
    wait_for(lambda: asked[0] >= seen + 3 or spare._this_node not in _state(b).redundancy_list,
             what="the standby to look at the gap a few times")  # fmt: skip
    back_b = _rejoin(b)
    back_a.join(timeout=120)
    back_b.join(timeout=120)
    state = _state(a)
    assert state.complete and set(state.participants) == {a._this_node, b._this_node}
    assert spare._this_node in state.redundancy_list and waiter.is_alive()
    a.shutdown()  # the job ends: the standby leaves quietly
    waiter.join(timeout=120)
    assert waiter.ended and isinstance(waiter.ended[0], RendezvousGracefulExitError), waiter.ended


def test_a_node_lost_and_said_lets_the_standby_in_at_once(pair_and_spare):
    a, b, spare = pair_and_spare
    key = JobKey(b"k" * 32)
    rejected: list[str] = []
    spare_side = SignedStore(spare._store, key, lambda k, raw: rejected.append(k))
    waiter, asked = _hold(spare, lambda r: standby.freed(spare_side, r), grace_s=600.0)
    b._stop_heartbeats()  # b's host is gone
    assert torch_compat.expire_rendezvous_node(a, repr(b._this_node))
    rnd = torch_compat.rendezvous_round_number(a)
    a._store.set(f"{standby.FREED_KEY}/{rnd}", "not signed")  # a forged word is not obeyed
    seen = asked[0]
    wait_for(lambda: rejected and asked[0] >= seen + 2, what="the forged word read and refused")
    assert spare._this_node in _state(a).redundancy_list
    standby.say_freed(SignedStore(a._store, key), rnd, [repr(b._this_node)])
    _rejoin_and_see_the_standby_in(a, spare, waiter)


def test_a_node_lost_unsaid_lets_the_standby_in_after_the_grace(pair_and_spare):
    a, b, spare = pair_and_spare
    waiter, _ = _hold(spare, lambda r: False, grace_s=1.0)
    b._stop_heartbeats()
    assert torch_compat.expire_rendezvous_node(a, repr(b._this_node))
    _rejoin_and_see_the_standby_in(a, spare, waiter)
