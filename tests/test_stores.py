"""Where trainguard's stores listen (loopback with --standalone), and the job key on the values
agents act on."""

from __future__ import annotations

import psutil
import pytest
from tgtest import EXAMPLE, wait_event

from trainguard.cluster.stores import (
    JobKey,
    bound_store,
    can_connect,
    is_loopback,
    reaches_loopback,
    route_source,
)


def test_a_bound_store_listens_on_its_address_only():
    server = bound_store("127.0.0.2")
    try:
        assert can_connect("127.0.0.2", server.port, 5) is None
        assert can_connect("127.0.0.1", server.port, 5) is not None  # the same port on another address: refused
        from torch.distributed import TCPStore

        client = TCPStore("127.0.0.2", server.port, is_master=False, wait_for_workers=False)
        client.set("k", "v")
        assert server.get("k") == b"v"
        del client
    finally:
        del server


def test_job_key_binds_value_key_and_job():
    a, b = JobKey.for_job("run-7", single_node=False), JobKey.for_job("run-7", single_node=False)
    signed = a.sign("trainguard/stop", "reason")
    assert b.open("trainguard/stop", signed.encode()) == "reason"  # every node of a job derives the same key
    assert b.open("trainguard/leaving", signed) is None  # moved to another key: refused
    assert JobKey.for_job("run-8", single_node=False).open("trainguard/stop", signed) is None
    assert a.open("trainguard/stop", "reason") is None and a.open("trainguard/stop", "00:reason") is None
    assert JobKey.for_job("x", single_node=True).open("k", JobKey.for_job("x", single_node=True).sign("k", "v")) is None


def test_job_key_takes_the_shared_secret(monkeypatch):
    plain = JobKey.for_job("run-7", single_node=False).sign("k", "v")
    monkeypatch.setenv("TRAINGUARD_JOB_SECRET", "s3cret")
    assert JobKey.for_job("run-7", single_node=False).open("k", plain) is None


def test_route_source():
    assert route_source("127.0.0.1") == "127.0.0.1"
    assert route_source(None) is None and route_source("no-such-host.invalid") is None
    assert is_loopback("127.0.0.5") and is_loopback("localhost") and not is_loopback("10.0.0.1")


def test_a_node_name_mapped_to_loopback_is_loopback():
    """Slurm test beds map node names to 127.0.0.1: a loopback address for the other nodes is
    then right, not an error (the launch refused such jobs)."""
    assert reaches_loopback("localhost") and reaches_loopback("127.0.0.1")
    assert not reaches_loopback("10.0.0.1") and not reaches_loopback("no-such-host.invalid")


@pytest.mark.slow
def test_standalone_job_listens_on_loopback_only(jobs, tmp_path):
    run = tmp_path / "run"
    job = jobs("run", "--standalone", "--nproc-per-node", "2", "--run-dir", run, "--precheck", "off", "--quiet",
               EXAMPLE, "--steps", "100000", "--step-time-ms", "50")  # fmt: skip
    wait_event(run, "job_started")
    listening = [
        c.laddr for c in psutil.Process(job.proc.pid).net_connections(kind="inet") if c.status == psutil.CONN_LISTEN
    ]
    assert len(listening) >= 2, listening  # the rendezvous store and the workers' store
    assert all(is_loopback(addr.ip) for addr in listening), listening
