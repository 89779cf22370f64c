"""The one place that decides what happens to the job: continue, restart, exclude a node, or stop.

Every input is typed evidence (``trainguard.evidence``): a worker failure with its diagnosis and
hardware check, a hang, a straggler, a periodic hardware fault, the pre-start check outcome, news
from another node. Every output is a ``Decision`` that the agent carries out (``TrainguardAgent.
carry_out``) and records as a ``policy_decision`` event with its evidence. All functions here are
pure. Entry points:

- ``decide_before_start(outcome, ...)``      pre-check / node check outcome (seed scenarios 1-2)
- ``decide_on_failure(failures, ...)``       workers failed (scenarios 3-4, restarts in budget)
- ``guard_restart_loop(decision, attempts, ...)`` a restart that would repeat a restart loop stops
                                              the job (or isolates the node the loop follows)
- ``decide_while_running(evidence, ...)``    ``decide_on_hang``, ``decide_on_straggler``,
                                              ``decide_on_hardware_fault``
- ``decide_on_peer_news(news)``              another node stopped the job or left it
- ``decide_nan_replay``, ``decide_after_nan_replay`` (``triage_nan``): the NaN triage, a
  NaN failure replayed once from a finite snapshot before it is called the user's code

The seed's four scenarios (ModelArts fault tolerance):

1. pre-check failed, hardware faulty      -> isolate the node ("The node is down.")
2. pre-check failed, hardware healthy     -> isolate the node
3. user code failed, hardware check finds a fault -> isolate the node and restart the job
4. user code failed, hardware healthy     -> the job fails at once, no retry

An isolated node's agent exits; an elastic job (``--nnodes MIN:MAX`` with enough nodes left) goes
on without it, otherwise the job stops with the reason. Failures that are neither the user's code
nor a located hardware fault (a worker killed by a signal, a broken connection to a peer, an exit
without a Python error) are restarted while the ``--max-restarts`` budget lasts. A hang restarts
the job; a straggler is reported, and its node leaves only with ``--exclude-straggler`` and only
when the job can go on without it.
"""

from __future__ import annotations

import argparse
import re
from dataclasses import dataclass, field, replace
from enum import StrEnum
from typing import Any

from trainguard.cluster import node_history
from trainguard.detect.restart_loop import RestartLoop, find_restart_loop
from trainguard.evidence import (
    AttemptRecord,
    CheckOutcome,
    Diagnosis,
    HangEvidence,
    HardwareFault,
    HardwareReport,
    NanEvidence,
    NodeLost,
    PeerLeft,
    PeerNews,
    PeerStop,
    RankFailure,
    RunningEvidence,
    StragglerEvidence,
)
from trainguard.exitcodes import signal_name
from trainguard.options import given


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
RESTART_LOOP_EXIT_MESSAGE = "The node fails the same way at the same step in every attempt and exits."
STRAGGLER_EXIT_MESSAGE = "The node is a straggler and exits."


@dataclass(frozen=True)
class PolicySettings:
    """The user's choices the policy follows (flags of `trainguard run`, parsed once)."""

    nnodes: str = ""  # torchrun's --nnodes: "N" or "MIN:MAX"
    exclude_straggler: bool = False  # --exclude-straggler: a straggler's node leaves while training
    node_check_exclude_straggler: bool = False  # --node-check-exclude-straggler (or --exclude-straggler): ... before start
    restart_on_error: bool = False  # --restart-on-error: torchrun's restarts on the user's own exception too
    nan_replays: int = 2  # --nan-replays: NaN failures per run replayed from a snapshot (0: stop at once)
    restart_loop_attempts: int = 3  # --restart-loop-attempts: K attempts failing the same way at the same step stop the job (0: off)

    @classmethod
    def from_options(cls, options: argparse.Namespace) -> PolicySettings:
        loop = getattr(options, "restart_loop_attempts", None)
        return cls(
            nnodes=str(options.nnodes or ""),
            exclude_straggler=bool(options.exclude_straggler),
            # DLRover's --exclude-straggler also drops a straggler its network check finds
            node_check_exclude_straggler=bool(options.node_check_exclude_straggler or options.exclude_straggler),
            restart_on_error=bool(getattr(options, "restart_on_error", False)),
            **given(options, {"nan_replays": "nan_replays"}),
            **({"restart_loop_attempts": int(loop)} if loop is not None else {}),
        )

    def min_nodes(self, current: int) -> int:
        return min_nodes_of(self.nnodes, current)

