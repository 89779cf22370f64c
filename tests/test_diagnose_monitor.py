"""The diagnosis monitor: diagnose the attempt's rank logs on worker failure, emit a `diagnosis` event."""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

from trainguard.events import EventBus
from trainguard.events.store import EventStore
from trainguard.evidence import Diagnosis, RankFailure
from trainguard.monitors import diagnosis as diagnosis_monitor
from trainguard.monitors.api import MonitorContext, StepTracker, WorkerInfo

CORPUS = Path(__file__).resolve().parent / "corpus"


def _ctx(run_dir: Path, restart_count: int = 1) -> tuple[MonitorContext, EventStore]:
    store = EventStore(run_dir)
    ctx = MonitorContext(
        run_dir=run_dir, node="node-a", node_rank=0, nnodes=1, nproc_per_node=2, world_size=2,
        restart_count=restart_count, workers=[WorkerInfo(0, 0, 100), WorkerInfo(1, 1, 101)],
        events=EventBus(store, "node-a"), steps=StepTracker(),
    )  # fmt: skip
    return ctx, store


def _options(*argv: str) -> diagnosis_monitor.DiagnosisSettings:
    """The monitor's settings from its `trainguard run` flags (what the run's settings builder reads)."""
    p = argparse.ArgumentParser()
    diagnosis_monitor.add_run_arguments(p.add_argument_group("diagnosis"))
    return diagnosis_monitor.settings(p.parse_args(list(argv)))


def _sigkill_failures() -> dict[int, RankFailure]:
    return {
        0: RankFailure(local_rank=0, pid=100, exitcode=1),
        1: RankFailure(local_rank=1, pid=101, exitcode=-9, signal="SIGKILL"),
    }


def test_monitor_diagnoses_the_attempt_logs_and_emits_an_event(tmp_path: Path):
    attempt = tmp_path / "logs" / "attempt-1"
    shutil.copytree(CORPUS / "killed_external" / "sigkill", attempt)
    ctx, store = _ctx(tmp_path)
    mon = diagnosis_monitor.create(_options())
    try:
        d = mon.on_workers_failed(ctx, _sigkill_failures())
        assert isinstance(d, Diagnosis)
        # a SIGKILL with a silent log and no OOM-killer evidence: killed from outside, not host OOM
        assert d.category == "killed_external" and d.first_failure["rank"] == 1 and d.details["attempt"] == 1
        (ev,) = store.query(kinds=["diagnosis"])
        assert ev.rank == 1 and ev.severity.label == "error" and ev.evidence["category"] == "killed_external"
        assert "SIGKILL" in ev.evidence["first_failure"]["line"]
    finally:
        store.close()


def test_monitor_uses_error_file_data_and_log_tails_without_logs(tmp_path: Path):
    ctx, store = _ctx(tmp_path, restart_count=0)
    mon = diagnosis_monitor.create(_options("--diagnose-max-mb", "1"))
    try:
        failures = {1: RankFailure(local_rank=1, pid=101, exitcode=1,
                                   error_file_data={"message": {"message": "OSError: [Errno 28] No space left on device",
                                                                "extraInfo": {"py_callstack": "...", "timestamp": "1795253401"}}})}  # fmt: skip
        assert mon.on_workers_failed(ctx, failures).category == "disk_full_or_io"
        failures = {0: RankFailure(local_rank=0, pid=100, exitcode=1,
                                   log_tail=("step=3 rank=0", "RuntimeError: DataLoader worker (pid(s) 4242) exited unexpectedly"))}  # fmt: skip
        assert mon.on_workers_failed(ctx, failures).category == "dataloader"
        assert [e.evidence["category"] for e in store.query(kinds=["diagnosis"])] == [
            "disk_full_or_io",
            "dataloader",
        ]
    finally:
        store.close()


def test_a_node_whose_ranks_only_lost_their_peer_points_elsewhere(tmp_path: Path):
    """A node whose first failure is a closed gloo connection did not cause it: its diagnosis says
    the cause is on another node instead of blaming the network; a real failure here is unchanged."""
    ctx, store = _ctx(tmp_path, restart_count=0)
    mon = diagnosis_monitor.create(_options())
    lost = "RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer [10.0.0.3]:41522"
    try:
        failures = {1: RankFailure(local_rank=1, pid=101, exitcode=1, log_tail=("step=7 rank=1", lost), first_failure=True)}
        d = mon.on_workers_failed(ctx, failures)
        assert d.summary.startswith("lost a peer on another node") and d.details["cause_elsewhere"] is True
        assert "other nodes' events" in d.fix
        failures = {1: RankFailure(local_rank=1, pid=101, exitcode=-9, signal="SIGKILL", first_failure=True),
                    0: RankFailure(local_rank=0, pid=100, exitcode=1, log_tail=(lost,))}  # fmt: skip
        d = mon.on_workers_failed(ctx, failures)
        assert not d.summary.startswith("lost a peer") and "cause_elsewhere" not in d.details
    finally:
        store.close()


