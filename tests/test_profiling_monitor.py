"""The profiling monitor against rings written in-process (fast): steps, files, switch, stragglers."""

from __future__ import annotations

import json
import os

from tgtest import wait_for

from trainguard import policy
from trainguard.detect.straggler import StragglerConfig
from trainguard.events import EventBus, EventStore
from trainguard.monitors.api import MonitorContext, StepTracker, WorkerInfo
from trainguard.monitors.profiling.monitor import ProfilingMonitor, ProfilingSettings
from trainguard.monitors.straggler import StragglerMonitor
from trainguard.policy import STRAGGLER_EXIT_MESSAGE, Action
from trainguard.rundir import profiling as pf
from trainguard.worker import ring as R
from trainguard.worker import spans


def test_monitor_reads_persists_switches_and_names_the_straggler(tmp_path):
    straggler = StragglerMonitor(StragglerConfig(window_steps=5, windows=3, min_seconds=0.0))
    mon = ProfilingMonitor(ProfilingSettings(basic=True, comm=False), windows=straggler, tick_s=0.02)
    env = mon.worker_env(tmp_path)
    assert env["TRAINGUARD_PROFILING_FLAGS"] == "1"
    assert pf.read_switch(tmp_path) == R.FLAG_BASIC
    db = EventStore(tmp_path)
    ctx = MonitorContext(run_dir=tmp_path, node="nodeA", node_rank=0, nnodes=1, nproc_per_node=2, world_size=2,
                         restart_count=0, workers=[WorkerInfo(0, 0, os.getpid()), WorkerInfo(1, 1, os.getpid())],
                         events=EventBus(db, "nodeA"), steps=StepTracker())
    writers = {r: R.RingWriter(R.ring_path(env["TRAINGUARD_RING_PREFIX"], 0, r), r, 1024, flags=0) for r in (0, 1)}
    recs = {r: spans.Recorder(w) for r, w in writers.items()}
    try:
        straggler.on_workers_started(ctx)
        mon.on_workers_started(ctx)
        wait_for(lambda: not any(os.path.exists(w.path) for w in writers.values()), 30, "rings opened and unlinked")
        assert all(w.flags == R.FLAG_BASIC for w in writers.values()), "the agent set the current switch"
        t = 1_000_000_000
        for rec in recs.values():
            rec._step_start = t  # synthetic clock
        found = None
        for _ in range(15):  # rank 1's forward takes 30 ms, rank 0's 20 ms
            for r, rec in recs.items():
                fp = (30 if r == 1 else 20) * 1_000_000
                rec.record(R.FP, t, t + fp)
                rec.step(now=t + 40_000_000)
            t += 40_000_000

        def polled():  # the agent's order: the straggler monitor, then profiling (steps)
            nonlocal found
            found = found or straggler.poll(ctx)
            mon.poll(ctx)
            return found

        wait_for(polled, 30, "straggler evidence")
        # with --exclude-straggler, in a job that can go on without this node:
        decision = policy.decide_on_straggler(found, exclude=True, nnodes=2, min_nodes=1)
        assert (decision.action, decision.rank, decision.exit_message) == (Action.EXCLUDE_NODE, 1, STRAGGLER_EXIT_MESSAGE)
        (ev,) = db.query(kinds=["straggler_detected"])
        assert (ev.rank, ev.node, ev.evidence["kind"], ev.evidence["slower_by"]) == (1, "nodeA", "compute", 1.5)
        assert ev.evidence["steps"] == [1, 15]
        assert [s.step for s in ctx.steps.recent(1)] == list(range(1, 16))
        assert ctx.steps.recent(0)[-1].duration == 0.04

        lines = wait_for(lambda: len(rank_lines(tmp_path, 1)) == 30 and rank_lines(tmp_path, 1), 30, "records on disk")
        assert lines[0]["kind"] == "FP" and lines[0]["rank"] == 1 and lines[0]["dur_us"] == 30000.0
        assert lines[1]["kind"] == "Step" and lines[1]["step"] == 1

        pf.write_switch(tmp_path, 0)  # what `trainguard profile RUN_DIR off` does
        wait_for(lambda: all(w.flags == 0 for w in writers.values()), 30, "switch applied to the rings")
        assert db.query(kinds=["profiling_switch"])[-1].evidence["Step"] == "off"
    finally:
        mon.on_workers_stopped(ctx)
        mon.close()
        for w in writers.values():
            w.close()
        db.close()
    assert not [n for n in os.listdir(R.shm_dir()) if n.startswith(os.path.basename(mon.prefix))]


def rank_lines(run_dir, rank):
    d = run_dir / "profiling" / str(rank)
    if not d.exists():
        return []
    return [json.loads(line) for f in sorted(d.iterdir()) for line in f.read_text().splitlines()]


def test_an_attempt_shorter_than_a_tick_keeps_its_records(tmp_path):
    """Workers that claim their rings, record and are gone before the background thread's first
    tick (a fast attempt killed in 90 ms, seen in the full suite): the failure and the stop open
    the rings and write every record; the failure already knows the steps reached."""
    mon = ProfilingMonitor(ProfilingSettings(basic=True, comm=False), tick_s=3600)  # the thread never ticks
    env = mon.worker_env(tmp_path)
    db = EventStore(tmp_path)
    ctx = MonitorContext(run_dir=tmp_path, node="nodeA", node_rank=0, nnodes=1, nproc_per_node=2, world_size=2,
                         restart_count=0, workers=[WorkerInfo(0, 0, os.getpid()), WorkerInfo(1, 1, os.getpid())],
                         events=EventBus(db, "nodeA"), steps=StepTracker())
    writers = {r: R.RingWriter(None, r, 1024, flags=int(env["TRAINGUARD_PROFILING_FLAGS"])) for r in (0, 1)}
    recs = {r: spans.Recorder(w, claim_path=R.ring_path(env["TRAINGUARD_RING_PREFIX"], 0, r)) for r, w in writers.items()}
    try:
        mon.on_workers_started(ctx)
        t = 1_000_000_000
        for rec in recs.values():
            rec._step_start = t
        for _ in range(17):
            for rec in recs.values():
                rec.record(R.FP, t, t + 10_000_000)
                rec.step(now=t + 20_000_000)
            t += 20_000_000
        mon.on_workers_failed(ctx, {})
        assert [s.step for s in ctx.steps.recent(1)] == list(range(1, 18))
        mon.on_workers_stopped(ctx)
        for rank in (0, 1):
            kinds = [x["kind"] for x in rank_lines(tmp_path, rank)]
            assert (kinds.count("Step"), kinds.count("FP")) == (17, 17), kinds
    finally:
        mon.close()
        for w in writers.values():
            w.close()
        db.close()
    assert not [n for n in os.listdir(R.shm_dir()) if n.startswith(os.path.basename(mon.prefix))]
