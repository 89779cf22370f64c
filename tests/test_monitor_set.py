"""MonitorSet: a failing monitor is reported and ignored, but a stop signal is never swallowed."""

from __future__ import annotations

import signal

import pytest
from torch.distributed.elastic.multiprocessing.api import SignalException

from trainguard.events import EventBus, EventStore
from trainguard.monitors.api import Monitor, MonitorSet
from trainguard.schedulers.adapter import STOP_SIGNALS


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


class Swallowing(Monitor):
    name = "swallowing"

    def poll(self, ctx):  # a store call guarded by a broad except, as monitors have
        try:
            raise SignalException("got signal 10", sigval=signal.SIGUSR1)
        except Exception:
            return None


def test_a_stop_signal_swallowed_inside_a_monitor_is_raised_again(tmp_path, monkeypatch):
    from trainguard import stopsignal
    from trainguard.agent import launch as api

    monkeypatch.setattr(stopsignal, "_pending", None)
    store = EventStore(tmp_path)
    monitors = MonitorSet([Swallowing()], EventBus(store, node="n0"))
    try:
        assert list(monitors.each("poll", None)) == []  # no signal came: nothing to raise
        saved = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS}  # the handler ignores further ones
        try:
            with pytest.raises(SignalException):
                api._raise_signal(signal.SIGUSR1, None)  # the agent's handler: records, then raises
        finally:
            for sig, handler in saved.items():
                signal.signal(sig, handler)
        with pytest.raises(SignalException) as got:
            list(monitors.each("poll", None))
        assert got.value.sigval == signal.SIGUSR1
        stopsignal.handled()  # the run is stopping: later calls go on
        assert list(monitors.each("poll", None)) == []
    finally:
        store.close()


def test_failure_findings_carry_the_jobs_hang_verdict():
    """A hang verdict a monitor hands over with a failure reaches the policy beside the others'."""
    from trainguard.evidence import HangEvidence
    from trainguard.monitors.api import FailureFindings

    class Verdict(Monitor):
        name = "hang"

        def on_workers_failed(self, ctx, failures):
            return HangEvidence(1, "steps", "rank 1 is stopped", recorded_by="node1")

    found = MonitorSet([Broken(), Verdict()], EventBus(None, node="n0")).on_workers_failed(None, {})
    assert found == FailureFindings(hang=HangEvidence(1, "steps", "rank 1 is stopped", recorded_by="node1"))
