"""Which nodes are lost? A rule over heartbeat samples (no clocks, no I/O: callers pass the time).

Every agent adds to its own counter in the round's store once its workers have started
(monitors/liveness.py), so a counter still at 0 is a node that has not started its first workers
in this round: a node joining the job (a fresh agent, a node coming back) or one whose start is
slow under load. Its silence says nothing about its health yet: the bench's soak saw a
rejoining node declared lost after 4 s of "no heartbeat" while it was still starting its worker,
and the job re-formed once more for nothing. Such a node gets ``startup_s``, not the heartbeat
deadline; only positive proof (its address unreachable, from a probe) excludes it sooner.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

DONE = -1  # the counter of a node that marked itself finished (never lost)


@dataclass(frozen=True)
class Beat:
    """What this node last saw of another node's heartbeat."""

    count: int  # the node's counter: DONE, 0 (workers not started yet in this round) or its beats
    moved: float  # when the counter last changed (or was first read), in the caller's clock
    unreachable: bool = False  # a probe found its address unreachable (positive proof of loss)

    @property
    def starting(self) -> bool:
        return self.count == 0


def late_nodes(beats: Mapping[int, Beat], now: float, lost_after_s: float, startup_s: float) -> dict[int, float]:
    """node rank -> seconds silent, for every node lost by these samples.

    A node that beat in this round is lost after ``lost_after_s`` of silence; one still starting
    after ``startup_s`` (at least ``lost_after_s``), or after ``lost_after_s`` when its address is
    unreachable. A node that finished is never lost."""
    late: dict[int, float] = {}
    for n, b in beats.items():
        if b.count == DONE:
            continue
        silent = now - b.moved
        if not b.starting:
            limit = lost_after_s
        else:
            limit = lost_after_s if b.unreachable else max(startup_s, lost_after_s)
        if silent >= limit:
            late[n] = silent
    return late


def to_probe(beats: Mapping[int, Beat], now: float, lost_after_s: float) -> list[int]:
    """Starting nodes silent past the heartbeat deadline and not yet proven unreachable: the ones
    whose address a probe should try (the proof that would exclude them sooner)."""
    return [n for n, b in beats.items() if b.starting and not b.unreachable and now - b.moved >= lost_after_s]
