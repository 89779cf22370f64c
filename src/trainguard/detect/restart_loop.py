"""The restart-loop detector (pure): attempt after attempt fails the same way at the same place.

A job whose failure recurs at the same step (a bad batch, a corrupt shard, a native crash in a
kernel) restarts from the same snapshot every time and fails again; torch elastic would spend the
whole restart budget on it. ``find_restart_loop`` sees it in the agent's attempt records: the last
``k`` attempts are consecutive, all failed of this node's own accord with the same kind of
failure, and none passed the step at which the attempt before it failed. Anything unknown (a step
not seen, a gap in the attempts, a failure that only lost a peer) is no proof: no loop.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from trainguard.evidence import AttemptRecord


@dataclass(frozen=True)
class RestartLoop:
    attempts: tuple[AttemptRecord, ...]
    node: str | None  # the node the failures followed (None: a single-node job, nothing to tell apart)

    @property
    def kind(self) -> str:
        return self.attempts[-1].kind

    @property
    def steps(self) -> list[int | None]:
        return [a.step for a in self.attempts]

    def describe(self) -> str:
        first, last = self.attempts[0].attempt, self.attempts[-1].attempt
        return (f"attempts {first}-{last} all failed ({self.kind}) without passing the step the attempt before "
                f"failed at (steps {', '.join(str(s) for s in self.steps)}, {self.attempts[-1].step_source})")

    def to_dict(self) -> dict[str, Any]:
        return {"attempts": [a.to_dict() for a in self.attempts], "steps": self.steps, "kind": self.kind,
                "node": self.node}


def find_restart_loop(records: Sequence[AttemptRecord], k: int) -> RestartLoop | None:
    """The loop the last ``k`` records show, else None (``k`` 0: the guard is off)."""
    if k <= 0 or len(records) < k:
        return None
    last = list(records[-k:])
    if any(not r.own or r.step is None for r in last):
        return None
    if len({r.kind for r in last}) != 1 or len({r.step_source for r in last}) != 1:
        return None
    for before, after in zip(last, last[1:], strict=False):
        if after.attempt != before.attempt + 1 or after.step > before.step:  # type: ignore[operator]
            return None
    followed = len({r.node for r in last}) == 1 and all(r.nnodes > 1 for r in last)
    return RestartLoop(tuple(last), last[-1].node if followed else None)