# --------------------------------------------------------------------------- failure causes

USER, HARDWARE, COMMUNICATION, SIGNAL, EXIT, ENVIRONMENT = (
    "user_code",
    "hardware",
    "communication",
    "signal",
    "exit",
    "environment",
)

# Causes come from the diagnosis rules (src/trainguard/diagnose/rules/*.toml): each category and
# rule there carries its family, whose names are the causes above. One source of failure-text
# knowledge for the log diagnosis, the agent's cascade ordering and this policy.


def cause_of_category(category: str) -> str | None:
    """The cause of a diagnosis category (None: the category says nothing about the cause, e.g.
    healthy, slowdown, unknown: then the failure info decides)."""
    from trainguard.diagnose.rules import builtin_rules

    family = builtin_rules().family_for(category)
    return family if family in (USER, HARDWARE, COMMUNICATION, SIGNAL, EXIT, ENVIRONMENT) else None


def _text_family(text: str) -> str | None:
    from trainguard.diagnose import classify_text

    return classify_text(text).family if text.strip() else None


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


def _hardware_line(text: str) -> str | None:
    """The line of ``text`` that the rules say points at the GPU itself (driver, ECC, bus)."""
    from trainguard.diagnose import classify_text

    verdict = classify_text(text) if text.strip() else None
    return verdict.line if verdict is not None and verdict.family == HARDWARE else None


def classify_rank_failure(rank: int | None, f: RankFailure) -> FailureCause:
    """What ended one worker, from its failure (exit code, signal, error file, log tail)."""
    head, text = _error_text(f.error_file_data)
    tail = "\n".join(str(x) for x in f.log_tail[-50:])
    sig = signal_name(f.exitcode, f.signal)
    hardware = _hardware_line(text) or _hardware_line(tail)
    if hardware:
        return FailureCause(HARDWARE, rank, f"GPU/driver error in the output ({hardware[:200]})")
    if head:
        # Only the message itself: a user's traceback may quote code lines that mention "nccl".
        family = _text_family(head)
        if family == COMMUNICATION:
            return FailureCause(COMMUNICATION, rank, head[:300])
        if family == SIGNAL:  # a signal ended a process it ran (a DataLoader worker killed): not a code bug
            return FailureCause(SIGNAL, rank, head[:300])
        if family == ENVIRONMENT:  # a toolkit or library missing from the image: not the code either
            return FailureCause(ENVIRONMENT, rank, head[:300])
        return FailureCause(USER, rank, head[:300])
    if sig:
        return FailureCause(SIGNAL, rank, f"killed by {sig}")
    # No error file: the log tail may still hold a Python traceback.
    lines = [ln.split("]: ", 1)[-1] for ln in f.log_tail]
    exc = next((ln for ln in reversed(lines) if _EXCEPTION_NAME.match(ln)), None)
    if exc is not None and "Traceback (most recent call last)" in tail:
        family = _text_family(exc)
        kind = family if family in (COMMUNICATION, ENVIRONMENT) else USER
        return FailureCause(kind, rank, exc.strip()[:300])
    return FailureCause(EXIT, rank, f"exit code {f.exitcode}")


# Which rank's cause explains the failure when ranks differ: a hardware fault first; then the
# user's own exception or a broken environment (the other ranks' broken-connection errors are their
# consequence); then a crash signal; then a communication error; then a bare exit code.
_PRECEDENCE = [HARDWARE, USER, ENVIRONMENT, SIGNAL, COMMUNICATION, EXIT]


def classify_failures(failures: dict[int, RankFailure], diagnosis: Diagnosis | None = None) -> FailureCause:
    """The root cause of a group failure: the diagnosis when it names a known category, else the
    most telling of the per-rank causes."""
    if diagnosis is not None and diagnosis.confidence != "low":  # a low-confidence verdict is a lead, not a cause
        family = diagnosis.details.get("family")  # the deciding rule's own family, else the category's
        kind = family if family in _PRECEDENCE else cause_of_category(diagnosis.category)
        if kind is not None:
            return FailureCause(kind, diagnosis.rank, (diagnosis.summary or diagnosis.category)[:300])
    causes = [classify_rank_failure(rank, f) for rank, f in sorted(failures.items())]
    if not causes:
        return FailureCause(EXIT, None, "no failure information")
    return min(causes, key=lambda c: _PRECEDENCE.index(c.kind))


