"""Worker failures of one attempt: what each failed worker left behind, and in what order.

torch elastic reports every worker of a failed group; most of them are consequences. The agent
stops the rest of the group once one worker fails (those are *collateral*), and ranks that died
only because they lost their peer (a broken gloo/NCCL connection) failed *after* the one that
caused it. ``order`` keeps the failures that count, first failure first; when even the first one
only lost its peer, the real failure is on another node.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, replace

from torch.distributed.elastic.agent.server.api import RunResult

from trainguard.diagnose import classify_text
from trainguard.events import EventBus, Severity
from trainguard.evidence import RankFailure
from trainguard.exitcodes import signal_name
from trainguard.schedulers import adapter as scheduler
from trainguard.spawn.logs import tail
from trainguard.spawn.pcontext import TrainguardPContext


@dataclass(frozen=True)
class FailureSet:
    failures: dict[int, RankFailure]  # global rank -> failure, only those that count, first failure first
    stopped: list[int]  # ranks that were only stopped, or only lost their peer
    remote: bool  # even the first failure only lost its peer: the cause is on another node

    @property
    def own(self) -> list[int]:
        """Ranks that failed of this node's own accord: not stopped by the agent, and not the first
        failure when even that one only lost its peer (the others kept never only lost theirs)."""
        return sorted(r for r, f in self.failures.items() if not f.collateral and not (self.remote and f.first_failure))


def collect(result: RunResult, procs: TrainguardPContext | None) -> dict[int, RankFailure]:
    """global rank -> what the failed worker left: exit code, error file, log tail, exit time."""
    logs = procs.rank_logs if procs is not None else {}
    primary = procs.primary_failures if procs is not None else None
    exit_times = procs.exit_times if procs is not None else {}
    out = {}
    for rank, failure in result.failures.items():
        data = failure.error_file_data if isinstance(failure.error_file_data, dict) else None
        if not failure.error_file or not os.path.exists(failure.error_file):
            data = None  # torch fills in a placeholder ({"message": "<NONE>"}) when there is no file
        out[rank] = RankFailure(
            local_rank=failure.local_rank,
            pid=failure.pid,
            exitcode=failure.exitcode,
            signal=signal_name(failure.exitcode),
            error_file_data=data or None,
            message=failure.message if data else None,
            timestamp=failure.timestamp,
            exit_time=exit_times.get(failure.local_rank),
            log_tail=tuple(tail(logs.get(rank))),
            collateral=primary is not None and failure.local_rank not in primary,
        )
    return out


EARLY_EXIT = "finished its script (exit code 0) while the other ranks were still running: it left the job early"


def early_exits(result: RunResult, procs: TrainguardPContext | None) -> dict[int, RankFailure]:
    """Ranks of this node whose script finished before the first failure (global rank -> failure).
    Torch elastic does not count them (exit code 0), or counts them as stopped (still in the
    interpreter's teardown when the agent stopped the group); when the failures that follow only
    lost their peer, such a rank is their cause (see ``order``)."""
    if procs is None:
        return {}
    primary = procs.primary_failures or set()
    now = time.time()
    first = min((procs.exit_times.get(lr, now) for lr in primary), default=now)
    logs = procs.rank_logs
    out = {}
    for lr, handler in procs.subprocess_handlers.items():
        done = procs.finished_at(lr)
        if lr in primary or done is None or done >= first:
            continue
        rank = procs.global_rank(lr)
        out[rank] = RankFailure(local_rank=lr, pid=handler.proc.pid, exitcode=procs.exit_codes.get(lr), message=f"rank {rank} {EARLY_EXIT}",
                                exit_time=done, log_tail=tuple(tail(logs.get(rank))))
    return out


# What a scheduler sends every process of a job at once when it stops it (Slurm: SIGTERM to each
# process of the step, in no order), or a person to a process group: not SIGKILL.
STOP_SIGNALS = frozenset(sig.name for sig in scheduler.STOP_SIGNALS)


def stopped_by_signal(failures: dict[int, RankFailure]) -> bool:
    """Every failure is a death by a stop signal: the agent's own copy may still be on its way, and
    then the job is being stopped (preempted, cancelled), not failing."""
    return bool(failures) and all(f.signal in STOP_SIGNALS for f in failures.values())


def warm() -> None:
    """Load the diagnosis rules and compile their scanner now (tens of ms), so that the first
    failure of the job is not the one to pay for it on its way to the restart."""
    classify_text(["RuntimeError: trainguard warm-up line"])


def lost_peer(f: RankFailure) -> bool:
    """A failure that only reports losing a peer (which failed before it)."""
    # The diagnosis rules say which lines mean "lost a peer" (gloo, NCCL, c10d store): one source.
    return classify_text([str(f.message or ""), *f.log_tail[-15:]]).peer_loss


# How far apart two exits may be noted out of order. Each worker's exit is timed by its own waiter
# thread; under load a thread can note a rank's death milliseconds after the peer that died *of*
# it (gloo reports a closed connection at once). Seen in full-suite runs: a SIGKILLed rank noted
# 2 ms after, and a rank that raised ValueError 6 ms after, the peer that lost it.
EXIT_TIME_SLACK_S = 0.5


def _own_failure_first(failures: dict[int, RankFailure], ranks: list[int], lost: dict[int, bool]) -> list[int]:
    """Within the slack the exit times cannot order two failures; what they say can. When the
    first failure only lost its peer and, within the slack, a rank of this node failed of its own
    accord (a signal, its own exception; the agent's stops are collateral, already left out), that
    rank is the first failure: its failure explains the peer loss, a peer loss explains nothing
    here. ``lost``: rank -> whether its failure only lost a peer."""
    if not ranks or not lost[ranks[0]]:
        return ranks
    t0 = failures[ranks[0]].when
    own = next((r for r in ranks[1:] if not lost[r] and failures[r].when - t0 <= EXIT_TIME_SLACK_S), None)
    return ranks if own is None else [own, *(r for r in ranks if r != own)]


def order(everything: dict[int, RankFailure], early: dict[int, RankFailure] | None = None) -> FailureSet:
    """``early``: ranks that exited 0 before the failures (``early_exits``); the first of them is
    the first failure when the first real failure only lost its peer."""
    failures = {r: f for r, f in everything.items() if not f.collateral} or everything
    lost = {r: lost_peer(f) for r, f in failures.items()}  # each failure's lines scanned once
    ranks = _own_failure_first(failures, sorted(failures, key=lambda r: failures[r].when), lost)
    if early and ranks and lost[ranks[0]]:
        first = min(early, key=lambda r: early[r].when)  # it left; its peers then lost it
        failures = {**failures, first: early[first]}
        everything = {**everything, first: early[first]}
        lost[first] = lost_peer(early[first])
        ranks = [first, *ranks]
    # After the first failure, ranks that died of losing their peer are its consequence.
    ranks = ranks[:1] + [r for r in ranks[1:] if not lost[r]]
    kept = {r: replace(failures[r], first_failure=i == 0) for i, r in enumerate(ranks)}
    return FailureSet(
        failures=kept,
        stopped=sorted(set(everything) - set(kept)),
        remote=bool(ranks) and lost[ranks[0]],
    )


def report_exit_crashes(bus: EventBus, procs: TrainguardPContext, attempt: int) -> None:
    """Ranks that crashed after their script finished, in a group that succeeded: a warning, not a
    failure (nothing to restart: the work is done)."""
    local = {procs.global_rank(lr): lr for lr in procs.subprocess_handlers}
    for rank, code in sorted(procs.exit_crashes.items()):
        how = f"signal {signal_name(code)}" if signal_name(code) else f"exit code {code}"
        bus.emit(
            "worker_exit_crash",
            f"rank {rank} crashed with {how} after its training script had finished (in the interpreter's "
            "teardown, e.g. torch's gloo/NCCL destructors): the work is done, counted as a success",
            severity=Severity.WARNING,
            rank=rank,
            evidence={"exitcode": code, "signal": signal_name(code), "attempt": attempt,
                      "log_tail": list(tail(procs.rank_logs.get(rank)))[-10:], "local_rank": local.get(rank)},
        )


def report(bus: EventBus, fs: FailureSet, attempt: int) -> None:
    """One ``worker_failed`` (or ``worker_lost_peer``, when the cause is on another node) per rank."""
    for rank, f in fs.failures.items():
        how = f"signal {f.signal}" if f.signal else f"exit code {f.exitcode}"
        also = f"; stopped ranks {fs.stopped}" if fs.stopped else ""
        if fs.remote:
            msg = f"rank {rank} (pid {f.pid}) exited with {how} after losing a peer on another node{also}"
        elif EARLY_EXIT in str(f.message):
            msg = f"rank {rank} (pid {f.pid}) {EARLY_EXIT}{also}"
        else:
            msg = f"rank {rank} (pid {f.pid}) failed with {how}{also}"
        bus.emit(
            "worker_lost_peer" if fs.remote else "worker_failed",
            msg,
            severity=Severity.WARNING if fs.remote else Severity.ERROR,
            rank=rank,
            evidence={**f.to_dict(), "attempt": attempt, "stopped_ranks": fs.stopped},
        )
