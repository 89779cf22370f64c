"""Node liveness: every agent heartbeats through the rendezvous store; a node that goes silent
while the training is blocked is named as lost.

A thread beats (``store.add`` on this node's counter) every ``--heartbeat-interval`` seconds and
reads the other nodes' counters, so the agent's own thread never waits on a store that may have
become unreachable. ``poll`` hands the policy a ``NodeLost`` when a node's counter has not moved
for ``--node-lost-after`` seconds *and* this node's ranks made no step in that time: a silent agent
whose ranks still train with ours (a busy machine) is not lost, only late. The reason says whether
the node's address still answers (its agent died or hung) or not (network cut, machine down).
"""

from __future__ import annotations

import argparse
import json
import logging
import threading
import time
from dataclasses import dataclass

from trainguard.evidence import NodeLost
from trainguard.launch.monitor import Monitor, MonitorContext
from trainguard.options import given, positive
from trainguard.stores import can_connect

log = logging.getLogger(__name__)

PREFIX = "trainguard/alive"
PROBE_PORT = 9  # any port: a refused connection still proves the host answers


@dataclass(frozen=True)
class LivenessSettings:
    interval_s: float = 0.5
    lost_after_s: float = 4.0

    @classmethod
    def from_options(cls, options: argparse.Namespace) -> LivenessSettings:
        return cls(**given(options, {"interval_s": "heartbeat_interval", "lost_after_s": "node_lost_after"}))


def add_run_arguments(group: argparse._ArgumentGroup) -> None:
    d = LivenessSettings()
    group.add_argument("--heartbeat-interval", type=positive, default=None, metavar="S",
                       help=f"seconds between this agent's heartbeats to the others (default {d.interval_s:g})")
    group.add_argument("--node-lost-after", type=positive, default=None, metavar="S",
                       help=f"a node silent this long while training is blocked is lost; the others go on "
                            f"without it (default {d.lost_after_s:g})")  # fmt: skip


class LivenessMonitor(Monitor):
    name = "liveness"

    def __init__(self, settings: LivenessSettings) -> None:
        self.settings = settings
        self._lock = threading.Lock()
        self._seen: dict[int, tuple[int, float]] = {}  # node rank -> (counter, when it last moved)
        self._peers: dict[int, dict] = {}  # node rank -> what it published (name, addr, rdzv node)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._reported = False

    # ---- the heartbeat thread -------------------------------------------------------------
    def on_workers_started(self, ctx: MonitorContext) -> None:
        self._halt()
        if ctx.store is None or ctx.nnodes <= 1:
            return
        self._seen, self._peers, self._reported = {}, {}, False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, args=(ctx, self._stop), name="trainguard-liveness", daemon=True)
        self._thread.start()

    def _beat(self, ctx: MonitorContext, stop: threading.Event) -> None:
        store = ctx.store
        me = json.dumps({"node": ctx.node, "addr": ctx.addr, "rdzv_node": ctx.rdzv_node})
        try:
            store.set(f"{PREFIX}/info/{ctx.node_rank}", me)
        except Exception as exc:
            log.debug("liveness: cannot publish this node: %s", exc)
        others = [n for n in range(ctx.nnodes) if n != ctx.node_rank]
        while not stop.is_set():
            try:
                store.add(f"{PREFIX}/n{ctx.node_rank}", 1)
                for n in others:
                    count = store.add(f"{PREFIX}/n{n}", 0)
                    now = time.monotonic()
                    with self._lock:
                        last = self._seen.get(n)
                        if last is None or last[0] != count:
                            self._seen[n] = (count, now)
                    if n not in self._peers and store.check([f"{PREFIX}/info/{n}"]):
                        self._peers[n] = json.loads(store.get(f"{PREFIX}/info/{n}"))
            except Exception as exc:  # the store is unreachable from here: the others will tell
                log.debug("liveness: heartbeat failed: %s", exc)
            stop.wait(self.settings.interval_s)

    def _halt(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2 * self.settings.interval_s + 1)
        self._thread = None

    def on_workers_stopped(self, ctx: MonitorContext) -> None:
        self._halt()

    def close(self) -> None:
        self._halt()

    # ---- deciding -------------------------------------------------------------------------
    def poll(self, ctx: MonitorContext) -> NodeLost | None:
        if self._thread is None or self._reported:
            return None
        now = time.monotonic()
        with self._lock:
            silent = {n: now - moved for n, (_, moved) in self._seen.items()}
        late = {n: s for n, s in silent.items() if s >= self.settings.lost_after_s}
        if not late or self._ranks_progressed(ctx, min(late.values())):
            return None
        self._reported = True
        nodes, rdzv = {}, []
        for n, s in sorted(late.items()):
            info = self._peers.get(n, {})
            name = info.get("node") or f"rank {n}"
            nodes[name] = f"no heartbeat for {s:.1f} s; {self._reachability(info.get('addr'))}"
            if info.get("rdzv_node"):
                rdzv.append(info["rdzv_node"])
        lost = NodeLost(nodes, rdzv, round(min(late.values()), 1))
        ctx.events.emit("node_lost", lost.message, severity="error", evidence=lost.to_dict())
        return lost

    def _ranks_progressed(self, ctx: MonitorContext, within_s: float) -> bool:
        """Whether one of this node's ranks finished a step in the last ``within_s`` seconds."""
        since = time.time() - within_s
        return any(s.end >= since for r in ctx.steps.ranks() for s in ctx.steps.recent(r)[-1:])

    @staticmethod
    def _reachability(addr: str | None) -> str:
        if not addr:
            return "its address is unknown"
        why = can_connect(addr, PROBE_PORT, timeout_s=1.0)
        if why is None or "refused" in why.lower():
            return f"{addr} answers (its agent is gone or stuck)"
        return f"{addr} unreachable ({why})"


def create(options: argparse.Namespace) -> Monitor | None:
    return LivenessMonitor(LivenessSettings.from_options(options))