def decide_on_failure(
    failures: dict[int, RankFailure],
    remaining_restarts: int,
    diagnosis: Diagnosis | None = None,
    hardware: HardwareReport | None = None,
    hang: HangEvidence | None = None,
    new_round_pending: bool = False,
    restart_on_error: bool = False,
) -> Decision:
    """Workers of this node failed. ``diagnosis``: the log diagnosis of the attempt; ``hardware``:
    the quick check run after the failure (None when none ran); ``hang``: the job's hang verdict,
    when one stands (on several nodes, a node restarting on it makes the others' workers lose
    their peers: they act on the verdict too, not on a failure of their own).
    ``new_round_pending``: nodes wait in the rendezvous for a new round (one joined late, or
    another node's agent already left this round for it): a failure to reach peers is then that
    peer moving on, a membership change that does not use the restart budget.
    ``restart_on_error`` (--restart-on-error): the user's own exception is restarted like any other
    failure while restarts are left, as torchrun does, instead of stopping the job at once."""
    ranks = sorted(failures)
    on_hang = decide_on_hang(hang) if hang is not None else None
    if on_hang is not None:
        evidence = {**on_hang.evidence, "failed_ranks": ranks, "remaining_restarts": remaining_restarts}
        if remaining_restarts <= 0:
            return Decision(Action.STOP_JOB, f"{on_hang.reason}; no restarts are left", "hang", on_hang.rank, evidence)
        return replace(on_hang, evidence=evidence)
    cause = classify_failures(failures, diagnosis)
    hw_faulty = hardware is not None and not hardware.healthy
    evidence: dict[str, Any] = {
        "failed_ranks": ranks,
        "cause": cause.to_dict(),
        "diagnosis": diagnosis.to_dict() if diagnosis is not None else None,
        "hardware": hardware.summary() if hardware is not None else None,
        "remaining_restarts": remaining_restarts,
    }
    where = f"rank {cause.rank}" if cause.rank is not None else f"ranks {ranks}"
    source, exit_message = "worker_exit", ""
    if hw_faulty or cause.kind == HARDWARE:
        faults = list(hardware.faults if hardware is not None else []) or [cause.detail]
        evidence["scenario"] = 3
        action = Action.EXCLUDE_NODE
        reason = (
            f"workers failed ({where}) and the hardware check found a fault: {'; '.join(map(str, faults))[:400]}"
            " -> isolating this node; the job restarts without it"
        )
        source = "hardware_check" if hw_faulty else source
        exit_message = NODE_DOWN_MESSAGE
    elif new_round_pending and cause.kind == COMMUNICATION:
        evidence["membership_change"] = True
        action = Action.RERENDEZVOUS
        reason = (f"workers failed ({where}: {cause.detail}) while nodes wait for a new rendezvous round: "
                  "a peer moved on to it (a node joined or restarted); no restart used")
    elif cause.kind in (USER, ENVIRONMENT) and restart_on_error and remaining_restarts > 0:
        action = Action.RESTART
        reason = (f"user code failed ({where}: {cause.detail}); --restart-on-error: restarting, "
                  f"{remaining_restarts} restart(s) left")
    elif cause.kind in (USER, ENVIRONMENT) and not restart_on_error:
        evidence["scenario"] = 4
        hw = "healthy hardware" if hardware is not None else "no hardware fault known"
        action = Action.STOP_JOB
        reason = (f"user code failed on {hw} ({where}: {cause.detail}); a retry would fail the same way, no restart"
                  if cause.kind == USER else
                  f"the job's environment is broken on {hw} ({where}: {cause.detail}): fix the environment (image, "
                  "toolkits, start shell), not the code; a retry in it would fail the same way, no restart")
    elif remaining_restarts <= 0:
        action = Action.STOP_JOB
        reason = f"workers failed ({where}: {cause.detail}) and no restarts are left"
    else:
        action = Action.RESTART
        reason = f"workers failed ({where}: {cause.detail}); restarting, {remaining_restarts} restart(s) left"
    if diagnosis is not None and diagnosis.confidence == "low" and cause_of_category(diagnosis.category):
        reason += f" (the log diagnosis, {diagnosis.category}, has low confidence: not acted on)"
    return Decision(action, reason, source=source, rank=cause.rank, evidence=evidence, exit_message=exit_message)


