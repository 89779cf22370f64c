"""MonitorSet: a failing monitor is reported and ignored, but a stop signal is never swallowed."""

from __future__ import annotations

import os
import signal
import time

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


class SignalledInsideBroadExcept(Monitor):
    """A monitor whose own broad except is where a stop signal lands (as a SIGINT during its
    Thread.start once did: it surfaced as a KeyError)."""

    name = "signalled"

    def poll(self, ctx):
        try:
            os.kill(os.getpid(), signal.SIGINT)
            for _ in range(1000):  # the handler runs at the next bytecode boundary
                time.sleep(0.001)
        except Exception:
            return None


def test_a_stop_signal_under_torchs_handler_is_reclaimed_and_never_lost(tmp_path, monkeypatch):
    """torch's PContext.start registers its own handler for the stop signals each time workers
    start; it records nothing, so a signal it raised inside a broad except was lost for good.
    The worker start (TrainguardPContext._start) gives the signals back to the agent's handler."""
    from torch.distributed.elastic.multiprocessing import api as torch_api

    from trainguard import stopsignal
    from trainguard.agent import launch

    monkeypatch.setattr(stopsignal, "_pending", None)
    monkeypatch.setattr(stopsignal, "_handler", None)
    saved = {sig: signal.getsignal(sig) for sig in (*STOP_SIGNALS, signal.SIGINT)}
    store = EventStore(tmp_path)
    monitors = MonitorSet([SignalledInsideBroadExcept()], EventBus(store, node="n0"))
    try:
        signal.signal(signal.SIGINT, torch_api._terminate_process_handler)  # what PContext.start does
        assert list(monitors.each("poll", None)) == []  # the stop is lost: the failure this fixes
        assert stopsignal.reclaim() == []  # the agent has not said which handler is its own yet
        stopsignal.set_handler(launch._raise_signal)
        signal.signal(signal.SIGINT, torch_api._terminate_process_handler)
        assert signal.SIGINT in stopsignal.reclaim()
        assert signal.getsignal(signal.SIGINT) is launch._raise_signal
        with pytest.raises(SignalException) as got:
            list(monitors.each("poll", None))
        assert got.value.sigval == signal.SIGINT
        signal.signal(signal.SIGINT, torch_api._terminate_process_handler)
        assert stopsignal.reclaim() == []  # a stop under way: its handling is left as it is
        stopsignal.handled()
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)
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
