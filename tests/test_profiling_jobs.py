"""Real workers (gloo, CPU) instrumented by the bootstrap, read by real profiling monitors.

The workers run through trainguard's worker entry (``trainguard.spawn.worker_main``), which calls
``bootstrap.install()`` before the script — the script itself (examples/train_mlp.py) is unchanged.
Agents are stood in for by ``ProfilingMonitor`` objects polled by the test, sharing a real TCPStore
as the rendezvous store, so several "nodes" exchange their windows as they do under the agent.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from tgtest import EXAMPLE, free_port, wait_for

from trainguard import policy
from trainguard.detect.straggler import StragglerConfig
from trainguard.events import EventBus, EventStore
from trainguard.monitors.api import MonitorContext, StepTracker, WorkerInfo
from trainguard.monitors.profiling.monitor import ProfilingMonitor, ProfilingSettings
from trainguard.monitors.straggler import StragglerMonitor
from trainguard.policy import STRAGGLER_EXIT_MESSAGE, Action
from trainguard.rundir import profiling as pf

pytestmark = pytest.mark.slow


class Cluster:
    """N fake nodes x P workers of one elastic job (--nnodes 1:N); each node is a straggler monitor
    fed by a profiling monitor, with its own context; the policy decides on their evidence."""

    def __init__(self, run_dir: Path, nnodes: int, nproc: int, script_args: list[str], comm: bool = False,
                 exclude_straggler: bool = False) -> None:
        from torch.distributed import TCPStore

        self.run_dir = run_dir
        self.exclude = exclude_straggler
        self.store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False) if nnodes > 1 else None
        self.db = EventStore(run_dir)
        self.stragglers = [StragglerMonitor(StragglerConfig(window_steps=5, windows=3, ratio=1.25)) for _ in range(nnodes)]
        self.monitors = [
            ProfilingMonitor(ProfilingSettings(comm=comm), windows=s, tick_s=0.05) for s in self.stragglers
        ]
        self.procs: list[subprocess.Popen] = []
        self.ctxs: list[MonitorContext] = []
        port = free_port()
        world = nnodes * nproc
        for n, mon in enumerate(self.monitors):
            workers = []
            for local in range(nproc):
                rank = n * nproc + local
                env = dict(os.environ)
                env.update(mon.worker_env(run_dir))
                env.update(
                    RANK=str(rank),
                    LOCAL_RANK=str(local),
                    WORLD_SIZE=str(world),
                    MASTER_ADDR="127.0.0.1",
                    MASTER_PORT=str(port),
                    TRAINGUARD_RUN_DIR=str(run_dir),
                    TRAINGUARD_RESTART_COUNT="1",
                    OMP_NUM_THREADS="1",
                )
                spec = {"env": env, "cwd": str(run_dir), "script": str(EXAMPLE), "args": script_args}
                log = open(run_dir / f"rank-{rank}.log", "wb")  # noqa: SIM115
                p = subprocess.Popen(
                    [sys.executable, "-u", "-m", "trainguard.spawn.worker_main", json.dumps(spec)],
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
                log.close()
                self.procs.append(p)
                workers.append(WorkerInfo(local, rank, p.pid))
            ctx = MonitorContext(
                run_dir=run_dir,
                node=f"node{n}",
                node_rank=n,
                nnodes=nnodes,
                nproc_per_node=nproc,
                world_size=world,
                restart_count=1,
                workers=workers,
                events=EventBus(self.db, f"node{n}"),
                steps=StepTracker(),
                store=self.store,
            )
            self.stragglers[n].on_workers_started(ctx)
            mon.on_workers_started(ctx)
            self.ctxs.append(ctx)
        self.decisions = []

    def poll(self) -> None:
        for straggler, mon, ctx in zip(self.stragglers, self.monitors, self.ctxs, strict=True):
            found = straggler.poll(ctx)
            mon.poll(ctx)
            d = found and policy.decide_on_straggler(found, self.exclude, ctx.nnodes, min_nodes=1)
            if d:
                self.decisions.append((ctx.node, d))

    def poll_until(self, cond, timeout=150.0, what="condition"):
        def step():
            self.poll()
            return cond()

        return wait_for(step, timeout, what, every=0.05)

    def finished(self) -> bool:
        return all(p.poll() is not None for p in self.procs)

    def events(self, kind):
        return self.db.query(kinds=[kind])

    def log(self, rank: int) -> str:
        return (self.run_dir / f"rank-{rank}.log").read_text(errors="replace")

    def close(self) -> None:
        for p in self.procs:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait(timeout=30)
        for mon, ctx in zip(self.monitors, self.ctxs, strict=True):
            mon.on_workers_stopped(ctx)
            mon.close()
        self.db.close()


def records(run_dir: Path, rank: int) -> list[dict]:
    d = run_dir / "profiling" / str(rank)
    files = (
        sorted((p for p in d.iterdir() if p.name.isdigit()), key=lambda p: int(p.name)) if d.exists() else []
    )
    return [json.loads(line) for f in files for line in f.read_text().splitlines()]


def test_slow_rank_and_node_named_within_20_steps_and_excluded(tmp_path):
    c = Cluster(
        tmp_path,
        nnodes=2,
        nproc=2,
        comm=True,
        exclude_straggler=True,
        script_args=["--steps", "60", "--step-time-ms", "50", "--slow-rank", "1", "--slow-factor", "1.5"],
    )
    try:
        c.poll_until(lambda: c.events("straggler_detected") or c.finished(), what="straggler_detected")
        (ev,) = c.events("straggler_detected")
        assert (ev.rank, ev.node, ev.evidence["node"], ev.evidence["kind"]) == (
            1,
            "node0",
            "node0",
            "compute",
        )
        assert 1.3 < ev.evidence["slower_by"] < 1.8
        assert max(ev.evidence["windows"]) * 5 + 5 <= 20, "named within 20 steps"
        assert [(n, d.action, d.rank, d.exit_message) for n, d in c.decisions] == [
            ("node0", Action.EXCLUDE_NODE, 1, STRAGGLER_EXIT_MESSAGE)
        ]
        # Step timing reached the agents' step trackers (what the hang detector reads).
        c.poll_until(
            lambda: all(len(ctx.steps.recent(w.global_rank)) >= 20 for ctx in c.ctxs for w in ctx.workers),
            what="20 steps per rank in ctx.steps",
        )
        s = c.ctxs[1].steps.recent(2)
        assert [x.step for x in s] == list(range(1, len(s) + 1))
        assert abs(s[-1].end - time.time()) < 60 and 0.03 < s[-1].duration < 5
        # The persisted spans show why: rank 1 computes long; its peers wait in the all-reduce.
        c.poll_until(
            lambda: len([r for r in records(tmp_path, 0) if r["kind"] == "Step"]) >= 15, what="records"
        )
        by = {rank: records(tmp_path, rank) for rank in range(4)}

        def med(rank, kind):
            vals = sorted(r["dur_us"] for r in by[rank][20:] if r["kind"] == kind)
            return vals[len(vals) // 2]

        assert med(1, "FP") > 1.3 * med(0, "FP")
        assert med(0, "Communication") - med(1, "Communication") > 15_000  # about the 25 ms it waits
        assert {r["kind"] for r in by[3]} >= {"Step", "FP", "Communication"}
    finally:
        c.close()


def test_healthy_500_steps_no_straggler(tmp_path):
    c = Cluster(tmp_path, nnodes=2, nproc=2, script_args=["--steps", "500", "--step-time-ms", "2"])
    try:
        c.poll_until(c.finished, timeout=240, what="500 steps")
        for _ in range(10):  # the last windows
            c.poll()
        assert "step=500 rank=3" in c.log(3), c.log(3)[-2000:]
        steps = [r for r in records(tmp_path, 2) if r["kind"] == "Step"]
        assert len(steps) >= 490, "the analysis saw the run"
        assert c.events("straggler_detected") == []
        assert c.decisions == []
    finally:
        c.close()


def test_runtime_switch_stops_and_restarts_records_without_restart(tmp_path):
    c = Cluster(tmp_path, nnodes=1, nproc=2, script_args=["--steps", "100000", "--step-time-ms", "5"])
    try:
        pids = [p.pid for p in c.procs]

        def n_steps(rank: int) -> int:
            return len([r for r in records(tmp_path, rank) if r["kind"] == "Step"])

        c.poll_until(lambda: n_steps(0) >= 20, what="records with profiling on")
        assert pf.read_switch(tmp_path) == 1
        subprocess.run(
            [sys.executable, "-m", "trainguard", "profile", str(tmp_path), "off"], check=True, timeout=60
        )
        c.poll_until(lambda: c.events("profiling_switch"), what="switch applied")
        tracker = c.ctxs[0].steps
        at_off = tracker.recent(0)[-1].step
        # Past any step in flight at the switch (the tracker lags the workers by a poll or two), and
        # everything recorded before it written out: the record files are drained every tick_s,
        # apart from the steps (CI: a record of the step in flight written after the count).
        c.poll_until(lambda: tracker.recent(0)[-1].step >= at_off + 20, what="steps go on")
        c.monitors[0].flush()
        before = {r: len(records(tmp_path, r)) for r in (0, 1)}
        c.poll_until(lambda: tracker.recent(0)[-1].step >= at_off + 60, what="steps with profiling off")
        c.monitors[0].flush()
        assert {r: len(records(tmp_path, r)) for r in (0, 1)} == before, "no records while off"

        subprocess.run(
            [sys.executable, "-m", "trainguard", "profile", str(tmp_path), "on", "--comm", "on"],
            check=True,
            timeout=60,
        )
        c.poll_until(lambda: len(records(tmp_path, 1)) > before[1] + 30, what="records again")
        new = records(tmp_path, 1)[before[1] :]
        assert {"Step", "FP", "Communication"} <= {r["kind"] for r in new}
        assert new[0]["step"] > at_off + 60, "the same workers went on counting"
        assert [p.pid for p in c.procs] == pids and not c.finished(), "no restart"
    finally:
        c.close()