_SIGNAL_NAME = re.compile(r"\bSIG[A-Z0-9]+\b")


def failure_kind(failures: dict[int, RankFailure], diagnosis: Diagnosis | None = None) -> str:
    """The kind of a failure, as the restart-loop guard compares them: the cause's kind, with the
    signal of a signal death and the code of a bare exit (messages are not compared: they carry
    pids, addresses, times)."""
    cause = classify_failures(failures, diagnosis)
    if cause.kind == SIGNAL:
        sig = _SIGNAL_NAME.search(cause.detail)
        return f"{SIGNAL} {sig[0]}" if sig else SIGNAL
    if cause.kind == EXIT:
        return f"{EXIT} {cause.detail}"
    return cause.kind


def guard_restart_loop(
    decision: Decision, attempts: list[AttemptRecord], settings: PolicySettings, nnodes: int
) -> Decision:
    """A restart the failure policy wants, checked against the attempts before it: when the last
    ``--restart-loop-attempts`` attempts failed the same way without passing the step the one
    before failed at, restarting again from the same state is known to fail: stop (exit 1, a
    permanent failure for the scheduler), or, when the failures followed this node while others
    trained with it, exclude it and go on without it (stop if too few nodes would be left)."""
    if decision.action != Action.RESTART or decision.source == "nan_triage":  # a NaN replay is the triage's
        return decision
    loop = find_restart_loop(attempts, settings.restart_loop_attempts)
    if loop is None:
        return decision
    return decide_on_restart_loop(loop, decision, nnodes, settings.min_nodes(nnodes))


def decide_on_restart_loop(loop: RestartLoop, wanted: Decision, nnodes: int, min_nodes: int) -> Decision:
    left = wanted.evidence.get("remaining_restarts")
    evidence = {**wanted.evidence, "restart_loop": loop.to_dict(), "tried": f"{len(loop.attempts)} attempts ({len(loop.attempts) - 1} restarts)",
                "wanted": wanted.action.value}
    if loop.node is not None:
        exclude = Decision(
            Action.EXCLUDE_NODE,
            f"restart loop on node {loop.node}: {loop.describe()} -> isolating this node; the job goes on without it",
            "restart_loop", wanted.rank, evidence, exit_message=RESTART_LOOP_EXIT_MESSAGE,
        )  # fmt: skip
        return confirm_exclusion(exclude, nnodes, min_nodes)
    return Decision(
        Action.STOP_JOB,
        f"restart loop: {loop.describe()}; another restart from the same state would fail the same way: "
        f"stopping ({left} restart(s) were left)",
        "restart_loop", wanted.rank, evidence,
    )  # fmt: skip


def decide_without_policy(error: Exception) -> Decision:
    """Deciding failed (a bug here): restart, what torch elastic itself would do, rather than let
    the policy take the job down with it."""
    return Decision(Action.RESTART, f"policy error ({error}); default restart", source="agent")


# ------------------------------------------------------------------ before start (scenarios 1-2)


def min_nodes_of(nnodes_spec: Any, current: int) -> int:
    """The minimum of torchrun's ``--nnodes`` ("N" or "MIN:MAX"); ``current`` when unknown."""
    text = str(nnodes_spec or "").strip()
    try:
        return int(text.split(":", 1)[0]) if text else current
    except ValueError:
        return current


