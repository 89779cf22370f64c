"""The extension point through which detectors and services plug into the agent.

The agent calls every registered ``Monitor`` from its own loop: once before workers first start
(``worker_env``), after each (re)start, every monitor interval (``poll``), on worker failures and
on shutdown. A monitor never blocks the loop: ``poll`` must return within a few milliseconds and
keep slow work (py-spy, disk) on its own threads. Any exception a monitor raises is caught by the
agent, recorded as a ``monitor_error`` event and otherwise ignored — a monitor cannot kill the job.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch.distributed import Store

    from trainguard.events import EventBus
    from trainguard.policy import Decision


@dataclass(frozen=True)
class WorkerInfo:
    local_rank: int
    global_rank: int
    pid: int


@dataclass(frozen=True)
class StepSample:
    """One completed training step of one rank (from Step spans or ``trainguard.step()``)."""

    rank: int
    step: int
    end: float  # unix seconds
    duration: float  # seconds


class StepTracker:
    """Recent step samples per global rank, fed by whoever reads them (the profiling monitor)."""

    def __init__(self, keep: int = 512) -> None:
        self._keep = keep
        self._by_rank: dict[int, deque[StepSample]] = {}
        self._lock = threading.Lock()

    def record(self, sample: StepSample) -> None:
        with self._lock:
            self._by_rank.setdefault(sample.rank, deque(maxlen=self._keep)).append(sample)

    def recent(self, rank: int) -> list[StepSample]:
        with self._lock:
            return list(self._by_rank.get(rank, ()))

    def ranks(self) -> list[int]:
        with self._lock:
            return sorted(self._by_rank)

    def clear(self) -> None:
        with self._lock:
            self._by_rank.clear()


@dataclass
class MonitorContext:
    """What the agent knows about the current worker group. Rebuilt on every (re)start."""

    run_dir: Path
    node: str  # this agent's node name (hostname, or --node-name)
    node_rank: int  # group rank of this agent in the current rendezvous round
    nnodes: int  # agents in the current round
    nproc_per_node: int
    world_size: int
    restart_count: int
    workers: list[WorkerInfo]
    events: EventBus
    steps: StepTracker
    # Rendezvous store of the current round (shared by all agents; keys are scoped to the round).
    store: Store | None = None
    # trainguard flags as parsed (argparse Namespace), for monitors that read their own options.
    options: Any = None
    extra: dict[str, Any] = field(default_factory=dict)

    def pids(self) -> dict[int, int]:
        """global rank -> pid"""
        return {w.global_rank: w.pid for w in self.workers}


class Monitor:
    """Base class: override what you need. All hooks are optional."""

    name = "monitor"

    def worker_env(self, run_dir: Path) -> dict[str, str]:
        """Extra environment variables for every worker (called before each start)."""
        return {}

    def on_before_start(self, ctx: MonitorContext) -> Decision | None:
        """After rendezvous, before workers start (ctx.workers is empty). Pre-flight and node checks
        live here; return EXCLUDE_NODE / STOP_JOB / RERENDEZVOUS to act instead of starting."""
        return None

    def on_workers_started(self, ctx: MonitorContext) -> None:
        pass

    def poll(self, ctx: MonitorContext) -> Decision | None:
        """Called every monitor interval while workers run. Return a Decision to act on."""
        return None

    def on_workers_failed(self, ctx: MonitorContext, failures: dict[int, dict[str, Any]]) -> None:
        """Workers failed (global rank -> failure info), before the policy decides.

        Monitors that inform the decision put their verdict into ``ctx.extra``: the diagnosis
        monitor sets ``ctx.extra["diagnosis"]`` (dict with "category", ...), the checks monitor
        ``ctx.extra["hardware"]`` (dict with "healthy": bool, "faults": [...]).
        Failure info keys: local_rank, pid, exitcode, signal (name or None), error_file_data
        (dict or None), log_tail (list of str)."""

    def on_workers_stopped(self, ctx: MonitorContext) -> None:
        pass

    def close(self) -> None:
        pass
