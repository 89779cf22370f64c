"""How the agents' hang watches share what they see and agree on ONE verdict per incident.

Every node judges the stall from its own ranks; the job gets one ``hang_detected`` (and one
``hang_suspected``) for it, recorded by one agent with every node's view attached:

- While steps stall, each node publishes its latest view (its ranks' stacks, progress and its own
  candidate) under ``views/<node rank>``, and keeps two counters current: ``published`` (nodes
  that have shared a view in this attempt) and ``moving`` (nodes with a rank that still
  progresses). A node whose ranks all wait reads the counters, not every view, to check that no
  rank elsewhere still progresses before it calls the stall a hang: two store operations a poll,
  whatever the number of nodes (reading every view was quadratic in nodes for the job: 3.5 GB
  through one store at 10,000 ranks, bench/scale.py). Only the one node that judges for the job
  reads every view.
- A node that finds no progress publishes its view again under ``declared/<node rank>`` and
  claims the incident (``claim``, first writer wins). The claimer waits (bounded) for the other
  nodes' declarations, names the culprit from every node's stacks, and writes the verdict
  (``verdict``, first writer wins), then records ``hang_detected``. Every node acts on that
  verdict, through the policy (``decide_on_hang``): a node that declared too waits for it; every
  node also looks for it from the agent's loop (a node that did not judge the stall itself), and
  when its workers fail first (a node restarting on the verdict took their peers away), the
  verdict goes to the policy with the failure (``decide_on_failure``).
- No leader is needed: a node whose workers are stopped still has a live agent that may claim,
  and when the claimer's agent gives no verdict in time (stopped, gone), a waiting node judges
  and writes one itself; the store keeps only the first verdict written, so it is still one.
- A suspicion is recorded by the first node to claim it (``suspected/<incident>``, the incident
  named by the step the stall follows); that node also records its ``hang_cleared``.

Keys live in the round's rendezvous store, scoped like every exchange (cluster/exchange.py), and
their values are signed with the job's key (cluster/stores.py ``SignedStore``): a forged view,
claim or verdict is reported and never acted on. The two counters are not signed (``add``): a
forger can only delay a verdict through them, never make one.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from trainguard.cluster import exchange
from trainguard.cluster.stores import ForgedValue
from trainguard.detect.culprit import CulpritVerdict, RankView
from trainguard.detect.progress import BUSY, PROGRESSING
from trainguard.evidence import HangEvidence
from trainguard.monitors.api import MonitorContext
from trainguard.probes import stacks

log = logging.getLogger(__name__)

PREFIX = "trainguard/hang"
# Progress kinds that hold a stall elsewhere from being called a hang (busy: long work or a loop).
MOVING = (PROGRESSING, BUSY)


def view_to_dict(v: RankView) -> dict[str, Any]:
    return {
        "state": v.state,
        "frames": [[f.name, f.filename, f.line] for f in v.frames],
        "busy": v.busy,
        "error": v.error,
        "last_step": v.last_step,
    }


def view_from_dict(rank: int, d: dict[str, Any]) -> RankView:
    return RankView(
        rank=rank,
        state=str(d.get("state", "")),
        frames=tuple(stacks.Frame(str(n), str(f), int(ln)) for n, f, ln in d.get("frames") or []),
        busy=bool(d.get("busy")),
        error=d.get("error"),
        last_step=d.get("last_step"),
    )


@dataclass
class NodeViews:
    """What one node sees of its ranks at a stall: their stacks, their progress and its candidate."""

    node: str
    node_rank: int
    views: dict[int, RankView]
    progress: dict[int, str] = field(default_factory=dict)  # rank -> detect.progress kind, when judged
    culprit: int | None = None  # this node's own candidate (None: no local rank is behind)
    reason: str = ""
    candidates: list[int] = field(default_factory=list)
    positions: dict[int, str] = field(default_factory=dict)  # rank -> where it is, in words
    declared: bool = False  # published when the node found no progress (else: its latest view)

    @classmethod
    def of(cls, ctx: MonitorContext, views: dict[int, RankView], verdict: CulpritVerdict | None,
           progress: dict[int, str], declared: bool = False) -> NodeViews:  # fmt: skip
        return cls(
            ctx.node, ctx.node_rank, views, progress,
            culprit=verdict.rank if verdict else None,
            reason=verdict.reason if verdict else "",
            candidates=list(verdict.candidates) if verdict else [],
            positions={r: p.describe() for r, p in verdict.positions.items()} if verdict else {},
            declared=declared,
        )  # fmt: skip

    def to_json(self) -> str:
        return json.dumps({
            "node": self.node, "node_rank": self.node_rank, "culprit": self.culprit, "reason": self.reason,
            "candidates": self.candidates, "declared": self.declared,
            "ranks": {str(r): {**view_to_dict(v), "progress": self.progress.get(r, ""),
                               "position": self.positions.get(r, "")} for r, v in self.views.items()},
        })  # fmt: skip

    @classmethod
    def from_json(cls, raw: bytes | str) -> NodeViews:
        d = json.loads(raw)
        ranks = {int(r): x for r, x in d["ranks"].items()}
        return cls(
            str(d["node"]), int(d["node_rank"]),
            {r: view_from_dict(r, x) for r, x in ranks.items()},
            {r: str(x.get("progress") or "") for r, x in ranks.items()},
            culprit=d.get("culprit"), reason=str(d.get("reason") or ""),
            candidates=[int(r) for r in d.get("candidates") or []],
            positions={r: str(x.get("position") or "") for r, x in ranks.items()},
            declared=bool(d.get("declared")),
        )  # fmt: skip

    def evidence(self) -> dict[str, Any]:
        """Who saw what, for the event: the node's candidate and each of its ranks in words."""
        return {
            "node_rank": self.node_rank,
            "declared": self.declared,
            "culprit": self.culprit,
            "reason": self.reason,
            "candidates": self.candidates,
            "ranks": {
                str(r): {"state": v.state, "progress": self.progress.get(r, ""), "busy": v.busy,
                         "last_step": v.last_step, "position": self.positions.get(r, ""),
                         **({"stack_error": v.error} if v.error else {})}
                for r, v in sorted(self.views.items())
            },
        }  # fmt: skip