def decide_before_start(
    outcome: CheckOutcome, node_rank: int, nnodes: int, min_nodes: int, exclude_stragglers: bool = False
) -> Decision | None:
    """The agreed outcome of a pre-start stage (the same on every node) -> this node's action.
    None: nothing to do, workers start."""
    faulty, stragglers, names = outcome.faulty, outcome.stragglers, outcome.names

    def label(n: int) -> str:
        return f"node {n} ({names[n]})" if n in names else f"node {n}"

    leaving = dict(faulty)
    if exclude_stragglers:
        leaving.update({r: why for r, why in stragglers.items() if r not in leaving})
    evidence: dict[str, Any] = {"stage": outcome.stage}
    if outcome.stage == "precheck":
        evidence["scenario"] = (1 if node_rank in outcome.hardware_faulty else 2) if node_rank in faulty else None
    evidence.update(outcome.details)
    mine = (outcome.details.get("outcomes") or {}).get(str(node_rank))
    if isinstance(mine, dict) and mine.get("history_refused"):
        evidence["history_refused"] = True  # refused by the node history (a new record would count itself up)
    evidence.update({"faulty": faulty, "stragglers": stragglers, "nnodes": nnodes, "min_nodes": min_nodes})
    source = outcome.stage
    if outcome.undetermined:
        return Decision(Action.STOP_JOB, outcome.undetermined, source=source, evidence=evidence)
    if node_rank in faulty:
        return Decision(
            Action.EXCLUDE_NODE,
            f"{label(node_rank)} failed its checks: {faulty[node_rank]}",
            source=source,
            evidence=evidence,
            exit_message=NODE_DOWN_MESSAGE,
        )
    if node_rank in leaving:
        return Decision(
            Action.EXCLUDE_NODE,
            f"{label(node_rank)} is a straggler: {leaving[node_rank]}",
            source=source,
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
            source=source,
            evidence=evidence,
        )
    return Decision(Action.RERENDEZVOUS, f"{who} excluded; continuing on {left} node(s)", source=source, evidence=evidence)


# ------------------------------------------------------------------------- while running


def decide_on_hang(hang: HangEvidence) -> Decision | None:
    """A hang restarts the job (torch elastic then uses the restart budget) only when detected on
    evidence that rules out healthy work: the culprit's wait is proven dead, or at the seed's
    window nothing in the job moved (no I/O, flat utilisation, no rank progressing). A suspicion
    is a warning the monitor already recorded: keep watching (None). A culprit that progresses is
    never killed, whatever the rule says."""
    if hang.level != "detected":
        return None
    if hang.progressing:
        return None
    who = f"rank {hang.rank}" if hang.rank is not None else "no single rank"
    return Decision(
        Action.RESTART,
        f"hang: culprit {who}: {hang.reason}",
        source="hang",
        rank=hang.rank,
        evidence={"rule": hang.rule, "causes": hang.causes, "report": hang.report, "progress": hang.progress,
                  "recorded_by": hang.recorded_by},  # fmt: skip
    )


def decide_on_straggler(
    straggler: StragglerEvidence, exclude: bool, nnodes: int, min_nodes: int
) -> Decision | None:
    """A rank of this node is a straggler. Reported only (None) unless ``--exclude-straggler``;
    then its node leaves, if the job can go on without it (else it is kept: slow beats stopped)."""
    if not exclude:
        return None
    wanted = Decision(
        Action.EXCLUDE_NODE,
        straggler.message,
        source="straggler",
        rank=straggler.rank,
        evidence=straggler.to_dict(),
        exit_message=STRAGGLER_EXIT_MESSAGE,
    )
    return confirm_exclusion(wanted, nnodes, min_nodes)


def decide_on_hardware_fault(fault: HardwareFault, nnodes: int, min_nodes: int) -> Decision:
    """The periodic hardware check found a fault while training: isolate the node (the job
    restarts without it where it is elastic; otherwise it stops with the reason)."""
    wanted = Decision(
        Action.EXCLUDE_NODE,
        "periodic hardware check found a fault: " + "; ".join(fault.faults)[:400],
        source="health_check",
        evidence={"faults": list(fault.faults), "node": fault.node, "node_rank": fault.node_rank},
        exit_message=NODE_DOWN_MESSAGE,
    )
    return confirm_exclusion(wanted, nnodes, min_nodes)


def decide_on_node_lost(lost: NodeLost, nnodes: int, min_nodes: int, standbys: int = 0) -> Decision:
    """Nodes vanished (no heartbeat, training blocked): go on without them in a new round, which
    does not use the restart budget, when enough nodes remain (counting the standby nodes that
    wait in the rendezvous, which take the lost nodes' places in that round: agent/standby.py);
    otherwise restart (using the budget) and let the rendezvous wait for a replacement."""
    left = nnodes - len(lost.nodes)
    replaced = min(standbys, len(lost.nodes))
    evidence = {**lost.to_dict(), "nnodes": nnodes, "min_nodes": min_nodes, "standbys": standbys}
    if replaced and left + replaced >= min_nodes:
        return Decision(Action.RERENDEZVOUS, f"{lost.message}; {replaced} standby node(s) take the place: going on with "
                        f"{left + replaced} node(s)", "node_lost", None, evidence)  # fmt: skip
    if left >= min_nodes:
        return Decision(Action.RERENDEZVOUS, f"{lost.message}; going on with {left} node(s)", "node_lost", None, evidence)
    return Decision(
        Action.RESTART, f"{lost.message}; {left} node(s) left, below the minimum {min_nodes}: waiting for a replacement",
        "node_lost", None, evidence,
    )  # fmt: skip


