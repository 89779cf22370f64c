"""Node liveness: every agent heartbeats through the rendezvous store; a node that goes silent
while the training is blocked is named as lost.

A thread beats (``store.add`` on this node's counter) every ``--heartbeat-interval`` seconds and
reads the other nodes' counters, so the agent's own thread never waits on a store that may have
become unreachable. It keeps beating while this node's workers are stopped and restarted (a node
busy restarting is not lost), until the next round starts a new one or the agent ends (then it
marks itself done, so a node that finished is never taken for lost).

Two ways to a ``NodeLost`` (the reason says whether the node's address still answers — its agent
died or hangs — or not — network cut, machine down):
- ``poll``: a node's counter has not moved for ``--node-lost-after`` seconds *and* this node's
  ranks made no step in that time (a network cut: collectives block). A silent agent whose ranks
  still train with ours (a busy machine) is not lost, only late. A node that has not started its
  workers in this round yet (joining, or slow to start) gets ``--node-start-allowance`` instead,
  unless a probe finds its address unreachable (detect.nodeloss).
- ``on_workers_failed``: this node's first failure only lost a peer (a node died and its sockets
  closed). It waits until either every other node beats again (a worker failed over there: the
  usual restart) or one stays silent for ``--node-lost-after`` seconds (lost).
"""

from __future__ import annotations

import argparse
import json
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any

from trainguard.cluster.stores import ForgedValue, can_connect
from trainguard.detect.nodeloss import DONE, Beat, late_nodes, to_probe
from trainguard.evidence import NodeLost, RankFailure
from trainguard.monitors.api import Monitor, MonitorContext
from trainguard.options import given, positive, seconds
from trainguard.spawn.failures import lost_peer

log = logging.getLogger(__name__)

PREFIX = "trainguard/alive"
PROBE_PORT = 9  # any port: a refused connection still proves the host answers
# After a peer was lost: a beat a dying node sent just before it died may still be on its way to
# the store; a read that starts this long after our worker saw the loss counts as after it.
IN_FLIGHT_S = 0.2
HURRY = 5  # while a lost peer is being explained, this node reads the counters this many times per interval


@dataclass(frozen=True)
class LivenessSettings:
    interval_s: float = 0.5
    lost_after_s: float = 4.0
    # A node that has not started its workers in this round yet: a fresh agent's first start took
    # 6 s under load in the soak, against the 4 s heartbeat deadline.
    startup_s: float = 30.0

    @classmethod
    def from_options(cls, options: argparse.Namespace) -> LivenessSettings:
        return cls(**given(options, {"interval_s": "heartbeat_interval", "lost_after_s": "node_lost_after",
                                     "startup_s": "node_start_allowance"}))  # fmt: skip


def add_run_arguments(group: argparse._ArgumentGroup) -> None:
    d = LivenessSettings()
    group.add_argument("--heartbeat-interval", type=seconds, default=None, metavar="S",
                       help=f"seconds between this agent's heartbeats to the others (default {d.interval_s:g})")
    group.add_argument("--node-lost-after", type=positive, default=None, metavar="S",
                       help=f"a node silent this long while training is blocked is lost; the others go on "
                            f"without it (default {d.lost_after_s:g})")  # fmt: skip
    group.add_argument("--node-start-allowance", type=positive, default=None, metavar="S",
                       help=f"a node that has not started its workers in this round yet (joining, slow to start) "
                            f"is lost only after this long, or once its address is unreachable "
                            f"(default {d.startup_s:g})")  # fmt: skip


