"""Typed evidence: what the agent and its monitors observe, handed to the policy to decide on.

Evidence is plain data (frozen dataclasses, no I/O, nothing decided). Who produces what:

- ``RankFailure``: the agent, for each worker that failed (spawn/failures.py).
- ``AttemptRecord``: the agent, one per failed attempt (how far it got, how it failed), for the
  restart-loop guard.
- ``Diagnosis``: the diagnosis monitor, from the failed attempt's logs, when workers fail.
- ``HardwareReport``: the checks monitor's hardware check right after workers fail.
- ``CheckOutcome``: the checks monitor before workers start (pre-check, node check), agreed by all
  nodes.
- ``HangEvidence``, ``StragglerEvidence``, ``HardwareFault``: monitors' ``poll`` while workers run.
- ``NodeLost``: the liveness monitor (monitors/liveness.py), when another node stops heartbeating.
- ``PeerStop``, ``PeerLeft``: another node's agent, through the rendezvous store (cluster/peers.py).

Each one goes to the matching ``decide_*`` function of ``trainguard.policy``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

# --------------------------------------------------------------------------- worker failures


@dataclass(frozen=True)
class RankFailure:
    """How one worker ended, as the agent saw it."""

    local_rank: int
    pid: int | None
    exitcode: int | None
    signal: str | None = None  # "SIGKILL"..., when a signal ended it
    error_file_data: Any = None  # the torch elastic error file's content; None when it wrote none
    message: Any = None  # torch's failure message from the error file (str or its dict), else None
    timestamp: float | None = None  # when torch noticed (its poll)
    exit_time: float | None = None  # when the process exited (exact: a waiter thread saw it)
    log_tail: tuple[str, ...] = ()  # last lines of the rank's log
    collateral: bool = False  # stopped by the agent after another rank failed: a consequence
    first_failure: bool = False  # the rank that failed first on this node

    @property
    def when(self) -> float:
        """The best known failure time (for ordering)."""
        return self.exit_time or self.timestamp or 0.0

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "log_tail": list(self.log_tail)}


@dataclass(frozen=True)
class AttemptRecord:
    """One failed attempt as this node saw it: how far it got and how it failed. The agent keeps
    one per failure; the restart-loop guard (detect/restart_loop.py) compares consecutive ones."""

    attempt: int  # logs/attempt-<n>
    node: str
    kind: str  # the failure's cause kind; a signal death names its signal ("signal SIGKILL")
    step: int | None  # the last step the attempt reached on this node (None: no step seen)
    step_source: str = ""  # "log" (the step numbers the ranks print) | "spans" (steps counted this attempt)
    own: bool = True  # a rank of this node failed of its own (not only lost peers / stopped by the agent)
    nnodes: int = 1  # nodes in the attempt
    ranks: tuple[int, ...] = ()  # the global ranks of this node that failed of their own

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "ranks": list(self.ranks)}


@dataclass(frozen=True)
class Diagnosis:
    """The log diagnosis of a failed attempt (``trainguard.diagnose``'s result, typed)."""

    category: str
    summary: str = ""
    confidence: str = ""
    first_failure: dict[str, Any] | None = None  # rank, host, time, line, file, rule...
    evidence: list[Any] = field(default_factory=list)
    fix: str = ""
    findings: list[Any] = field(default_factory=list)
    details: dict[str, Any] = field(default_factory=dict)  # the rest: cascade, stats, attempt, note...

    _FIELDS = ("category", "summary", "confidence", "first_failure", "evidence", "fix", "findings")

    @property
    def rank(self) -> int | None:
        """The first failing rank, when the diagnosis names one."""
        r = (self.first_failure or {}).get("rank")
        return r if isinstance(r, int) and not isinstance(r, bool) else None

    def to_dict(self) -> dict[str, Any]:
        return {**self.details, **{k: getattr(self, k) for k in self._FIELDS}}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Diagnosis:
        ff = d.get("first_failure")
        return cls(
            category=str(d.get("category") or "unknown"),
            summary=str(d.get("summary") or ""),
            confidence=str(d.get("confidence") or ""),
            first_failure=ff if isinstance(ff, dict) else None,
            evidence=list(d.get("evidence") or []),
            fix=str(d.get("fix") or ""),
            findings=list(d.get("findings") or []),
            details={k: v for k, v in d.items() if k not in cls._FIELDS},
        )


@dataclass
class HardwareReport:
    """The light hardware check (GPU health): healthy or the faults found, with the item results."""

    healthy: bool
    faults: list[str]
    items: list[Any]  # checks.items.ItemResult

    def to_dict(self) -> dict[str, Any]:
        return {"healthy": self.healthy, "faults": self.faults, "items": [r.to_dict() for r in self.items]}

    def summary(self) -> dict[str, Any]:
        """What a decision quotes: healthy and the faults."""
        return {"healthy": self.healthy, "faults": list(self.faults)}


# ------------------------------------------------------------------------------ before start


@dataclass(frozen=True)
class CheckOutcome:
    """The verdict of one pre-start stage, the same on every node (they agree through the store)."""

    stage: str  # "precheck" | "node_check"
    faulty: dict[int, str] = field(default_factory=dict)  # node rank -> why it failed
    stragglers: dict[int, str] = field(default_factory=dict)  # node rank -> how slow (node check)
    undetermined: str = ""  # the check failed but could not tell which node
    hardware_faulty: frozenset[int] = frozenset()  # nodes whose failure was a hardware item
    names: dict[int, str] = field(default_factory=dict)  # node rank -> node name, where known
    details: dict[str, Any] = field(default_factory=dict)  # measurements, every node's outcome


# ------------------------------------------------------------------------- while running


@dataclass(frozen=True)
class HangEvidence:
    """A stall the hang monitor judged (the monitor of ``recorded_by`` has recorded
    ``hang_suspected`` or ``hang_detected`` with the full evidence; on several nodes that is one
    node for the whole job, and the others act on the same verdict).

    ``level`` "suspected": steps stopped but no hang is proven (the candidate is busy or
    progressing, or waits on something alive; past --hang-detect-time the job is still alive): a
    warning. "detected": the culprit's wait is proven dead (stopped, gone while waited for, D state,
    a dead wait the kernel shows), or at the seed's window nothing in the job moved (no I/O, flat
    utilisation, no rank progressing). See detect.verdict."""

    rank: int | None  # the culprit; None when no single rank could be named
    rule: str  # "steps" (a proof), "detect-time" / "io+utilisation" (the seed's window), "window" (a suspicion past it)
    reason: str  # why that rank (the culprit finder's words)
    causes: list[dict[str, Any]] = field(default_factory=list)  # known causes the stacks show
    report: str | None = None  # the readable hang report in the run dir
    attempt: int = 0
    level: str = "detected"  # "suspected" | "detected"
    progress: str = ""  # the culprit's progress kind (detect.progress): progressing busy idle stopped stalled gone
    doing: str = ""  # what the culprit was doing, in words
    recorded_by: str = ""  # the node that recorded the verdict (one for the whole job on several nodes)

    @property
    def progressing(self) -> bool:
        """The culprit's stack, I/O, spans or GPU still moved when this was judged. ("busy" is
        not progress: on CPU on the very same frame, flat utilisation.)"""
        return self.progress == "progressing"


@dataclass(frozen=True)
class StragglerEvidence:
    """A rank of this node slower than its peers in its own work, window after window."""

    rank: int
    node: str
    kind: str  # compute | dataloader | communication
    slower_by: float  # ratio to the peers' median
    value_ms: float  # this rank's time per step in that kind (last window)
    peers_ms: float  # the peers' median (last window)
    windows: list[int]
    steps: tuple[int, int]  # first and last step of those windows

    @property
    def message(self) -> str:
        return (
            f"rank {self.rank} on node {self.node} is a straggler: {self.kind} {self.slower_by:.2f}x slower than its "
            f"peers ({self.value_ms:.1f} ms vs {self.peers_ms:.1f} ms per step, steps {self.steps[0]}-{self.steps[1]})"
        )

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "steps": list(self.steps)}