def decide_while_running(evidence: RunningEvidence, settings: PolicySettings, nnodes: int,
                         standbys: int = 0) -> Decision | None:
    """A monitor's evidence while workers run -> the decision (None: nothing to do). ``standbys``:
    standby nodes waiting in the rendezvous (read for a NodeLost only)."""
    if isinstance(evidence, HangEvidence):
        return decide_on_hang(evidence)
    if isinstance(evidence, StragglerEvidence):
        return decide_on_straggler(evidence, settings.exclude_straggler, nnodes, settings.min_nodes(nnodes))
    if isinstance(evidence, HardwareFault):
        return decide_on_hardware_fault(evidence, nnodes, settings.min_nodes(nnodes))
    if isinstance(evidence, NodeLost):
        return decide_on_node_lost(evidence, nnodes, settings.min_nodes(nnodes), standbys)
    raise TypeError(f"no policy for evidence of type {type(evidence).__name__}")


def confirm_exclusion(decision: Decision, nnodes_now: int, min_nodes: int) -> Decision:
    """Leaving is only worth it when the job can go on without this node: with fewer than
    ``--nnodes`` MIN nodes left it would end the job. A straggler then stays (slow beats stopped)
    and is only reported; a hardware fault stops the job with the reason."""
    if decision.action != Action.EXCLUDE_NODE or nnodes_now - 1 >= min_nodes:
        return decision
    left = f"excluding this node would leave {nnodes_now - 1} node(s), below the minimum {min_nodes}"
    evidence = {**decision.evidence, "wanted": decision.action.value, "nnodes": nnodes_now, "min_nodes": min_nodes}
    if decision.exit_message == STRAGGLER_EXIT_MESSAGE:
        return Decision(Action.CONTINUE, f"{decision.reason}; kept: {left}", decision.source, decision.rank, evidence)
    return Decision(Action.STOP_JOB, f"{decision.reason}; {left}", decision.source, decision.rank, evidence)


# ------------------------------------------------------------------------------ other nodes


def decide_on_peer_news(news: PeerNews) -> Decision:
    """Another node's policy stopped the job: stop here too. Another node left: go on without it
    (a new rendezvous round, which does not use the restart budget)."""
    if isinstance(news, PeerStop):
        return Decision(Action.STOP_JOB, news.reason, source="peer")
    if isinstance(news, PeerLeft):
        return Decision(Action.RERENDEZVOUS, f"node {news.node} left the job", source="peer")
    raise TypeError(f"no policy for news of type {type(news).__name__}")


# ------------------------------------------------------------------------------ NaN triage
# A NaN/inf loss or gradient is not always the user's code: silent data corruption on a faulty GPU
# or host produces NaNs that do not reproduce elsewhere (torchtitan #951). Before stopping on it,
# the job is replayed once from the newest finite snapshot with every rank checking its gradients
# before their reduction (worker/nancheck.py), which names the first rank that goes non-finite.

NAN_CATEGORY = "nan_loss"


class NanVerdict(StrEnum):
    TRANSIENT = "transient"  # the replay went past the failure without a non-finite value
    HARDWARE = "hardware"  # reproduced on the same rank and node, and that node's hardware check found a fault
    CODE_OR_DATA = "code_or_data"  # reproduced elsewhere, everywhere, or on healthy hardware


def is_nan_failure(diagnosis: Diagnosis | None) -> bool:
    """The attempt failed on a non-finite loss or gradient (a verdict, not a low-confidence lead)."""
    return diagnosis is not None and diagnosis.category == NAN_CATEGORY and diagnosis.confidence != "low"


