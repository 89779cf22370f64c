"""Prometheus metrics of one agent, derived from its job summary (events + step samples).

No detector knows about metrics: the agent's metrics monitor folds the event stream and the step
samples into a ``JobSummary`` and this collector reads it at scrape time. Names and units follow
Prometheus conventions (``_total`` counters, ``_seconds``, ``_info``). Counters and per-rank
gauges are this node's (sum them over agents for the job); ``trainguard_hardware_reschedules_total``
counts every node of the run this agent knows of (take the max over agents).
"""

from __future__ import annotations

import platform
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, start_http_server, write_to_textfile
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily, Metric
from prometheus_client.registry import Collector

from trainguard.events.summary import NODE_STATES, JobSummary

# name, type, help: the table in docs/observability.md is this list.
METRICS: list[tuple[str, str, str]] = [
    ("trainguard_build_info", "gauge", "trainguard, torch and Python versions of this agent (value 1)"),
    ("trainguard_node_state", "gauge", "1 for this node's current state (label state), 0 for the others"),
    ("trainguard_attempt", "gauge", "this node's current attempt (0 = first start; every restart or new round adds 1)"),
    ("trainguard_max_restarts", "gauge", "seed 003 fault-tolerance count: the most restarts this node may use (--max-restarts)"),
    ("trainguard_restarts_used", "gauge", "seed 003 fault-tolerance count: restarts this node used of its budget"),
    ("trainguard_hardware_reschedules_total", "counter",
     "seed 003 fault-tolerance count: nodes of the run isolated for a hardware/node fault so the job restarted without them"),
    ("trainguard_restarts_total", "counter", "worker-group restarts of this node by reason (membership = a new rendezvous round, no budget used)"),
    ("trainguard_worker_failures_total", "counter", "failed workers of this node by diagnosed category"),
    ("trainguard_hangs_total", "counter", "hangs detected and recorded by this node (one node records each hang for the job)"),
    ("trainguard_step", "gauge", "training step each rank of this node reached (resumed step + steps since)"),
    ("trainguard_step_duration_seconds", "gauge", "duration of each rank's latest training step"),
    ("trainguard_straggler_ratio", "gauge",
     "each rank's own work per step (compute + data loading) over the median of its peers on this node (1 = like its peers)"),
    ("trainguard_checkpoint_last_step", "gauge", "newest training step persisted as a checkpoint"),
    ("trainguard_checkpoint_stall_seconds", "gauge", "training-thread stall of the newest checkpoint save (longest over this node's ranks)"),
]
HELP = {name: text for name, _, text in METRICS}


@dataclass
class AgentView:
    """What the collector needs besides the summary: whose metrics these are."""

    node: Callable[[], str]
    local_ranks: Callable[[], list[int]]


def _help(name: str) -> str:
    return HELP[name]


class SummaryCollector(Collector):
    def __init__(self, summary: JobSummary, lock: threading.Lock, agent: AgentView) -> None:
        self.summary = summary
        self.lock = lock
        self.agent = agent

    def collect(self) -> Iterator[Metric]:
        import torch

        from trainguard import __version__

        info = InfoMetricFamily("trainguard_build", _help("trainguard_build_info"))
        info.add_metric([], {"version": __version__, "torch_version": torch.__version__,
                             "python_version": platform.python_version()})
        yield info
        with self.lock:
            yield from self._from_summary()

    def _from_summary(self) -> Iterator[Metric]:
        s = self.summary
        node = s.nodes.get(self.agent.node())
        state = GaugeMetricFamily("trainguard_node_state", _help("trainguard_node_state"), labels=["state"])
        for name in NODE_STATES:
            state.add_metric([name], 1.0 if node is not None and node.state == name else 0.0)
        yield state
        yield GaugeMetricFamily("trainguard_attempt", _help("trainguard_attempt"), value=max(0, node.attempt) if node else 0)
        if node is not None and node.max_restarts is not None:
            yield GaugeMetricFamily("trainguard_max_restarts", _help("trainguard_max_restarts"), value=node.max_restarts)
        yield GaugeMetricFamily("trainguard_restarts_used", _help("trainguard_restarts_used"), value=node.restarts_used if node else 0)
        yield CounterMetricFamily("trainguard_hardware_reschedules", _help("trainguard_hardware_reschedules_total"),
                                  value=s.hardware_reschedules)
        restarts = CounterMetricFamily("trainguard_restarts", _help("trainguard_restarts_total"), labels=["reason"])
        for reason, n in sorted((node.restarts if node else {}).items()):
            restarts.add_metric([reason], n)
        yield restarts
        failures = CounterMetricFamily("trainguard_worker_failures", _help("trainguard_worker_failures_total"), labels=["category"])
        for category, n in sorted((node.failures if node else {}).items()):
            failures.add_metric([category], n)
        yield failures
        yield CounterMetricFamily("trainguard_hangs", _help("trainguard_hangs_total"), value=node.hangs if node else 0)
        yield from self._ranks()
        if s.checkpoint_last_step is not None:
            yield GaugeMetricFamily("trainguard_checkpoint_last_step", _help("trainguard_checkpoint_last_step"),
                                    value=s.checkpoint_last_step)
        stall = s.checkpoint_stall()
        if stall is not None:
            yield GaugeMetricFamily("trainguard_checkpoint_stall_seconds", _help("trainguard_checkpoint_stall_seconds"), value=stall)

    def _ranks(self) -> Iterator[Metric]:
        local = set(self.agent.local_ranks())
        rows = [r for r in self.summary.rank_rows() if r["rank"] in local]
        step = GaugeMetricFamily("trainguard_step", _help("trainguard_step"), labels=["rank"])
        duration = GaugeMetricFamily("trainguard_step_duration_seconds", _help("trainguard_step_duration_seconds"), labels=["rank"])
        ratio = GaugeMetricFamily("trainguard_straggler_ratio", _help("trainguard_straggler_ratio"), labels=["rank"])
        for r in rows:
            label = [str(r["rank"])]
            if r["step"] is not None:
                step.add_metric(label, r["step"])
            if r["step_time"] is not None:
                duration.add_metric(label, r["step_time"])
            if r["straggler_score"] is not None:
                ratio.add_metric(label, r["straggler_score"])
        yield from (step, duration, ratio)


def registry_for(collector: Collector) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    return registry


class Exporter:
    """Serves a registry over HTTP and/or writes it for node_exporter's textfile collector."""

    def __init__(self, registry: CollectorRegistry, addr: str | None, port: int | None, textfile: str | None) -> None:
        self.registry = registry
        self.textfile = textfile
        self.endpoint: str | None = None
        self._server = None
        self._thread = None
        if port is not None:
            self._server, self._thread = start_http_server(port, addr=addr or "127.0.0.1", registry=registry)
            host, real_port = self._server.server_address[:2]
            self.endpoint = f"{host}:{real_port}"

    @property
    def port(self) -> int | None:
        return None if self._server is None else int(self._server.server_address[1])

    def write_textfile(self) -> None:
        if self.textfile:
            write_to_textfile(self.textfile, self.registry)  # temp file + rename: atomic

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
