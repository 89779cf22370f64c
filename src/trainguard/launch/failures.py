"""Worker failures of one attempt: what each failed worker left behind, and in what order.

torch elastic reports every worker of a failed group; most of them are consequences. The agent
stops the rest of the group once one worker fails (those are *collateral*), and ranks that died
only because they lost their peer (a broken gloo/NCCL connection) failed *after* the one that
caused it. ``order`` keeps the failures that count, first failure first; when even the first one
only lost its peer, the real failure is on another node.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace

from torch.distributed.elastic.agent.server.api import RunResult

from trainguard.diagnose import classify_text
from trainguard.events import EventBus, Severity
from trainguard.evidence import RankFailure
from trainguard.exitcodes import signal_name
from trainguard.launch.logs import tail
from trainguard.launch.pcontext import TrainguardPContext


@dataclass(frozen=True)
class FailureSet:
    failures: dict[int, RankFailure]  # global rank -> failure, only those that count, first failure first
    stopped: list[int]  # ranks that were only stopped, or only lost their peer
    remote: bool  # even the first failure only lost its peer: the cause is on another node


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


def lost_peer(f: RankFailure) -> bool:
    """A failure that only reports losing a peer (which failed before it)."""
    # The diagnosis rules say which lines mean "lost a peer" (gloo, NCCL, c10d store): one source.
    return classify_text([str(f.message or ""), *f.log_tail[-15:]]).peer_loss


def order(everything: dict[int, RankFailure]) -> FailureSet:
    failures = {r: f for r, f in everything.items() if not f.collateral} or everything
    ranks = sorted(failures, key=lambda r: failures[r].when)
    # After the first failure, ranks that died of losing their peer are its consequence.
    ranks = ranks[:1] + [r for r in ranks[1:] if not lost_peer(failures[r])]
    kept = {r: replace(failures[r], first_failure=i == 0) for i, r in enumerate(ranks)}
    return FailureSet(
        failures=kept,
        stopped=sorted(set(everything) - set(kept)),
        remote=bool(ranks) and lost_peer(kept[ranks[0]]),
    )


def report(bus: EventBus, fs: FailureSet, attempt: int) -> None:
    """One ``worker_failed`` (or ``worker_lost_peer``, when the cause is on another node) per rank."""
    for rank, f in fs.failures.items():
        how = f"signal {f.signal}" if f.signal else f"exit code {f.exitcode}"
        also = f"; stopped ranks {fs.stopped}" if fs.stopped else ""
        bus.emit(
            "worker_lost_peer" if fs.remote else "worker_failed",
            f"rank {rank} (pid {f.pid}) exited with {how} after losing a peer on another node{also}"
            if fs.remote
            else f"rank {rank} (pid {f.pid}) failed with {how}{also}",
            severity=Severity.WARNING if fs.remote else Severity.ERROR,
            rank=rank,
            evidence={**f.to_dict(), "attempt": attempt, "stopped_ranks": fs.stopped},
        )