def test_monitor_never_raises_and_can_be_switched_off(tmp_path: Path):
    assert diagnosis_monitor.create(_options("--no-diagnose")) is None
    ctx, store = _ctx(tmp_path)
    try:
        mon = diagnosis_monitor.create(_options())
        assert mon.on_workers_failed(ctx, {"not-a-rank": "garbage"}).category == "unknown"  # type: ignore[dict-item]
        assert store.query(kinds=["diagnosis"])
    finally:
        store.close()


class _Counters:
    """Stands in for the kernel's oom_kill counter files: a real file the test bumps."""

    def __init__(self, path: Path) -> None:
        self.path = path
        path.write_text("oom_kill_disable 0\nunder_oom 0\noom_kill 0\n")

    def bump(self) -> None:
        self.path.write_text("oom_kill_disable 0\nunder_oom 0\noom_kill 1\n")


def test_monitor_calls_a_sigkill_host_oom_only_when_the_oom_counter_moved(tmp_path: Path, monkeypatch):
    from trainguard.probes import oom

    counter = _Counters(tmp_path / "memory.oom_control")
    monkeypatch.setattr(oom, "files_for", lambda pids=(): [str(counter.path)])
    attempt = tmp_path / "logs" / "attempt-1"
    shutil.copytree(CORPUS / "killed_external" / "sigkill", attempt)
    ctx, store = _ctx(tmp_path)
    mon = diagnosis_monitor.create(_options())
    try:
        mon.on_workers_started(ctx)
        quiet = mon.on_workers_failed(ctx, _sigkill_failures())
        assert quiet.category == "killed_external" and quiet.details["oom_check"]["moved"] is False
        assert "the kernel's oom_kill counters did not move" in quiet.summary
        mon.on_workers_started(ctx)
        counter.bump()  # the kernel's OOM killer fired during this attempt
        d = mon.on_workers_failed(ctx, _sigkill_failures())
        assert d.category == "host_oom" and d.first_failure["rank"] == 1 and d.confidence == "high"
        assert any("oom_kill event" in e["line"] for e in d.evidence)
    finally:
        store.close()


def test_live_a_killed_dataloader_worker_is_diagnosed_then_restarted_by_the_policy(tmp_path: Path):
    """A signal killed the DataLoader worker (often the OOM killer): retry, not stop."""
    from trainguard import policy

    attempt = tmp_path / "logs" / "attempt-0"
    attempt.mkdir(parents=True)
    text = "RuntimeError: DataLoader worker (pid 4242) is killed by signal: Killed. "
    (attempt / "rank0.log").write_text(
        "2026-11-21T09:30:00.000000 [rank0]: {'loss': 1.2, 'learning_rate': 1e-05, 'epoch': 0.1}\n"
        "2026-11-21T09:30:01.000000 [rank0]: Traceback (most recent call last):\n"
        f"2026-11-21T09:30:01.000000 [rank0]: {text}\n", encoding="utf-8")  # fmt: skip
    err = {"message": {"message": text, "extraInfo": {"py_callstack": "", "timestamp": "1795250000"}}}
    failures = {0: RankFailure(local_rank=0, pid=100, exitcode=1, error_file_data=err)}
    ctx, store = _ctx(tmp_path, restart_count=0)
    try:
        d = diagnosis_monitor.create(_options()).on_workers_failed(ctx, failures)
        assert d.category == "dataloader" and d.details["family"] == "signal"
        decision = policy.decide_on_failure(failures, 2, d)
        assert decision.action == policy.Action.RESTART, decision.reason
    finally:
        store.close()


def test_a_low_confidence_diagnosis_says_so_in_its_event(tmp_path: Path):
    attempt = tmp_path / "logs" / "attempt-0"
    attempt.mkdir(parents=True)
    (attempt / "launcher.log").write_text(
        "[2026-01-01 10:00:02,000] torch.distributed.elastic.multiprocessing.api: [ERROR] failed (exitcode: 1) "
        "local_rank: 0 (pid: 100) of binary: /usr/bin/python\n", encoding="utf-8")  # fmt: skip
    ctx, store = _ctx(tmp_path, restart_count=0)
    try:
        d = diagnosis_monitor.create(_options()).on_workers_failed(ctx, {0: RankFailure(0, 100, 1)})
        assert d.confidence == "low"
        (ev,) = store.query(kinds=["diagnosis"])
        assert "(low confidence)" in ev.message
    finally:
        store.close()
