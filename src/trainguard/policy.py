"""The one place that decides what happens to the job: continue, restart, exclude a node, or stop.

Every input (a worker exit, a hang or straggler verdict, a check result, a log diagnosis) comes in
as data; every output is a ``Decision`` that the agent carries out and records as a
``policy_decision`` event with its evidence. All functions here are pure.

The seed's four scenarios (ModelArts fault tolerance):

1. pre-check failed, hardware faulty      -> isolate the node ("The node is down.")
2. pre-check failed, hardware healthy     -> isolate the node
3. user code failed, hardware check finds a fault -> isolate the node and restart the job
4. user code failed, hardware healthy     -> the job fails at once, no retry

An isolated node's agent exits; an elastic job (``--nnodes MIN:MAX`` with enough nodes left) goes
on without it, otherwise the job stops with the reason. Failures that are neither the user's code
nor a located hardware fault (a worker killed by a signal, a broken connection to a peer, an exit
without a Python error) are restarted while the ``--max-restarts`` budget lasts.
"""

from __future__ import annotations

import re
import signal as _signal
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any


class Action(StrEnum):
    CONTINUE = "continue"
    RESTART = "restart"  # stop the worker group and restart it (uses the restart budget)
    EXCLUDE_NODE = "exclude_node"  # this node's agent leaves; an elastic job goes on without it
    STOP_JOB = "stop_job"  # stop at once, no retry
    RERENDEZVOUS = "rerendezvous"  # membership changed (a peer left): new round, no restart used


@dataclass
class Decision:
    action: Action
    reason: str
    source: str = ""  # which detector or check produced the verdict
    rank: int | None = None
    evidence: dict[str, Any] = field(default_factory=dict)
    # For EXCLUDE_NODE: the message the leaving agent prints (seed wording).
    exit_message: str = ""


NODE_DOWN_MESSAGE = "The node is down."
STRAGGLER_EXIT_MESSAGE = "The node is a straggler and exits."

# --------------------------------------------------------------------------- failure causes

USER, HARDWARE, COMMUNICATION, SIGNAL, EXIT, ENVIRONMENT = (
    "user_code",
    "hardware",
    "communication",
    "signal",
    "exit",
    "environment",
)

# Log-diagnosis categories (the diagnosis monitor's names) -> cause. Unknown names fall back to
# the failure info itself.
DIAGNOSIS_CAUSES: dict[str, str] = {
    "python_exception": USER,
    "cuda_oom": USER,  # on healthy hardware: batch/model too big for the GPU; a retry fails again
    "cuda_error_other": USER,  # illegal address & co: a bug (hardware faults are gpu_hardware)
    "nan_loss": USER,
    "launcher": USER,  # bad script path / arguments
    "user_code": USER,
    "gpu_hardware": HARDWARE,
    "nccl_network": COMMUNICATION,
    "nccl_timeout": COMMUNICATION,
    "nccl_channel": COMMUNICATION,
    "nccl_gdr": COMMUNICATION,
    "rendezvous_failure": COMMUNICATION,
    "hang_no_error": COMMUNICATION,
    "segfault": SIGNAL,
    "host_oom": SIGNAL,
    "disk_full_or_io": ENVIRONMENT,  # a retry on the same full disk fails again
    # "dataloader", "healthy", "slowdown", "unknown": decided from the failure info itself
}

