"""--standby (agent/standby.py, issue 31) against torch's real c10d rendezvous, without processes:
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

from trainguard.agent import standby
from trainguard.cluster.stores import bound_store

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
