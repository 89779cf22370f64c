"""Straggler monitor: shares this node's step windows with the other nodes and names slow ranks.

The profiling monitor (launch/profiling.py) sums each rank's spans per step and hands every
finished window of this node to ``add_window`` (from its drain thread). On the agent's thread,
``poll`` publishes this node's complete windows to the rendezvous store, merges the windows every
node has published and runs the pure detector (detect.straggler). Each incident is recorded once
for the whole job as ``straggler_detected`` (agreed through the store, every node's windows
attached); the first straggler of this node in an attempt goes to the policy as
``StragglerEvidence`` (its node leaves only with ``--exclude-straggler``, see
``policy.decide_on_straggler``).
"""

from __future__ import annotations

import argparse
import json
import logging
import threading
from dataclasses import dataclass, field

from trainguard.detect import straggler as S
from trainguard.evidence import StragglerEvidence
from trainguard.launch.monitor import Monitor, MonitorContext
from trainguard.options import given, non_negative, positive, positive_int

log = logging.getLogger(__name__)

KEEP_WINDOWS = 16  # this node's windows kept while waiting for other nodes
HISTORY_WINDOWS = 256  # merged windows kept for the detector (it needs >= 1 s of them)
STORE_PREFIX = "trainguard/straggler"


def add_arguments(group: argparse._ArgumentGroup) -> None:
    d = S.StragglerConfig()
    group.add_argument("--exclude-straggler", action="store_true",
                       help="a node found to be a straggler leaves the job (elastic jobs go on without it)")
    group.add_argument("--straggler-window", type=positive_int, default=None, metavar="STEPS",
                       help=f"steps per straggler-analysis window (default {d.window_steps})")
    group.add_argument("--straggler-windows", type=positive_int, default=None, metavar="N",
                       help=f"consecutive slow windows before a rank is named a straggler (default {d.windows})")
    group.add_argument("--straggler-ratio", type=positive, default=None,
                       help=f"how much slower than its peers' median a rank must be (default {d.ratio:g})")
    group.add_argument("--straggler-min-seconds", type=non_negative, default=None,
                       help=f"...and for at least this long, besides --straggler-windows windows (default {d.min_seconds:g})")


def config_from(options: argparse.Namespace) -> S.StragglerConfig:
    """The detector's settings from `trainguard run`'s flags (defaults: StragglerConfig's)."""
    return S.StragglerConfig(**given(options, {
        "window_steps": "straggler_window",
        "windows": "straggler_windows",
        "ratio": "straggler_ratio",
        "min_seconds": "straggler_min_seconds",
    }))  # fmt: skip


@dataclass
class _Exchange:
    """Straggler windows of the current attempt: this node's, and all nodes' merged."""

    local: dict[int, dict[int, S.RankWindow]] = field(default_factory=dict)
    published: list[int] = field(default_factory=list)
    merged: dict[int, list[S.RankWindow]] = field(default_factory=dict)
    analysed: int = -1  # newest merged window the detector has seen
    reported: set[tuple[int, str]] = field(default_factory=set)
    handed_over: bool = False  # the attempt's straggler evidence went to the policy


