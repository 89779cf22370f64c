"""Pairing and verdict of the node health check (pure: plain data in, plain data out).

Every node runs a small GEMM + all-reduce + all-gather benchmark together with a partner (seed:
DLRover network check). Round 1 pairs neighbours (0,1), (2,3), ...; with an odd count the last node
runs in a second wave paired with node 0, so every node is tested in a pair. A node whose test
failed is a *suspect* (so is its partner: a broken pair does not say who broke it). Round 2 pairs
each suspect with a node that passed round 1 (waves, so a healthy node is in one pair at a time);
when no node passed round 1, suspects are re-paired among themselves in untested pairs.

Rules:
- **faulty**: every test the node took part in failed, and at least one of them was with a
  partner that passed a test (so the failure is the node's own). A single node is faulty when its
  test fails.
- **undetermined**: some node never passed and was never paired with a proven node (all nodes
  failed round 1, e.g. only 2 or 3 nodes with one broken, or the network is down everywhere).
- **straggler**: the node's GEMM time or its collective time (all-reduce + all-gather; seconds
  per op, its best over the tests it passed) exceeds ``median + k * 1.4826 * MAD`` *and*
  ``min_ratio * median`` of that part over all nodes. Each part is judged alone so that noise in
  one (shared collectives on a busy network) does not hide a slow other (a loaded CPU/GPU). The MAD rule ignores ordinary spread; the ratio keeps
  near-identical timings (MAD ~ 0) from flagging tiny differences. Members of a pair that holds
  a slow node in round 1 (``min_ratio`` times the median of the faster half) are retested in
  round 2, because a pair's collectives run at the slower partner's pace and would otherwise make
  the healthy partner look slow too.
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass, field
from typing import Any

from trainguard.detect.robust import median_and_spread, slower

Group = tuple[int, ...]


@dataclass(frozen=True)
class TestResult:
    """One node's outcome of one group test. Times are seconds per operation (medians)."""

    node: int
    group: Group
    ok: bool
    error: str = ""
    gemm_s: float | None = None
    allreduce_s: float | None = None
    allgather_s: float | None = None

    @property
    def iteration_s(self) -> float | None:
        parts = (self.gemm_s, self.allreduce_s, self.allgather_s)
        if not self.ok or any(p is None for p in parts):
            return None
        return float(sum(parts))  # type: ignore[arg-type]

    @property
    def comm_s(self) -> float | None:
        if not self.ok or self.allreduce_s is None or self.allgather_s is None:
            return None
        return float(self.allreduce_s + self.allgather_s)

    @property
    def compute_s(self) -> float | None:
        return self.gemm_s if self.ok else None

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["group"] = list(self.group)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TestResult:
        return cls(
            node=int(d["node"]),
            group=tuple(int(x) for x in d["group"]),
            ok=bool(d["ok"]),
            error=str(d.get("error", "")),
            gemm_s=d.get("gemm_s"),
            allreduce_s=d.get("allreduce_s"),
            allgather_s=d.get("allgather_s"),
        )


def first_round_waves(nodes: list[int]) -> list[list[Group]]:
    """Neighbour pairs; an odd last node pairs with the first node in a second wave."""
    nodes = sorted(nodes)
    if len(nodes) <= 1:
        return [[tuple(nodes)]] if nodes else []
    waves = [[(nodes[i], nodes[i + 1]) for i in range(0, len(nodes) - 1, 2)]]
    if len(nodes) % 2:
        waves.append([(nodes[-1], nodes[0])])
    return waves


def second_round_waves(
    suspects: list[int], healthy: list[int], tested: set[frozenset[int]] | None = None
) -> list[list[Group]]:
    """Pair every suspect with a healthy node; a healthy node is in at most one pair per wave.

    With no healthy node at all (e.g. 3 nodes and the one in both first-round waves is broken,
    or two broken nodes in different pairs), pair the suspects among themselves in pairs not
    tested yet: a pair that passes proves both members, and so locates the rest."""
    suspects, healthy = sorted(suspects), sorted(healthy)
    if not suspects:
        return []
    if not healthy:
        tested = tested or set()
        free, pairs = list(suspects), []
        while free:
            a = free.pop(0)
            b = next((x for x in free if frozenset((a, x)) not in tested), None)
            if b is not None:
                free.remove(b)
                pairs.append((a, b))
        return [pairs] if pairs else []
    waves: list[list[Group]] = []
    for start in range(0, len(suspects), len(healthy)):
        chunk = suspects[start : start + len(healthy)]
        waves.append([(s, healthy[i]) for i, s in enumerate(chunk)])
    return waves


def tested_pairs(results: list[TestResult]) -> set[frozenset[int]]:
    return {frozenset((a, b)) for r in results for a in r.group for b in r.group if a != b}


def outliers(values: dict[int, float], k: float = 3.0, min_ratio: float = 2.0) -> dict[int, float]:
    """node -> ratio to the median, for values above median + k*1.4826*MAD and min_ratio*median."""
    if len(values) < 2:
        return {}
    med, spread = median_and_spread(values.values())
    if med <= 0:
        return {}
    return {n: v / med for n, v in values.items() if slower(v, med, spread, k=k, ratio=min_ratio, strict=True)}


def _best(results: list[TestResult], metric: str) -> dict[int, float]:
    """node -> its best (smallest) value of ``metric`` over the tests it passed."""
    best: dict[int, float] = {}
    for r in results:
        t = getattr(r, metric)
        if t is not None and (r.node not in best or t < best[r.node]):
            best[r.node] = t
    return best


def _best_times(results: list[TestResult]) -> dict[int, float]:
    return _best(results, "iteration_s")