class LivenessMonitor(Monitor):
    name = "liveness"

    def __init__(self, settings: LivenessSettings) -> None:
        self.settings = settings
        self._lock = threading.Lock()
        self._seen: dict[int, tuple[int, float]] = {}  # node rank -> (counter, when it last moved)
        self._peers: dict[int, dict] = {}  # node rank -> what it published (name, addr, rdzv node)
        self._unreachable: set[int] = set()  # starting nodes whose address a probe found unreachable
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._reported = False
        self._ctx: MonitorContext | None = None
        self._read: tuple[float, dict[int, int]] | None = None  # the latest full read: (when it began, counters)
        self._hurry = threading.Event()
        self._wake = threading.Event()  # the beat thread's sleep ends early: stopping, or hurrying

    # ---- the heartbeat thread -------------------------------------------------------------
    def on_before_start(self, ctx: MonitorContext) -> None:
        """Publish this node (its address) as soon as the round formed: while its workers start,
        the others can then probe whether it is reachable (proof), rather than take a slow start
        for a loss."""
        if ctx.store is not None and ctx.nnodes > 1:
            _publish(ctx)

    def on_workers_started(self, ctx: MonitorContext) -> None:
        self._halt()
        if ctx.store is None or ctx.nnodes <= 1:
            return
        self._seen, self._peers, self._unreachable, self._reported, self._ctx = {}, {}, set(), False, ctx
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, args=(ctx, self._stop), name="trainguard-liveness", daemon=True)
        self._thread.start()

    def _beat(self, ctx: MonitorContext, stop: threading.Event) -> None:
        store = ctx.store
        _publish(ctx)  # again: a start whose pre-start checks ended early did not publish it
        others = [n for n in range(ctx.nnodes) if n != ctx.node_rank]
        while not stop.is_set():
            try:
                began, counts = time.monotonic(), {}
                store.add(f"{PREFIX}/n{ctx.node_rank}", 1)
                for n in others:
                    count = DONE if _marked(store, f"{PREFIX}/done/{n}") else store.add(f"{PREFIX}/n{n}", 0)
                    counts[n] = count
                    now = time.monotonic()
                    with self._lock:
                        last = self._seen.get(n)
                        if last is None or last[0] != count:
                            self._seen[n] = (count, now)
                    if n not in self._peers and store.check([f"{PREFIX}/info/{n}"]):
                        self._peers[n] = json.loads(store.get(f"{PREFIX}/info/{n}"))
                with self._lock:
                    self._read = (began, counts)
                self._probe_starting()
            except Exception as exc:  # the store is unreachable from here: the others will tell
                log.debug("liveness: heartbeat failed: %s", exc)
            self._wake.wait(self.settings.interval_s / (HURRY if self._hurry.is_set() else 1))
            self._wake.clear()

    def _probe_starting(self) -> None:
        """Probe the address of each node still starting past the heartbeat deadline (on this
        thread: a probe may take a second, the agent's loop must not wait on it)."""
        for n in to_probe(self._beats(), time.monotonic(), self.settings.lost_after_s):
            addr = self._peers.get(n, {}).get("addr")
            if addr and _unreachable(addr) is not None:
                with self._lock:
                    self._unreachable.add(n)

    def _halt(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=2 * self.settings.interval_s + 1)
        self._thread = None

    def close(self) -> None:
        self._halt()
        ctx = self._ctx
        if ctx is not None and ctx.store is not None:
            try:  # the others must not take a node that finished for lost
                ctx.store.set(f"{PREFIX}/done/{ctx.node_rank}", "1")
            except Exception as exc:
                log.debug("liveness: cannot mark this node done: %s", exc)

    # ---- deciding -------------------------------------------------------------------------
    def poll(self, ctx: MonitorContext) -> NodeLost | None:
        if self._thread is None or self._reported:
            return None
        late = self._late()
        # No step for --node-lost-after either (not "since its last beat": a step that ended just
        # after the silent node's last beat would then count as progress for ever)
        if not late or self._ranks_progressed(ctx, self.settings.lost_after_s):
            return None
        return self._lost(ctx, late)

    def on_workers_failed(self, ctx: MonitorContext, failures: dict[int, RankFailure]) -> NodeLost | None:
        first = next((f for f in failures.values() if f.first_failure), None)
        if self._thread is None or self._reported or first is None or not lost_peer(first):
            return None
        since = time.monotonic()
        deadline = since + self.settings.lost_after_s + 2 * self.settings.interval_s + 1
        # A node is alive when its counter moves after a baseline read that began after the
        # failure: a beat it sent just before dying is then in the baseline, not taken for a sign
        # of life (that race kept a SIGKILLed node from being named). Meanwhile the beat thread
        # reads HURRY times as often, so the proof takes about one beat of the others.
        self._hurry.set()
        self._wake.set()  # a read that begins now, not at the end of the current interval
        try:
            baseline: tuple[float, dict[int, int]] | None = None
            while time.monotonic() < deadline:
                late = self._late()
                if late:
                    return self._lost(ctx, late)
                with self._lock:
                    read = self._read
                if read is not None and read[0] >= since + IN_FLIGHT_S:
                    began, counts = read[0], {n: c for n, c in read[1].items() if c >= 0}
                    if baseline is None:
                        baseline = (began, counts)
                    elif (began > baseline[0] and len(baseline[1]) >= ctx.nnodes - 1 - self._done()
                          and all(counts.get(n, c) > c for n, c in baseline[1].items())):
                        return None  # every other agent is alive: a worker failed somewhere, not a node
                time.sleep(self.settings.interval_s / (2 * HURRY))
            return None
        finally:
            self._hurry.clear()

    def _done(self) -> int:
        """Nodes that said they finished (never lost)."""
        with self._lock:
            return sum(1 for count, _ in self._seen.values() if count < 0)

    def _beats(self) -> dict[int, Beat]:
        with self._lock:
            return {n: Beat(count, moved, n in self._unreachable) for n, (count, moved) in self._seen.items()}

    def _late(self) -> dict[int, float]:
        """node rank -> seconds silent, for the nodes lost by detect.nodeloss's rule"""
        s = self.settings
        return late_nodes(self._beats(), time.monotonic(), s.lost_after_s, s.startup_s)

    def _lost(self, ctx: MonitorContext, late: dict[int, float]) -> NodeLost:
        self._reported = True
        nodes, rdzv = {}, []
        beats = self._beats()
        for n, s in sorted(late.items()):
            info = self._peers.get(n, {})
            name = info.get("node") or f"rank {n}"
            starting = n in beats and beats[n].starting
            silence = f"its workers not started {s:.1f} s into this round" if starting else f"no heartbeat for {s:.1f} s"
            nodes[name] = f"{silence}; {self._reachability(info.get('addr'))}"
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
        why = _unreachable(addr)
        if why is None:
            return f"{addr} answers (its agent is gone or stuck)"
        return f"{addr} unreachable ({why})"


def _unreachable(addr: str) -> str | None:
    """Why the host at ``addr`` does not answer; None when it does (a refused connection is an answer)."""
    why = can_connect(addr, PROBE_PORT, timeout_s=1.0)
    return None if why is None or "refused" in why.lower() else why


def _publish(ctx: MonitorContext) -> None:
    """This node's name and addresses in the round's store, for the others' reports and probes."""
    try:
        ctx.store.set(f"{PREFIX}/info/{ctx.node_rank}",
                      json.dumps({"node": ctx.node, "addr": ctx.addr, "rdzv_node": ctx.rdzv_node}))
    except Exception as exc:
        log.debug("liveness: cannot publish this node: %s", exc)


def settings(options: argparse.Namespace) -> LivenessSettings:
    return LivenessSettings.from_options(options)


def create(settings: LivenessSettings) -> Monitor | None:
    return LivenessMonitor(settings)


def _marked(store: Any, key: str) -> bool:
    """Whether an agent of this job wrote ``key``: a forged "done" mark (reported) must not hide a
    node that goes silent."""
    if not store.check([key]):
        return False
    try:
        store.get(key)
    except ForgedValue:
        return False
    return True
