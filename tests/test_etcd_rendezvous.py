"""torch's etcd rendezvous (``--rdzv-backend etcd-v2``) against a real etcd server.

The state of an etcd rendezvous lives in etcd, not on a training node: killing the node that was
group rank 0 (the one that would host c10d's store) leaves a job that goes on with the others
(the fault matrix's store-host-kill case, tests/test_faults_matrix.py, across network namespaces).
In CI (CI=1) a missing etcd is a failure, never a skip: .ci/run installs etcd-server and
python-etcd.
"""

from __future__ import annotations

import datetime
import os

import pytest
from tgtest import EXAMPLE, free_port

from trainguard.chaos import etcd_server
from trainguard.cluster import runs


@pytest.fixture(scope="module")
def etcd(tmp_path_factory):
    problem = etcd_server.available()
    if problem:
        if os.environ.get("CI"):
            pytest.fail(f"{problem}: the etcd rendezvous tests must run in CI")
        pytest.skip(problem)
    with etcd_server.EtcdServer(tmp_path_factory.mktemp("etcd")) as server:
        yield server


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

    from trainguard.cluster import exchange

    stores = [EtcdStore(etcd_client.Client(host=etcd.host, port=etcd.port), f"/tg-claim/{tmp_path.name}",
                        timeout=datetime.timedelta(seconds=30)) for _ in range(2)]  # fmt: skip
    assert exchange.first_writer(stores[0], "verdict", "node0") == (True, b"node0")
    assert exchange.first_writer(stores[1], "verdict", "node1") == (False, b"node0")


def test_unreachable_etcd_fails_at_once_in_one_line(jobs, etcd, tmp_path):
    job = jobs("run", "--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "etcd-v2",
               "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--rdzv-id", "gone", "--run-dir", tmp_path / "run",
               "--precheck", "off", EXAMPLE, "--steps", "2")  # fmt: skip
    assert job.wait() == 1
    out = job.output()
    assert "trainguard run: error: cannot reach the etcd-v2 rendezvous at 127.0.0.1:" in out
    assert "Connection refused" in out and "Traceback" not in out