# Crash text that points at the GPU itself (driver/ECC/bus), not at the program.
_HARDWARE_TEXT = re.compile(
    r"uncorrectable ECC|ECC error|\bXid\b|fallen off the bus|GPU is lost|NVLink|"
    r"cudaErrorDevicesUnavailable|CUDA-capable device\(s\) is/are busy or unavailable|"
    r"CUDA error: unspecified launch failure",
    re.IGNORECASE,
)
# Text of errors that come from the collective/network layer: a peer died or the link broke.
_COMMUNICATION_TEXT = re.compile(
    r"DistBackendError|DistNetworkError|DistStoreError|ProcessGroupNCCL|ProcessGroupGloo|\bNCCL\b|"
    r"\bnccl\w*Error|\bgloo\b|Connection (?:reset|closed|refused)|Broken pipe|ECONNRESET|"
    r"No route to host|Socket Timeout|Watchdog caught collective|collective operation timeout|"
    r"timed out|TCPStore|RendezvousError",
    re.IGNORECASE,
)
_EXCEPTION_NAME = re.compile(r"^\s*((?:[A-Za-z_]\w*\.)*[A-Za-z_]\w*(?:Error|Exception|Exit|Interrupt))\b")
_USER_SIGNALS_HINT = {"SIGTERM", "SIGINT", "SIGHUP"}  # stopped from outside (preemption, kill)


@dataclass(frozen=True)
class FailureCause:
    kind: str  # one of USER, HARDWARE, COMMUNICATION, SIGNAL, EXIT, ENVIRONMENT
    rank: int | None
    detail: str

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "rank": self.rank, "detail": self.detail}


def _error_text(error_file_data: Any) -> tuple[str, str]:
    """(first line of the error message, full text incl. traceback) of a torch elastic error file."""
    if not error_file_data:
        return "", ""
    msg = (
        error_file_data.get("message", error_file_data)
        if isinstance(error_file_data, dict)
        else error_file_data
    )
    if isinstance(msg, dict):
        head = str(msg.get("message", ""))
        extra = msg.get("extraInfo") or {}
        stack = str(extra.get("py_callstack", "")) if isinstance(extra, dict) else ""
        return head, f"{head}\n{stack}"
    return str(msg), str(msg)


def _signal_name(info: dict[str, Any]) -> str | None:
    sig = info.get("signal")
    if sig:
        return str(sig)
    code = info.get("exitcode")
    if isinstance(code, int) and code < 0:  # torch elastic reports a signal death as -signum
        try:
            return _signal.Signals(-code).name
        except ValueError:
            return f"signal {-code}"
    return None


def classify_rank_failure(rank: int | None, info: dict[str, Any]) -> FailureCause:
    """What ended one worker, from its failure info (exit code, signal, error file, log tail)."""
    head, text = _error_text(info.get("error_file_data"))
    tail = "\n".join(str(x) for x in (info.get("log_tail") or [])[-50:])
    sig = _signal_name(info)
    if _HARDWARE_TEXT.search(text) or _HARDWARE_TEXT.search(tail):
        line = (_HARDWARE_TEXT.search(text) or _HARDWARE_TEXT.search(tail)).group(0)  # type: ignore[union-attr]
        return FailureCause(HARDWARE, rank, f"GPU/driver error in the output ({line})")
    if head:
        # Only the message itself: a user's traceback may quote code lines that mention "nccl".
        if _COMMUNICATION_TEXT.search(head):
            return FailureCause(COMMUNICATION, rank, head[:300])
        return FailureCause(USER, rank, head[:300])
    if sig:
        return FailureCause(SIGNAL, rank, f"killed by {sig}")
    # No error file: the log tail may still hold a Python traceback.
    lines = [ln.split("]: ", 1)[-1] for ln in (info.get("log_tail") or [])]
    exc = next((ln for ln in reversed(lines) if _EXCEPTION_NAME.match(ln)), None)
    if exc is not None and "Traceback (most recent call last)" in tail:
        kind = COMMUNICATION if _COMMUNICATION_TEXT.search(exc) else USER
        return FailureCause(kind, rank, exc.strip()[:300])
    return FailureCause(EXIT, rank, f"exit code {info.get('exitcode')}")


# Which rank's cause explains the failure when ranks differ: a hardware fault first; then the
# user's own exception (the other ranks' broken-connection errors are its consequence); then a
# crash signal; then a communication error; then a bare exit code.
_PRECEDENCE = [HARDWARE, USER, SIGNAL, COMMUNICATION, EXIT]