class StragglerMonitor(Monitor):
    name = "straggler"

    def __init__(self, cfg: S.StragglerConfig) -> None:
        self.cfg = cfg
        self._lock = threading.Lock()  # guards _exchange.local (the profiling drain thread adds to it)
        self._exchange = _Exchange()

    @property
    def window_steps(self) -> int:
        return self.cfg.window_steps

    def add_window(self, w: S.RankWindow) -> None:
        """A finished window of one of this node's ranks (any thread)."""
        with self._lock:
            local = self._exchange.local
            local.setdefault(w.window, {})[w.rank] = w
            for old in sorted(local)[:-KEEP_WINDOWS]:
                del local[old]

    def on_workers_started(self, ctx: MonitorContext) -> None:
        with self._lock:
            self._exchange = _Exchange()

    def poll(self, ctx: MonitorContext) -> StragglerEvidence | None:
        try:
            return self._exchange_and_detect(ctx)
        except Exception as exc:  # the store of a round whose host left: try again next poll
            log.debug("straggler exchange failed: %s", exc)
            return None

    # ---- exchange through the rendezvous store ------------------------------------------------
    def _key(self, ctx: MonitorContext, window: int, node_rank: int) -> str:
        # A c10d rendezvous store is scoped to the round (every restart is a new round), and agents
        # that joined at different times count attempts differently: no attempt in the key there.
        # The static rendezvous reuses one store for every attempt (all agents restart together).
        scope = f"a{ctx.restart_count}/" if ctx.rdzv_backend == "static" else ""
        return f"{STORE_PREFIX}/{scope}w{window}/n{node_rank}"

    def _exchange_and_detect(self, ctx: MonitorContext) -> StragglerEvidence | None:
        ex = self._exchange
        nworkers = len(ctx.workers)
        with self._lock:
            ready = sorted(w for w, ranks in ex.local.items() if nworkers and len(ranks) >= nworkers)
            windows = {w: list(ex.local.pop(w).values()) for w in ready}
        for w, ranks in windows.items():
            if ctx.store is None or ctx.nnodes <= 1:
                ex.merged[w] = ranks
                continue
            ctx.store.set(self._key(ctx, w, ctx.node_rank), json.dumps([r.to_dict() for r in ranks]))
            ex.published.append(w)
        if ctx.store is not None and ctx.nnodes > 1:
            self._collect(ctx, ex)
        for old in sorted(ex.merged)[:-HISTORY_WINDOWS]:
            del ex.merged[old]
        if not ex.merged or max(ex.merged) == ex.analysed:
            return None
        ex.analysed = last = max(ex.merged)
        history = []
        while last in ex.merged:  # the consecutive windows ending at the newest
            history.append(ex.merged[last])
            last -= 1
        return self._report(ctx, S.detect(history[::-1], self.cfg))

    def _collect(self, ctx: MonitorContext, ex: _Exchange) -> None:
        """Merge the published windows that every node has published (a few store round trips)."""
        assert ctx.store is not None
        ex.published = ex.published[-KEEP_WINDOWS:]
        complete = []
        for w in ex.published[:4]:
            keys = [self._key(ctx, w, n) for n in range(ctx.nnodes)]
            if ctx.store.check(keys):
                ex.merged[w] = [S.RankWindow.from_dict(d) for k in keys for d in json.loads(ctx.store.get(k))]
                complete.append(w)
        if complete:  # an older window still missing somewhere was lost there (a rank lost records)
            ex.published = [w for w in ex.published if w > max(complete)]

    def _report(self, ctx: MonitorContext, verdicts: list[S.Verdict]) -> StragglerEvidence | None:
        """One ``straggler_detected`` per incident (the new verdicts of one analysis, named by their
        first slow window) for the whole job: every node runs the same detector on the same merged
        windows, and the first agent to claim the incident in the store records it, with each
        node's windows attached. Each node hands the policy the first straggler of its own."""
        ex = self._exchange
        new = [v for v in verdicts if (v.rank, v.kind) not in ex.reported]
        if not new:
            return None
        ex.reported.update((v.rank, v.kind) for v in new)
        steps = self.cfg.window_steps
        found = [
            StragglerEvidence(
                v.rank, v.node, v.kind, v.slower_by, v.value_ms, v.peers_ms, list(v.windows),
                (v.windows[0] * steps + 1, (v.windows[-1] + 1) * steps),
            )
            for v in new
        ]  # fmt: skip
        if self._claim(ctx, min(v.windows[0] for v in new)):
            first = found[0]
            windows = set(new[0].windows)
            by_node: dict[str, list[dict]] = {}
            for w in sorted(windows & set(ex.merged)):
                for rw in ex.merged[w]:
                    by_node.setdefault(rw.node, []).append(rw.to_dict())
            ctx.events.emit(
                "straggler_detected",
                first.message + (f" (and {len(found) - 1} more)" if len(found) > 1 else ""),
                severity="warning", rank=first.rank, node=first.node,
                evidence={**first.to_dict(), "stragglers": [f.to_dict() for f in found], "nodes": by_node,
                          "recorded_by": ctx.node},
            )  # fmt: skip
        mine = {w.global_rank for w in ctx.workers}
        own = next((f for f in found if f.rank in mine), None)
        if own is None or ex.handed_over:
            return None
        ex.handed_over = True
        return own

    def _claim(self, ctx: MonitorContext, window: int) -> bool:
        """Whether this agent records the incident: the first to set its key in the store."""
        if ctx.store is None or ctx.nnodes <= 1:
            return True
        scope = f"a{ctx.restart_count}/" if ctx.rdzv_backend == "static" else ""
        key = f"{STORE_PREFIX}/{scope}incident/w{window}"
        try:
            return ctx.store.compare_set(key, "", ctx.node).decode() == ctx.node
        except Exception as exc:  # the store is gone: record it here rather than lose it
            log.debug("straggler incident claim failed: %s", exc)
            return True