def slow_suspects(values: dict[int, float], min_ratio: float = 2.0) -> set[int]:
    """Nodes at least ``min_ratio`` times the fast baseline (the median of the faster half).

    Lenient on purpose: it only chooses whom to retest. In round 1 a slow node drags its partner
    along, so half the timings can be slow and the plain median would sit between the two."""
    if len(values) < 2:
        return set()
    ordered = sorted(values.values())
    base = statistics.median(ordered[: max(1, len(ordered) // 2)])
    return {n for n, v in values.items() if base > 0 and v > min_ratio * base}


def round_one_suspects(nodes: list[int], results: list[TestResult], k: float, min_ratio: float) -> list[int]:
    """Nodes to retest: anyone with a failed (or missing) test, and the members of any group
    holding a slow node."""
    tested = {n for r in results for n in r.group}
    suspects = {r.node for r in results if not r.ok} | (set(nodes) - tested)
    # Collectives run at the slower partner's pace: retest both members of a slow pair. (GEMM
    # time is the node's own and needs no retest.)
    slow = slow_suspects(_best(results, "comm_s"), min_ratio)
    for r in results:
        if r.node in slow:
            suspects.update(r.group)
    return sorted(suspects & set(nodes))


def missing_results(groups: list[Group], results: list[TestResult]) -> list[TestResult]:
    """Failed results for the members of ``groups`` that reported nothing (their agent is gone)."""
    have = {(r.node, r.group) for r in results}
    return [
        TestResult(node=n, group=g, ok=False, error="no result reported (agent or check process gone)")
        for g in groups
        for n in g
        if (n, g) not in have
    ]


def recheck_nodes(nodes: list[int], needy: set[int]) -> list[int]:
    """The nodes that take part when only ``needy`` must be (re)checked (the others have a recent
    healthy result): the needy ones plus one healthy partner more than there are needy ones, as
    far as there are any. A collective needs a partner; and when a needy node's pair fails, the
    second round needs a healthy node outside that pair to tell which of the two is broken (a
    guard must not blame the partner)."""
    nodes = sorted(nodes)
    needy_sorted = [n for n in nodes if n in needy]
    if not needy_sorted:
        return []
    others = [n for n in nodes if n not in needy]
    return sorted(needy_sorted + others[: len(needy_sorted) + 1])


@dataclass
class Verdict:
    nodes: list[int]
    faulty: dict[int, str] = field(default_factory=dict)
    stragglers: dict[int, str] = field(default_factory=dict)
    undetermined: str = ""
    times: dict[int, float] = field(default_factory=dict)  # best seconds per iteration
    results: list[TestResult] = field(default_factory=list)
    names: dict[int, str] = field(default_factory=dict)  # node rank -> node name, where known

    def label(self, node: int) -> str:
        name = self.names.get(node)
        return f"node {node} ({name})" if name else f"node {node}"

    @property
    def healthy(self) -> bool:
        return not self.faulty and not self.undetermined

    def to_dict(self) -> dict[str, Any]:
        return {
            "nodes": self.nodes,
            "faulty": {str(k): v for k, v in self.faulty.items()},
            "stragglers": {str(k): v for k, v in self.stragglers.items()},
            "undetermined": self.undetermined,
            "times_s_per_iteration": {str(k): v for k, v in self.times.items()},
            "results": [r.to_dict() for r in self.results],
            "names": {str(k): v for k, v in self.names.items()},
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Verdict:
        return cls(
            nodes=[int(n) for n in d["nodes"]],
            faulty={int(k): v for k, v in d.get("faulty", {}).items()},
            stragglers={int(k): v for k, v in d.get("stragglers", {}).items()},
            undetermined=d.get("undetermined", ""),
            times={int(k): v for k, v in d.get("times_s_per_iteration", {}).items()},
            results=[TestResult.from_dict(r) for r in d.get("results", [])],
            names={int(k): v for k, v in d.get("names", {}).items()},
        )


def verdict(nodes: list[int], results: list[TestResult], k: float = 3.0, min_ratio: float = 2.0) -> Verdict:
    """Faulty nodes, stragglers and best times from all tests of both rounds."""
    nodes = sorted(nodes)
    v = Verdict(nodes=nodes, results=list(results))
    passed = {r.node for r in results if r.ok}
    never = [n for n in nodes if n not in passed]
    if len(nodes) == 1 and never:
        errs = [r.error for r in results if r.node == nodes[0]] or ["no result"]
        v.faulty[nodes[0]] = f"node check failed: {errs[-1]}"
    else:
        unresolved = []
        for n in never:
            mine = [r for r in results if r.node == n]
            proven_partner = any(p in passed for r in mine for p in r.group if p != n)
            if proven_partner:
                errs = "; ".join(dict.fromkeys(r.error for r in mine if r.error))
                v.faulty[n] = f"failed every node-check round ({len(mine)} test(s)): {errs}"[:500]
            else:
                unresolved.append(n)
        if unresolved:
            v.undetermined = (
                f"node check failed on node(s) {unresolved} and no healthy partner was available to tell "
                f"which node is at fault (needs at least 4 nodes, or 3 with one fault)"
            )
    v.times = _best_times(results)
    # Judged per part: the GEMM is the node's own compute; the collectives are the pair's, which
    # round 2 has already separated. A slow part is not hidden by noise in the other.
    for metric, what in (("compute_s", "GEMM"), ("comm_s", "all-reduce + all-gather")):
        best = _best(results, metric)
        med = statistics.median(best.values()) if best else 0.0
        for n, ratio in sorted(outliers(best, k, min_ratio).items()):
            why = f"{what} {best[n] * 1e3:.2f} ms per op, {ratio:.1f}x the median {med * 1e3:.2f} ms"
            v.stragglers[n] = f"{v.stragglers[n]}; {why}" if n in v.stragglers else why
    return v
