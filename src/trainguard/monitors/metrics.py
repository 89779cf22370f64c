"""The metrics monitor: the agent's Prometheus endpoint and node_exporter textfile.

It subscribes to the agent's event bus and folds every event into a ``JobSummary``; a background
thread adds the step samples of this node's ranks (``ctx.steps``), their compute / data-loading /
checkpoint spans (the profiling files the profiling monitor writes), and the other nodes' events
from the shared run directory, then rewrites the textfile. Nothing here decides anything, and no
detector knows about it.
"""

from __future__ import annotations

import argparse
import ipaddress
import logging
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainguard.events.metrics import AgentView, Exporter, SummaryCollector, registry_for
from trainguard.events.summary import JobSummary
from trainguard.monitors.api import Monitor, MonitorContext
from trainguard.options import given, seconds
from trainguard.rundir.readers import EventTail, SpanTail

log = logging.getLogger(__name__)

TICK_S = 1.0
DEFAULT_TEXTFILE_INTERVAL = 5.0


def _port(text: str) -> int:
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a port number, got {text!r}") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"port must be 0-65535 (0 = pick a free one), got {port}")
    return port


def _addr(text: str) -> str:
    try:
        ipaddress.ip_address(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an IP address to bind, got {text!r}") from None
    return text


def _textfile(text: str) -> str:
    path = Path(text)
    if path.suffix != ".prom":
        raise argparse.ArgumentTypeError(f"{text!r}: node_exporter's textfile collector reads only *.prom files")
    if not path.parent.absolute().is_dir():
        raise argparse.ArgumentTypeError(f"{text!r}: directory {path.parent} does not exist")
    return str(path.absolute())


@dataclass(frozen=True)
class MetricsSettings:
    port: int | None = None  # None: no endpoint; 0: a free port, recorded in a metrics_listening event
    addr: str = "127.0.0.1"
    textfile: str | None = None
    interval: float = DEFAULT_TEXTFILE_INTERVAL  # seconds between textfile rewrites

    @property
    def enabled(self) -> bool:
        return self.port is not None or bool(self.textfile)

    @classmethod
    def from_options(cls, options: argparse.Namespace) -> MetricsSettings:
        return cls(**given(options, {"port": "metrics_port", "addr": "metrics_addr",
                                     "textfile": "metrics_textfile", "interval": "metrics_interval"}))


def add_run_arguments(group: argparse._ArgumentGroup) -> None:
    group.add_argument("--metrics-port", type=_port, default=None, metavar="PORT",
                       help="serve Prometheus metrics on this port (0 = a free one, recorded in a metrics_listening event)")
    group.add_argument("--metrics-addr", type=_addr, default=None, metavar="ADDR",
                       help=f"address the metrics endpoint binds (default {MetricsSettings.addr}; 0.0.0.0 to let "
                       "Prometheus scrape from elsewhere)")
    group.add_argument("--metrics-textfile", type=_textfile, default=None, metavar="PATH.prom",
                       help="also write the metrics to this file for node_exporter's textfile collector (atomically)")
    group.add_argument("--metrics-interval", type=seconds, default=None, metavar="SECONDS",
                       help=argparse.SUPPRESS)


def settings(options: argparse.Namespace) -> MetricsSettings:
    return MetricsSettings.from_options(options)


def create(settings: MetricsSettings) -> Monitor | None:
    if not settings.enabled:
        return None
    return MetricsMonitor(settings.port, settings.addr, settings.textfile, settings.interval)


class MetricsMonitor(Monitor):
    name = "metrics"

    def __init__(self, port: int | None, addr: str, textfile: str | None, interval: float = DEFAULT_TEXTFILE_INTERVAL) -> None:
        self.summary = JobSummary()
        self.lock = threading.Lock()
        self.node = ""
        self._local: list[int] = []
        self._ctx: MonitorContext | None = None
        self._seen_end: dict[int, float] = {}
        self._started_at = time.time()
        self._subscribed = False
        self._events: EventTail | None = None
        self._spans: SpanTail | None = None
        self.interval = interval
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        collector = SummaryCollector(self.summary, self.lock, AgentView(lambda: self.node, self._local_ranks))
        self.exporter = Exporter(registry_for(collector), addr, port, textfile)
        if self.exporter.endpoint:
            log.info("metrics on http://%s/metrics", self.exporter.endpoint)

    def _local_ranks(self) -> list[int]:
        return list(self._local)

    # ---- agent hooks ----------------------------------------------------------------------------
    def on_before_start(self, ctx: MonitorContext) -> None:
        if not self._subscribed:
            self._subscribed = True
            self.node = ctx.node
            ctx.events.subscribe(self._on_event)
            if self.exporter.endpoint:
                ctx.events.emit("metrics_listening", f"Prometheus metrics on http://{self.exporter.endpoint}/metrics",
                                evidence={"endpoint": self.exporter.endpoint, "port": self.exporter.port,
                                          "textfile": self.exporter.textfile})
            self._events = EventTail(ctx.run_dir, skip_nodes={ctx.node}, wait_s=0.0)  # its own events come from the bus
            self._thread = threading.Thread(target=self._loop, name="trainguard-metrics", daemon=True)
            self._thread.start()
        return None

    def on_workers_started(self, ctx: MonitorContext) -> None:
        self._ctx = ctx
        self._local = sorted(w.global_rank for w in ctx.workers)
        self._seen_end = {}
        if self._spans is None:  # records from before this agent started are not its business
            self._spans = SpanTail(ctx.run_dir, start_bytes=0)
        self._spans.ranks = set(self._local)

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        try:
            self._tick()
            self.exporter.write_textfile()
        except Exception as exc:
            log.warning("metrics: final update failed: %s", exc)
        self.exporter.close()
        if self._events is not None:
            self._events.close()

    # ---- feeding the summary --------------------------------------------------------------------
    def _on_event(self, event: Any) -> None:
        with self.lock:
            self.summary.apply(event)

    def _loop(self) -> None:
        last_write = 0.0
        while not self._stop.wait(TICK_S):
            try:
                self._tick()
                if time.monotonic() - last_write >= self.interval:
                    last_write = time.monotonic()
                    self.exporter.write_textfile()
            except Exception as exc:  # metrics must never take the agent down
                log.warning("metrics update failed: %s", exc)

    def _tick(self) -> None:
        others = [e for e in (self._events.read() if self._events else [])
                  if e.node != self.node and e.time >= self._started_at]
        ctx, spans = self._ctx, self._spans
        samples = []
        if ctx is not None:
            for rank in self._local:
                seen = self._seen_end.get(rank, 0.0)
                new = [s for s in ctx.steps.recent(rank) if s.end > seen]
                if new:
                    self._seen_end[rank] = new[-1].end
                    samples += new
        records = [s for s in spans.read() if s.kind != "Step"] if spans is not None else []
        with self.lock:
            for e in others:  # other nodes' events, from a run dir on a shared filesystem
                self.summary.apply(e)
            for s in samples:
                self.summary.add_step(s.rank, s.step, s.end, s.duration)
            for r in records:
                self.summary.add_span(r.rank, r.kind, r.step, r.start, r.end)

