"""The one place that decides what happens to the job: continue, restart, exclude a node, or stop.

Every input (a worker exit, a hang or straggler verdict, a check result, a log diagnosis) comes in
as data; every output is a ``Decision`` that the agent carries out and records as a
``policy_decision`` event with its evidence.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any


class Action(str, Enum):
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


def on_worker_failure(
    failures: dict[int, dict[str, Any]], remaining_restarts: int, diagnosis: dict[str, Any] | None = None
) -> Decision:
    """Workers exited with an error. Restart within the budget, else stop."""
    ranks = sorted(failures)
    first = ranks[0] if ranks else None
    if remaining_restarts <= 0:
        return Decision(
            Action.STOP_JOB,
            f"worker failure (ranks {ranks}) and no restarts left",
            source="worker_exit",
            rank=first,
            evidence={"failed_ranks": ranks, "diagnosis": diagnosis},
        )
    return Decision(
        Action.RESTART,
        f"worker failure (ranks {ranks}); {remaining_restarts} restart(s) left",
        source="worker_exit",
        rank=first,
        evidence={"failed_ranks": ranks, "diagnosis": diagnosis},
    )