def classify_failures(
    failures: dict[int, dict[str, Any]], diagnosis: dict[str, Any] | None = None
) -> FailureCause:
    """The root cause of a group failure: the diagnosis when it names a known category, else the
    most telling of the per-rank causes."""
    if diagnosis:
        kind = DIAGNOSIS_CAUSES.get(str(diagnosis.get("category", "")))
        if kind is not None:
            summary = diagnosis.get("summary") or diagnosis.get("message") or diagnosis.get("category")
            first = diagnosis.get("first_failure") or {}
            rank = diagnosis.get("rank", first.get("rank") if isinstance(first, dict) else None)
            return FailureCause(kind, rank if isinstance(rank, int) else None, str(summary)[:300])
    causes = [classify_rank_failure(rank, info or {}) for rank, info in sorted(failures.items())]
    if not causes:
        return FailureCause(EXIT, None, "no failure information")
    return min(causes, key=lambda c: _PRECEDENCE.index(c.kind))


def decide_on_failure(
    failures: dict[int, dict[str, Any]],
    remaining_restarts: int,
    diagnosis: dict[str, Any] | None = None,
    hardware: dict[str, Any] | None = None,
) -> Decision:
    """Workers of this node failed. ``hardware`` is the quick check run after the failure
    (``{"healthy": bool, "faults": [...]}``, None when none ran)."""
    ranks = sorted(failures)
    cause = classify_failures(failures, diagnosis)
    hw_faulty = bool(hardware) and hardware.get("healthy") is False  # type: ignore[union-attr]
    evidence: dict[str, Any] = {
        "failed_ranks": ranks,
        "cause": cause.to_dict(),
        "diagnosis": diagnosis,
        "hardware": hardware,
        "remaining_restarts": remaining_restarts,
    }
    where = f"rank {cause.rank}" if cause.rank is not None else f"ranks {ranks}"
    if hw_faulty or cause.kind == HARDWARE:
        faults = list((hardware or {}).get("faults") or []) or [cause.detail]
        evidence["scenario"] = 3
        return Decision(
            Action.EXCLUDE_NODE,
            f"workers failed ({where}) and the hardware check found a fault: {'; '.join(map(str, faults))[:400]}"
            " -> isolating this node; the job restarts without it",
            source="hardware_check" if hw_faulty else "worker_exit",
            rank=cause.rank,
            evidence=evidence,
            exit_message=NODE_DOWN_MESSAGE,
        )
    if cause.kind in (USER, ENVIRONMENT):
        evidence["scenario"] = 4
        hw = "healthy hardware" if hardware else "no hardware fault known"
        return Decision(
            Action.STOP_JOB,
            f"user code failed on {hw} ({where}: {cause.detail}); a retry would fail the same way, no restart",
            source="worker_exit",
            rank=cause.rank,
            evidence=evidence,
        )
    if remaining_restarts <= 0:
        return Decision(
            Action.STOP_JOB,
            f"workers failed ({where}: {cause.detail}) and no restarts are left",
            source="worker_exit",
            rank=cause.rank,
            evidence=evidence,
        )
    return Decision(
        Action.RESTART,
        f"workers failed ({where}: {cause.detail}); restarting, {remaining_restarts} restart(s) left",
        source="worker_exit",
        rank=cause.rank,
        evidence=evidence,
    )


def on_worker_failure(
    failures: dict[int, dict[str, Any]], remaining_restarts: int, diagnosis: dict[str, Any] | None = None
) -> Decision:
    """Kept for callers of the first interface: ``decide_on_failure`` without a hardware check."""
    return decide_on_failure(failures, remaining_restarts, diagnosis, None)


# ------------------------------------------------------------------ before start (scenarios 1-2)


def min_nodes_of(nnodes_spec: Any, current: int) -> int:
    """The minimum of torchrun's ``--nnodes`` ("N" or "MIN:MAX"); ``current`` when unknown."""
    text = str(nnodes_spec or "").strip()
    try:
        return int(text.split(":", 1)[0]) if text else current
    except ValueError:
        return current


