"""The extension point through which detectors and services plug into the agent.

The agent calls every registered ``Monitor`` from its own loop: before each start (``worker_env``),
after each rendezvous before workers start (``on_before_start``), after each (re)start, every
monitor interval (``poll``), on worker failures and on shutdown. Monitors observe and report; they
never decide. What they find goes back to the agent as typed evidence (``trainguard.evidence``),
which the agent hands to the policy (``trainguard.policy``) and then carries out the decision:

- ``on_before_start(ctx) -> CheckOutcome | None``  -> ``policy.decide_before_start``
- ``poll(ctx) -> HangEvidence | StragglerEvidence | HardwareFault | None``  -> ``policy.decide_while_running``
- ``on_workers_failed(ctx, failures) -> Diagnosis | HardwareReport | NodeLost | HangEvidence | None``  -> ``policy.decide_on_failure``
  (a ``NodeLost``: ``policy.decide_on_node_lost``; a ``HangEvidence``: the job's hang verdict the failure follows from)

A monitor never blocks the loop: ``poll`` must return within a few milliseconds and keep slow work
(py-spy, disk) on its own threads. Any exception a monitor raises is caught (``MonitorSet``),
recorded as a ``monitor_error`` event and otherwise ignored — a monitor cannot kill the job.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from torch.distributed.elastic.multiprocessing.api import SignalException

from trainguard import stopsignal
from trainguard.evidence import (
    CheckOutcome,
    Diagnosis,
    HangEvidence,
    HardwareReport,
    NodeLost,
    RankFailure,
    RunningEvidence,
)

if TYPE_CHECKING:
    from torch.distributed import Store

    from trainguard.events import EventBus

log = logging.getLogger(__name__)


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
        self._collectives: dict[int, Any] = {}  # rank -> ring_reader.CollectiveCounts (latest)
        self._flight: dict[int, str] = {}  # rank -> the unix socket its Flight Recorder answers on
        self._lock = threading.Lock()

    def set_collectives(self, rank: int, counts: Any) -> None:
        """The rank's collective counters (sequence number, calls per operation), latest."""
        with self._lock:
            self._collectives[rank] = counts

    def collectives(self) -> dict[int, Any]:
        with self._lock:
            return dict(self._collectives)

    def set_flight_sockets(self, paths: dict[int, str]) -> None:
        """Where this attempt's local ranks serve torch's Flight Recorder (probes/flight_recorder.py)."""
        with self._lock:
            self._flight = dict(paths)

    def flight_sockets(self) -> dict[int, str]:
        with self._lock:
            return dict(self._flight)

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
            self._collectives.clear()
            self._flight.clear()


@dataclass
class MonitorContext:
    """What the agent knows about the current worker group. Rebuilt on every (re)start."""

    run_dir: Path
    node: str  # this agent's node name (hostname, or --node-name)
    node_rank: int  # group rank of this agent in the current rendezvous round
    nnodes: int  # agents in the current round
    nproc_per_node: int
    world_size: int
    restart_count: int  # the attempt: logs/attempt-<n>, numbered across the run dir's runs (cluster/runs.py)
    workers: list[WorkerInfo]
    events: EventBus
    steps: StepTracker
    # Rendezvous store of the current round (shared by all agents). A c10d store is scoped to the
    # round; the static rendezvous ("static" backend) reuses one store for every attempt.
    store: Store | None = None
    rdzv_backend: str = ""
    addr: str = ""  # the address the other nodes reach this one through
    rdzv_node: str = ""  # this agent's identity in a dynamic rendezvous (torch_compat.rendezvous_node)
    ranks: tuple[int, ...] = ()  # global ranks of this node's workers in this round (known before they start)

    def pids(self) -> dict[int, int]:
        """global rank -> pid"""
        return {w.global_rank: w.pid for w in self.workers}


@dataclass(frozen=True)
class FailureFindings:
    """What the monitors found out about a failure, for ``policy.decide_on_failure``."""

    diagnosis: Diagnosis | None = None
    hardware: HardwareReport | None = None
    lost: NodeLost | None = None  # the failure was another node vanishing (monitors/liveness.py)
    hang: HangEvidence | None = None  # the job's hang verdict stands: a node restarting on it failed these workers


class Monitor:
    """Base class: override what you need. All hooks are optional."""

    name = "monitor"

    def worker_env(self, run_dir: Path) -> dict[str, str]:
        """Extra environment variables for every worker (called before each start)."""
        return {}

    def on_before_start(self, ctx: MonitorContext) -> CheckOutcome | None:
        """After rendezvous, before workers start (ctx.workers is empty). Pre-flight and node checks
        live here: the agreed outcome goes to ``policy.decide_before_start``."""
        return None

    def on_workers_started(self, ctx: MonitorContext) -> None:
        pass

    def poll(self, ctx: MonitorContext) -> RunningEvidence | None:
        """Called every monitor interval while workers run: new evidence for the policy, if any."""
        return None

    def on_workers_failed(
        self, ctx: MonitorContext, failures: dict[int, RankFailure]
    ) -> Diagnosis | HardwareReport | NodeLost | HangEvidence | None:
        """Workers failed (global rank -> failure, first failure first), before the policy decides:
        what this monitor found out about it (a log diagnosis, a hardware check), if anything."""
        return None

    def on_workers_stopped(self, ctx: MonitorContext) -> None:
        pass

    def close(self) -> None:
        pass


class MonitorSet:
    """The agent's monitors, called in order; a monitor that raises is reported once per hook as a
    ``monitor_error`` event and otherwise ignored."""

    def __init__(self, monitors: list[Monitor], bus: EventBus) -> None:
        self.monitors = list(monitors)
        self.bus = bus
        self._errors: set[tuple[str, str]] = set()

    def call(self, monitor: Monitor, hook: str, *args: Any) -> Any:
        try:
            got = getattr(monitor, hook)(*args)
        except SignalException:  # SIGTERM/USR1 reached the agent while a monitor ran: the stop goes on
            raise
        except Exception as exc:  # a monitor can never kill the job
            key = (monitor.name, hook)
            if key not in self._errors:
                self._errors.add(key)
                log.exception("monitor %s.%s failed", monitor.name, hook)
                self.bus.emit(
                    "monitor_error",
                    f"monitor {monitor.name} failed in {hook}: {exc!r}",
                    severity="warning",
                    evidence={"monitor": monitor.name, "hook": hook, "error": repr(exc)},
                )
            got = None
        stopsignal.raise_pending()  # a stop signal the monitor's own broad except swallowed
        return got

    def each(self, hook: str, *args: Any) -> Iterator[Any]:
        """What each monitor's ``hook`` returned, skipping None (lazily: stop when you have enough)."""
        for m in self.monitors:
            found = self.call(m, hook, *args)
            if found is not None:
                yield found

    def worker_env(self, run_dir: Path) -> dict[str, str]:
        env: dict[str, str] = {}
        for extra in self.each("worker_env", run_dir):
            env.update(extra)
        return env

    def on_workers_failed(self, ctx: MonitorContext, failures: dict[int, RankFailure]) -> FailureFindings:
        found = list(self.each("on_workers_failed", ctx, failures))
        return FailureFindings(
            diagnosis=next((f for f in found if isinstance(f, Diagnosis)), None),
            hardware=next((f for f in found if isinstance(f, HardwareReport)), None),
            lost=next((f for f in found if isinstance(f, NodeLost)), None),
            hang=next((f for f in found if isinstance(f, HangEvidence)), None),
        )

    def notify(self, hook: str, *args: Any) -> None:
        """Call a hook that returns nothing on every monitor."""
        for _ in self.each(hook, *args):
            pass