@dataclass(frozen=True)
class HardwareFault:
    """The periodic hardware check found a fault while training."""

    faults: list[str]
    node: str
    node_rank: int


@dataclass(frozen=True)
class NodeLost:
    """Other nodes stopped heartbeating while this node's ranks made no progress."""

    nodes: dict[str, str]  # node name -> why (no heartbeat for N s; unreachable / host answers)
    rdzv_nodes: list[str]  # their rendezvous identities (torch's node descriptors), to drop them
    silent_s: float

    @property
    def message(self) -> str:
        return "; ".join(f"node {n} lost: {why}" for n, why in self.nodes.items())

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# ----------------------------------------------------------------------------- NaN triage


@dataclass(frozen=True)
class NanEvidence:
    """Where a non-finite loss or gradient was first seen in one attempt (the NaN triage).

    ``source`` "gradient_check": the replay's per-rank check of the gradients before their
    reduction named the rank (the lowest step, then the earliest time); "diagnosis": the log
    diagnosis of a failed attempt named the first failing rank (no gradient check ran)."""

    attempt: int
    rank: int | None
    node: str  # the node of ``rank`` ("" when it is not one of this node's ranks)
    source: str  # "gradient_check" | "diagnosis"
    step: int | None = None  # optimizer steps the rank had made in this attempt before it
    ranks: tuple[int, ...] = ()  # every rank non-finite at that step (the gradient check)
    nodes: tuple[str, ...] = ()  # their nodes
    detail: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "ranks": list(self.ranks), "nodes": list(self.nodes)}


# ------------------------------------------------------------------------------ other nodes


@dataclass(frozen=True)
class PeerStop:
    """Another node's policy stopped the job (its reason, with where it was decided)."""

    reason: str


@dataclass(frozen=True)
class PeerLeft:
    """Another node left the job (excluded): the others go on without it."""

    node: str


RunningEvidence = HangEvidence | StragglerEvidence | HardwareFault | NodeLost
PeerNews = PeerStop | PeerLeft
