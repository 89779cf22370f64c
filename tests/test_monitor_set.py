"""MonitorSet: a failing monitor is reported and ignored, but a stop signal is never swallowed."""

from __future__ import annotations

import signal

import pytest
from torch.distributed.elastic.multiprocessing.api import SignalException

from trainguard.events import EventBus, EventStore
from trainguard.launch.monitor import Monitor, MonitorSet


class Broken(Monitor):
    name = "broken"

    def poll(self, ctx):
        raise RuntimeError("bug in a monitor")


class Interrupted(Monitor):
    name = "interrupted"

    def poll(self, ctx):  # the agent's SIGTERM handler raises wherever the main thread is
        raise SignalException("got signal 15", sigval=signal.SIGTERM)


def test_a_monitor_error_is_reported_once_and_a_stop_signal_goes_through(tmp_path):
    store = EventStore(tmp_path)
    try:
        monitors = MonitorSet([Broken()], EventBus(store, node="n0"))
        assert list(monitors.each("poll", None)) == [] and list(monitors.each("poll", None)) == []
        assert [e.kind for e in store.query()] == ["monitor_error"]
        # Slurm's SIGTERM during a checkpoint monitor's poll was swallowed as a monitor_error:
        # the node then never recorded job_preempted and its workers were killed unpersisted.
        with pytest.raises(SignalException):
            list(MonitorSet([Interrupted()], EventBus(store, node="n0")).each("poll", None))
    finally:
        store.close()


def test_failure_findings_carry_the_jobs_hang_verdict():
    """A hang verdict a monitor hands over with a failure reaches the policy beside the others'."""
    from trainguard.evidence import HangEvidence
    from trainguard.launch.monitor import FailureFindings

    class Verdict(Monitor):
        name = "hang"

        def on_workers_failed(self, ctx, failures):
            return HangEvidence(1, "steps", "rank 1 is stopped", recorded_by="node1")

    found = MonitorSet([Broken(), Verdict()], EventBus(None, node="n0")).on_workers_failed(None, {})
    assert found == FailureFindings(hang=HangEvidence(1, "steps", "rank 1 is stopped", recorded_by="node1"))
