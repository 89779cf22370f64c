"""Straggler monitor: shares this node's step windows with the other nodes and names slow ranks.

The profiling monitor (monitors/profiling/monitor.py) sums each rank's spans per step and hands every
finished window of this node to ``add_window`` (from its drain thread). On the agent's thread,
``poll`` publishes this node's complete windows to the rendezvous store. One agent, the leader
(node rank 0), merges the windows every node has published, runs the pure detector
(detect.straggler) and publishes its verdicts; the other agents read that one small key. (When
every agent merged every node's windows, store traffic grew with the square of the nodes: 104 MB
and ~7 s of store time per window at 2,048 ranks, bench/scale.py.) A straggler on this node is
recorded once for the whole job as ``straggler_detected`` by the leader (every
node's windows attached); the first one of this node of an attempt goes to the policy as
``StragglerEvidence`` (its node leaves only with ``--exclude-straggler``, see
``policy.decide_on_straggler``).
"""

from __future__ import annotations

import argparse
import json
import logging
import threading
import time
from dataclasses import dataclass, field

from trainguard.cluster import exchange
from trainguard.detect import straggler as S
from trainguard.evidence import StragglerEvidence
from trainguard.monitors.api import Monitor, MonitorContext
from trainguard.options import given, non_negative, positive, positive_int

log = logging.getLogger(__name__)

KEEP_WINDOWS = 16  # this node's windows kept while waiting for other nodes
HISTORY_WINDOWS = 256  # merged windows kept for the detector (it needs >= 1 s of them)
STORE_PREFIX = "trainguard/straggler"
LEADER = 0  # node rank that merges and judges
FOLLOW_EVERY_S = 0.5  # how often a waiting follower reads the leader's verdicts


def add_arguments(group: argparse._ArgumentGroup) -> None:
    d = S.StragglerConfig()
    group.add_argument("--exclude-straggler", action="store_true",
                       help="a node found to be a straggler, while training or by the node check, leaves the job "
                       "(elastic jobs go on without it)")
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
    verdicts: dict[tuple[int, str], S.Verdict] = field(default_factory=dict)  # leader: all so far
    followed_at: float = 0.0  # follower: when it last read the leader's verdicts


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
        return f"{STORE_PREFIX}/{exchange.scope(ctx)}w{window}/n{node_rank}"

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
        shared = ctx.store is not None and ctx.nnodes > 1
        if shared and ctx.node_rank != LEADER:
            return self._follow(ctx, ex)
        if shared:
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
        verdicts = S.detect(history[::-1], self.cfg)
        if shared:
            self._publish_verdicts(ctx, ex, verdicts)
        return self._report(ctx, verdicts)

    def _verdicts_key(self, ctx: MonitorContext) -> str:
        return f"{STORE_PREFIX}/{exchange.scope(ctx)}verdicts"

    def _publish_verdicts(self, ctx: MonitorContext, ex: _Exchange, verdicts: list[S.Verdict]) -> None:
        """Every straggler the leader found this attempt (first verdict of each), and the newest
        window it judged: a follower that reads late still sees a straggler that has recovered."""
        assert ctx.store is not None
        for v in verdicts:
            ex.verdicts.setdefault((v.rank, v.kind), v)
        blob = {"window": ex.analysed, "verdicts": [v.to_dict() for v in ex.verdicts.values()]}
        ctx.store.set(self._verdicts_key(ctx), json.dumps(blob))

    def _follow(self, ctx: MonitorContext, ex: _Exchange) -> StragglerEvidence | None:
        """Not the leader: this node's stragglers, from the leader's verdicts (one key)."""
        assert ctx.store is not None
        ex.published = ex.published[-KEEP_WINDOWS:]
        now = time.monotonic()
        if not ex.published or now - ex.followed_at < FOLLOW_EVERY_S:
            return None  # nothing of ours the leader has not judged yet, or read a moment ago
        ex.followed_at = now
        key = self._verdicts_key(ctx)
        if not ctx.store.check([key]):
            return None
        blob = json.loads(ctx.store.get(key))
        ex.published = [w for w in ex.published if w > int(blob["window"])]
        return self._report(ctx, [S.Verdict(**d) for d in blob["verdicts"]])

    def _collect(self, ctx: MonitorContext, ex: _Exchange) -> None:
        """Merge the published windows that every node has published (a few store round trips)."""
        assert ctx.store is not None
        ex.published = ex.published[-KEEP_WINDOWS:]
        complete = []
        for w in ex.published[:4]:
            keys = [self._key(ctx, w, n) for n in range(ctx.nnodes)]
            if ctx.store.check(keys):
                blobs = exchange.get_all(ctx.store, keys)
                if len(blobs) < len(keys):
                    continue  # a forged window (reported, left out) stands where a node's should be
                ex.merged[w] = [S.RankWindow.from_dict(d) for blob in blobs.values() for d in json.loads(blob)]
                complete.append(w)
        if complete:  # an older window still missing somewhere was lost there (a rank lost records)
            ex.published = [w for w in ex.published if w > max(complete)]

    def _report(self, ctx: MonitorContext, verdicts: list[S.Verdict]) -> StragglerEvidence | None:
        """One ``straggler_detected`` per incident (the new verdicts of one analysis) for the whole
        job: the leader, which judged every node's merged windows, records it with each node's
        windows attached. Each node hands the policy the first straggler of its own."""
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
        if ctx.store is None or ctx.nnodes <= 1 or ctx.node_rank == LEADER:
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
