"""Drive the hang monitor the way the agent does, against real gloo workers (tests and bench/hang.py).

Starts ``hang_worker.py`` ranks with RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT set (a fresh TCPStore
per attempt, as torch elastic's agent does), builds a MonitorContext with their pids, calls
``on_workers_started``, ``poll`` until it hands over hang evidence (which the policy turns into a
Decision, as the agent does) or until the workers exit, then ``on_workers_stopped``. It plays the profiling monitor's part by feeding the workers' `step=` lines
into ``ctx.steps`` (unless told not to). A suspicion (``decide_on_hang`` returns None) is kept and
the watch goes on, as in the agent. Every process is killed by process group at the end.
"""

from __future__ import annotations

import os
import re
import secrets
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from trainguard.events import EventBus
from trainguard.events.model import Event
from trainguard.events.store import EventStore
from trainguard.evidence import HangEvidence
from trainguard.monitors.api import MonitorContext, StepSample, StepTracker, WorkerInfo
from trainguard.monitors.autoinstrument import AutoInstrument
from trainguard.monitors.hang.monitor import HangMonitor
from trainguard.monitors.profiling.monitor import sweep_rings
from trainguard.policy import Action, Decision, decide_on_hang
from trainguard.probes import flight_recorder
from trainguard.worker import flight, ring

HANG_KINDS = ["hang_suspected", "hang_detected", "hang_cleared"]


def hang_events(run_dir: Path) -> list[Event]:
    store = EventStore(run_dir, readonly=True)
    try:
        return store.query(kinds=HANG_KINDS)
    finally:
        store.close()

WORKER = Path(__file__).with_name("hang_worker.py")
STEP_RE = re.compile(r"^step=(\d+) rank=(\d+) t=([\d.]+)")
FAULT_RE = re.compile(r"^fault=(\w+) rank=(\d+) t=([\d.]+)")


@dataclass
class Attempt:
    decision: Decision | None
    decided_at: float | None  # unix time poll() returned the decision
    returncodes: dict[int, int | None]
    output: dict[int, list[str]] = field(default_factory=dict)
    steps: dict[int, list[StepSample]] = field(default_factory=dict)
    suspected: list[tuple[float, HangEvidence]] = field(default_factory=list)  # (unix time handed over, evidence)

    def fault_time(self) -> float | None:
        for lines in self.output.values():
            for line in lines:
                m = FAULT_RE.match(line)
                if m:
                    return float(m.group(3))
        return None


def _pump(proc: subprocess.Popen, rank: int, lines: list[str], steps: StepTracker | None) -> None:
    assert proc.stdout is not None
    prev: float | None = None
    for raw in proc.stdout:
        line = raw.rstrip("\n")
        lines.append(line)
        m = STEP_RE.match(line)
        if m and steps is not None:
            end = float(m.group(3))
            steps.record(StepSample(rank, int(m.group(1)), end, 0.0 if prev is None else end - prev))
            prev = end


def _kill(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGKILL)  # works on stopped processes too
            except ProcessLookupError:
                pass
    for p in procs:
        p.wait(timeout=30)


def run_attempt(
    monitor: HangMonitor,
    run_dir: Path,
    bus: EventBus,
    world: int,
    attempt: int,
    args: list[str],
    feed_steps: bool = True,
    deadline_s: float = 90.0,
    worker: Path = WORKER,
) -> Attempt:
    from torch.distributed import TCPStore

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    env = dict(os.environ)
    env.update(
        WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(store.port),
        TORCHELASTIC_USE_AGENT_STORE="True",  # every rank is a client of our store: no port race
        TORCHELASTIC_RESTART_COUNT=str(attempt),
        TRAINGUARD_RESTART_COUNT=str(attempt),
        TRAINGUARD_RUN_DIR=str(run_dir),
        GLOO_SOCKET_IFNAME="lo",
        OMP_NUM_THREADS="1",
    )
    steps = StepTracker()
    # The workers run trainguard's worker bootstrap as under `trainguard run` (its sitecustomize,
    # a ring prefix): each serves torch's Flight Recorder beside its ring (worker/flight.py).
    prefix = os.path.join(ring.shm_dir(), f"trainguard-{os.getpid()}-{secrets.token_hex(4)}")
    env.update(AutoInstrument().worker_env(run_dir), TRAINGUARD_RING_PREFIX=prefix)  # its sitecustomize
    env.update(flight_recorder.worker_env(env))
    steps.set_flight_sockets({r: flight.socket_path(ring.ring_path(prefix, attempt, r)) for r in range(world)})
    procs: list[subprocess.Popen] = []
    output: dict[int, list[str]] = {r: [] for r in range(world)}
    pumps: list[threading.Thread] = []
    ctx: MonitorContext | None = None
    try:
        for rank in range(world):
            p = subprocess.Popen(
                [sys.executable, str(worker), *args],
                env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)},
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                start_new_session=True,
            )
            procs.append(p)
            t = threading.Thread(
                target=_pump, args=(p, rank, output[rank], steps if feed_steps else None), daemon=True
            )
            t.start()
            pumps.append(t)
        ctx = MonitorContext(
            run_dir=run_dir,
            node="testnode",
            node_rank=0,
            nnodes=1,
            nproc_per_node=world,
            world_size=world,
            restart_count=attempt,
            workers=[WorkerInfo(r, r, p.pid) for r, p in enumerate(procs)],
            events=bus,
            steps=steps,
        )
        monitor.on_workers_started(ctx)
        decision, decided_at = None, None
        suspected: list[tuple[float, HangEvidence]] = []
        deadline = time.monotonic() + deadline_s
        while time.monotonic() < deadline:
            found = monitor.poll(ctx)
            if found is not None:
                decision = decide_on_hang(found)  # None: a suspicion, keep watching
                if decision is None:
                    suspected.append((time.time(), found))
                else:
                    decided_at = time.time()
                    break
            if all(p.poll() is not None for p in procs):
                break
            time.sleep(0.05)
        return Attempt(
            decision,
            decided_at,
            {r: p.poll() for r, p in enumerate(procs)},
            output,
            {r: steps.recent(r) for r in range(world)},
            suspected,
        )
    finally:
        if ctx is not None:
            monitor.on_workers_stopped(ctx)
        _kill(procs)
        for t in pumps:
            t.join(timeout=10)
        sweep_rings(prefix)  # the rings and sockets (the profiling monitor's part under `trainguard run`)
        del store


def run_job(
    run_dir: Path,
    monitor: HangMonitor,
    world: int,
    args: list[str],
    feed_steps: bool = True,
    deadline_s: float = 90.0,
    max_attempts: int = 2,
    worker: Path = WORKER,
) -> tuple[list[Attempt], list[Event]]:
    """Attempts until one ends without a hang decision (or the restart budget is spent). The events:
    ``hang_detected`` (read ``hang_events`` for the suspicions too)."""
    store = EventStore(run_dir)
    bus = EventBus(store, node="testnode")
    attempts: list[Attempt] = []
    try:
        for n in range(max_attempts):
            a = run_attempt(monitor, run_dir, bus, world, n, args, feed_steps, deadline_s, worker)
            attempts.append(a)
            if a.decision is None:
                break
            if a.decision.action != Action.RESTART:
                break
        return attempts, store.query(kinds=["hang_detected"])
    finally:
        monitor.close()
