"""torch's etcd rendezvous (``--rdzv-backend etcd-v2``) against a real etcd server (issue 14).

The state of an etcd rendezvous lives in etcd, not on a training node: killing the node that was
group rank 0 (the one that would host c10d's store) leaves a job that goes on with the others.
In CI (CI=1) a missing etcd is a failure, never a skip: .ci/run installs etcd-server and
python-etcd.
"""

from __future__ import annotations

import datetime
import os
import subprocess
import sys

import pytest
from tgtest import EXAMPLE, events, free_port, wait_event

from trainguard.chaos import etcd_server
from trainguard.launch import runs


@pytest.fixture(scope="module")
def etcd(tmp_path_factory):
    problem = etcd_server.available()
    if problem:
        if os.environ.get("CI"):
            pytest.fail(f"{problem}: the etcd rendezvous tests must run in CI")
        pytest.skip(problem)
    with etcd_server.EtcdServer(tmp_path_factory.mktemp("etcd")) as server:
        yield server


def node_args(etcd, run, name: str, rdzv_id: str) -> list:
    return [
        "run", "--nnodes", "2:3", "--nproc-per-node", "1", "--rdzv-backend", "etcd-v2",
        "--rdzv-endpoint", etcd.endpoint, "--rdzv-id", rdzv_id, "--rdzv-conf", "last_call_timeout=2",
        "--max-restarts", "2", "--run-dir", run, "--node-name", name, "--precheck", "off", "--quiet",
    ]  # fmt: skip


def test_run_id_is_agreed_through_an_etcd_store(etcd, tmp_path):
    """EtcdStore has no compare_set: the nodes agree on one run through add + wait instead."""
    import etcd as etcd_client
    from torch.distributed.elastic.rendezvous.etcd_store import EtcdStore

    def store():
        client = etcd_client.Client(host=etcd.host, port=etcd.port)
        return EtcdStore(client, f"/tg-test/{tmp_path.name}", timeout=datetime.timedelta(seconds=30))

    first = runs.agree(store(), tmp_path, None, job="j")
    second = runs.agree(store(), tmp_path, None, job="j")
    assert second == first
    (tmp_path / "logs" / "attempt-4").mkdir(parents=True)
    late = runs.agree(store(), tmp_path, None, job="j")  # a node joining later takes the same run
    assert late == first and late.first_attempt == 0


def test_first_writer_claims_work_on_an_etcd_store(etcd, tmp_path):
    """The hang verdict and the run id are claimed first-writer-wins: on EtcdStore too."""
    import etcd as etcd_client
    from torch.distributed.elastic.rendezvous.etcd_store import EtcdStore

    from trainguard.launch import exchange

    stores = [EtcdStore(etcd_client.Client(host=etcd.host, port=etcd.port), f"/tg-claim/{tmp_path.name}",
                        timeout=datetime.timedelta(seconds=30)) for _ in range(2)]  # fmt: skip
    assert exchange.first_writer(stores[0], "verdict", "node0") == (True, b"node0")
    assert exchange.first_writer(stores[1], "verdict", "node1") == (False, b"node0")


@pytest.mark.slow
def test_job_survives_the_loss_of_its_first_node(jobs, etcd, tmp_path):
    """Three nodes; the node that is group rank 0 is SIGKILLed with its workers. The other two
    name it lost, re-form without it from the latest snapshot, and finish the job."""
    run, ckpt = tmp_path / "run", tmp_path / "ckpt"
    train = [EXAMPLE, "--steps", "120", "--step-time-ms", "50", "--ckpt", "trainguard", "--ckpt-every", "1"]
    agents = {
        name: jobs(*node_args(etcd, run, name, "etcd-kill"), "--ckpt-dir", ckpt, *train, name=name)
        for name in ("n1", "n2", "n3")
    }
    started = wait_event(run, "job_started", pred=lambda e: e.evidence["group_world_size"] == 3 and e.evidence["group_rank"] == 0)
    first = started.node
    wait_event(run, "checkpoint_persisted", pred=lambda e: e.time > started.time)
    killed = subprocess.run(
        [sys.executable, "-m", "trainguard", "chaos", str(run), "kill", "--node", first, "--what", "node"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert killed.returncode == 0, killed.stderr
    survivors = [job for name, job in agents.items() if name != first]
    for job in survivors:
        assert job.wait() == 0, job.output()
    lost = [e for e in events(run, "node_lost") if e.node != first]
    assert lost and all(first in e.evidence["nodes"] for e in lost), lost
    later = [e for e in events(run, "job_started") if e.evidence["group_world_size"] == 2]
    assert {e.node for e in later} == {n for n in agents if n != first}
    assert len({e.evidence["run_id"] for e in events(run, "job_started")}) == 1  # one run, agreed in etcd
    assert events(run, "checkpoint_loaded"), "the survivors resumed from the snapshot"
    assert len(events(run, "job_succeeded")) == 2


def test_unreachable_etcd_fails_at_once_in_one_line(jobs, etcd, tmp_path):
    job = jobs("run", "--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "etcd-v2",
               "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--rdzv-id", "gone", "--run-dir", tmp_path / "run",
               "--precheck", "off", EXAMPLE, "--steps", "2")  # fmt: skip
    assert job.wait() == 1
    out = job.output()
    assert "trainguard run: error: cannot reach the etcd-v2 rendezvous at 127.0.0.1:" in out
    assert "Connection refused" in out and "Traceback" not in out