def triage_nan(first: NanEvidence, replay: NanEvidence | None, hardware: HardwareReport | None,
               node: str) -> NanVerdict:
    """What the replay says about a NaN (pure). ``first``: the attempt that failed on it;
    ``replay``: the non-finite value the replay found (None: none up to past the failure's point);
    ``hardware``: this node's hardware check after the replay (None: none ran); ``node``: this node.
    Hardware only on positive proof: the very same rank and node both times, on this node, whose
    check found a fault, and the NaN not on other nodes' ranks too."""
    if replay is None:
        return NanVerdict.TRANSIENT
    same = (replay.rank is not None and replay.rank == first.rank and replay.node == first.node == node)
    elsewhere_too = any(n != node for n in replay.nodes)
    if same and not elsewhere_too and hardware is not None and not hardware.healthy:
        return NanVerdict.HARDWARE
    return NanVerdict.CODE_OR_DATA


def _where(e: NanEvidence) -> str:
    rank = f"rank {e.rank}" if e.rank is not None else "no single rank"
    node = f" on node {e.node}" if e.node else ""
    step = f" at its step {e.step} of the attempt" if e.step is not None else ""
    return f"{rank}{node}{step} ({e.source.replace('_', ' ')})"


def decide_nan_replay(first: NanEvidence, replays_left: int) -> Decision | None:
    """A NaN failure: replay it once from the newest finite snapshot, with the gradient check on
    (RESTART with source "nan_triage"; the agent gives the restart budget back). None: no
    replays left, the failure is decided as before (the user's code: stop)."""
    if replays_left <= 0:
        return None
    return Decision(
        Action.RESTART,
        f"non-finite loss/gradient ({_where(first)}): replaying from the newest finite snapshot with the "
        "gradient check on, to tell a transient fault from the code or the data",
        source="nan_triage",
        rank=first.rank,
        evidence={"nan_first": first.to_dict(), "replays_left": replays_left - 1},
    )


def decide_after_nan_replay(first: NanEvidence, replay: NanEvidence | None, hardware: HardwareReport | None,
                            node: str, nnodes: int, min_nodes: int) -> Decision:
    """The replay's outcome -> CONTINUE (transient), EXCLUDE_NODE (hardware) or STOP_JOB (code or data)."""
    verdict = triage_nan(first, replay, hardware, node)
    evidence = {"verdict": verdict.value, "nan_first": first.to_dict(),
                "nan_replay": replay.to_dict() if replay is not None else None,
                "hardware": hardware.summary() if hardware is not None else None}  # fmt: skip
    if verdict == NanVerdict.TRANSIENT:
        return Decision(Action.CONTINUE, f"NaN did not reproduce in the replay: a transient fault at {_where(first)}; "
                        "training goes on", "nan_triage", first.rank, evidence)  # fmt: skip
    assert replay is not None
    if verdict == NanVerdict.HARDWARE:
        faults = "; ".join(hardware.faults if hardware is not None else [])[:400]
        wanted = Decision(Action.EXCLUDE_NODE, f"NaN reproduced on the same rank and node ({_where(replay)}) and the "
                          f"hardware check found a fault: {faults} -> isolating this node", "nan_triage", replay.rank,
                          evidence, exit_message=NODE_DOWN_MESSAGE)  # fmt: skip
        return confirm_exclusion(wanted, nnodes, min_nodes)
    evidence["scenario"] = 4
    return Decision(Action.STOP_JOB, f"NaN reproduced in the replay (first non-finite: {_where(replay)}): the code or "
                    "the data, not a transient fault; no restart", "nan_triage", replay.rank, evidence)  # fmt: skip
# ------------------------------------------------------------------------------ node history


def history_kind(d: Decision) -> str | None:
    """What a decision made on this node puts in the site's node history (None: nothing): a
    hardware-class fault of this host (seed scenarios 1 and 3, the periodic check), a restart loop
    that followed it, or another exclusion. A refusal by the history itself is an exclusion, not a
    new fault (it would count itself up)."""
    if d.source == "restart_loop":
        return node_history.RESTART_LOOP if (d.evidence.get("restart_loop") or {}).get("node") else None
    if d.evidence.get("history_refused") and d.action == Action.EXCLUDE_NODE:
        return node_history.EXCLUSION
    if d.source in ("hardware_check", "health_check") or d.evidence.get("scenario") in (1, 3):
        return node_history.HARDWARE
    return node_history.EXCLUSION if d.action == Action.EXCLUDE_NODE else None