def verdict_to_json(ev: HangEvidence) -> str:
    return json.dumps(dataclasses.asdict(ev))


def verdict_from_json(raw: bytes | str) -> HangEvidence:
    d = json.loads(raw)
    known = {f.name for f in dataclasses.fields(HangEvidence)}
    return HangEvidence(**{k: v for k, v in d.items() if k in known})


class HangExchange:
    """One attempt's hang conversation of this node with the others (see the module's doc)."""

    def __init__(self, store: Any, scope: str, node_rank: int, nnodes: int) -> None:
        self.store = store
        self.node_rank = node_rank
        self.nnodes = nnodes
        self._root = f"{PREFIX}/{scope}"
        self._published = False  # counted in `published` already
        self._moving = False  # counted in `moving` now

    @classmethod
    def for_ctx(cls, ctx: MonitorContext, own_client: bool = True) -> HangExchange | None:
        """None on a single node (nothing to agree on). ``own_client``: a connection of its own
        (for a thread other than the agent's)."""
        if ctx.nnodes <= 1 or ctx.store is None:
            return None
        return cls(_client(ctx.store) if own_client else ctx.store, exchange.scope(ctx), ctx.node_rank, ctx.nnodes)

    def _key(self, name: str) -> str:
        return self._root + name

    def _others(self, kind: str) -> list[str]:
        return [self._key(f"{kind}/{n}") for n in range(self.nnodes) if n != self.node_rank]

    def publish(self, nv: NodeViews) -> None:
        kind = "declared" if nv.declared else "views"
        self.store.set(self._key(f"{kind}/{self.node_rank}"), nv.to_json())
        moving = [r for r, k in sorted(nv.progress.items()) if k in MOVING]
        if bool(moving) != self._moving:
            if moving:  # which rank, for the others' message (written before it is counted)
                self.store.set(self._key("moving_rank"), str(moving[0]))
            self.store.add(self._key("moving"), 1 if moving else -1)
            self._moving = bool(moving)
        if not self._published:
            self.store.add(self._key("published"), 1)
            self._published = True

    def others_moving(self, wait_s: float) -> tuple[int, int | None]:
        """How many other nodes have a rank that still progresses, and one such rank when known
        (None: not known, or on this node). Waits up to ``wait_s`` for every other node to have
        shared a view once (they judge the same stall from their own samples)."""
        deadline = time.monotonic() + wait_s
        while self._count("published") - self._published < self.nnodes - 1 and time.monotonic() < deadline:
            time.sleep(exchange.POLL_S)
        others = self._count("moving") - self._moving
        if others <= 0:
            return 0, None
        try:
            rank = int(self.store.get(self._key("moving_rank")))
        except (ValueError, RuntimeError):
            rank = None
        return others, rank

    def _count(self, name: str) -> int:
        return int(self.store.add(self._key(name), 0))

    def gather(self, wait_s: float, declared: bool) -> dict[int, NodeViews]:
        """The other nodes' views (node rank -> views), waiting up to ``wait_s`` for all of them.
        ``declared``: their declarations, and the latest view of a node that has not declared."""
        keys = self._others("declared" if declared else "views")
        ready = exchange.wait_for(self.store, keys, wait_s)
        if declared and len(ready) < len(keys):  # a node that has not declared: its latest view
            late = {k.rsplit("/", 1)[1] for k in keys} - {k.rsplit("/", 1)[1] for k in ready}
            ready += [k for k in self._others("views") if k.rsplit("/", 1)[1] in late and self.store.check([k])]
        found: dict[int, NodeViews] = {}
        for key, raw in exchange.get_all(self.store, ready).items():
            try:
                nv = NodeViews.from_json(raw)
            except (ValueError, TypeError, KeyError, AttributeError) as exc:
                log.warning("hang: ignoring malformed views under %s: %s", key, exc)
                continue
            found.setdefault(nv.node_rank, nv)  # declared first
        return found

    def claim(self) -> bool:
        """This node judges the incident for the job (the first to claim it)."""
        return self._first(self._key("claim"), str(self.node_rank))

    def claim_suspicion(self, incident: str) -> bool:
        return self._first(self._key(f"suspected/{incident}"), str(self.node_rank))

    def _first(self, key: str, value: str) -> bool:
        try:
            return exchange.first_writer(self.store, key, value)[0]
        except ForgedValue:  # a forger keeps writing there: another node (or the wait's end) judges
            return False

    def offer(self, ev: HangEvidence) -> HangEvidence:
        """Write this verdict unless one stands already; the verdict that stands."""
        try:
            mine, stood = exchange.first_writer(self.store, self._key("verdict"), verdict_to_json(ev))
        except ForgedValue:  # a forger keeps writing there (reported): this node's own judgement
            return ev
        return ev if mine else verdict_from_json(stood)

    def verdict(self, wait_s: float = 0.0) -> HangEvidence | None:
        """The job's verdict; a forged one (reported) is no verdict."""
        key = self._key("verdict")
        if not exchange.wait_for(self.store, [key], wait_s):
            return None
        try:
            return verdict_from_json(self.store.get(key))
        except ForgedValue:
            return None


def _client(store: Any) -> Any:
    """A connection of our own for the watch's thread (TCPStore clients are cheap), else the shared one."""
    try:
        return store.clone()
    except Exception:
        return store