def decide_before_start(
    node_rank: int,
    nnodes: int,
    min_nodes: int,
    faulty: dict[int, str],
    stragglers: dict[int, str] | None = None,
    exclude_stragglers: bool = False,
    undetermined: str = "",
    evidence: dict[str, Any] | None = None,
    names: dict[int, str] | None = None,
) -> Decision | None:
    """The agreed verdict of the pre-checks / node check (same inputs on every node) -> this node's
    action. ``faulty``: node rank -> reason (pre-check failed or node check failed in every round).
    ``undetermined``: the check failed but could not tell which node (too few nodes)."""
    evidence = dict(evidence or {})
    stragglers = stragglers or {}
    names = names or {}

    def label(n: int) -> str:
        return f"node {n} ({names[n]})" if n in names else f"node {n}"

    leaving = dict(faulty)
    if exclude_stragglers:
        leaving.update({r: why for r, why in stragglers.items() if r not in leaving})
    evidence.update({"faulty": faulty, "stragglers": stragglers, "nnodes": nnodes, "min_nodes": min_nodes})
    if undetermined:
        return Decision(Action.STOP_JOB, undetermined, source="node_check", evidence=evidence)
    if node_rank in faulty:
        return Decision(
            Action.EXCLUDE_NODE,
            f"{label(node_rank)} failed its checks: {faulty[node_rank]}",
            source="precheck" if evidence.get("stage") == "precheck" else "node_check",
            evidence=evidence,
            exit_message=NODE_DOWN_MESSAGE,
        )
    if node_rank in leaving:
        return Decision(
            Action.EXCLUDE_NODE,
            f"{label(node_rank)} is a straggler: {leaving[node_rank]}",
            source="node_check",
            evidence=evidence,
            exit_message=STRAGGLER_EXIT_MESSAGE,
        )
    if not leaving:
        return None
    who = ", ".join(label(r) for r in sorted(leaving))
    left = nnodes - len(leaving)
    if left < max(1, min_nodes):
        return Decision(
            Action.STOP_JOB,
            f"{who} excluded; {left} node(s) left but the job needs at least {min_nodes} "
            "(make it elastic with --nnodes MIN:MAX to go on without them)",
            source=str(evidence.get("stage", "node_check")),
            evidence=evidence,
        )
    return Decision(
        Action.RERENDEZVOUS,
        f"{who} excluded; continuing on {left} node(s)",
        source=str(evidence.get("stage", "node_check")),
        evidence=evidence,
    )


def decide_on_hardware_fault(faults: list[str], evidence: dict[str, Any] | None = None) -> Decision:
    """The periodic hardware check found a fault while training: isolate the node (the job
    restarts without it where it is elastic)."""
    return Decision(
        Action.EXCLUDE_NODE,
        "periodic hardware check found a fault: " + "; ".join(faults)[:400],
        source="health_check",
        evidence={"faults": faults, **(evidence or {})},
        exit_message=NODE_DOWN_MESSAGE,
    )


def confirm_exclusion(decision: Decision, nnodes_now: int, min_nodes: int) -> Decision:
    """A detector asks to exclude this node while the job runs (a straggler, a hardware fault).

    Leaving is only worth it when the job can go on without this node: with fewer than ``--nnodes``
    MIN nodes left it would end the job. A straggler then stays (slow beats stopped) and is only
    reported; a hardware fault stops the job with the reason."""
    if decision.action != Action.EXCLUDE_NODE or nnodes_now - 1 >= min_nodes:
        return decision
    left = f"excluding this node would leave {nnodes_now - 1} node(s), below the minimum {min_nodes}"
    evidence = {**decision.evidence, "wanted": decision.action.value, "nnodes": nnodes_now, "min_nodes": min_nodes}
    if decision.exit_message == STRAGGLER_EXIT_MESSAGE:
        return Decision(Action.CONTINUE, f"{decision.reason}; kept: {left}", decision.source, decision.rank, evidence)
    return Decision(Action.STOP_JOB, f"{decision.reason}; {left}", decision.source, decision.rank, evidence)
