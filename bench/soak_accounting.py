"""bench/soak.py's pure parts: the seeded fault schedule and the effective-training-time (ETTR)
accounting. No I/O, no clocks: the same inputs give the same figures (tests/test_soak_accounting.py).

ETTR = useful time / wall time, useful time = Σ over new steps (a step number not trained before)
of the median healthy step time × world / full world (a step on 2 of 3 nodes is 2/3 of a step's
work). The rest of the wall time is split so that the parts sum to it exactly:

  startup     launch -> first step
  detection   a stall (a gap between two steps longer than STALL_STEPS healthy steps) that began
              while a fault acted (from NEAR_S before its injection to its revert):
              from the last step before it to the first worker (re)start in it (all of it when no
              worker restarted)
  restart     the rest of that stall: from the worker (re)start to the step after it, less one step
  false kills a stall with a worker restart and no fault injected near it
  redone      steps trained again (their number was trained before), with their gaps
  shrunk      the capacity missing while the world is smaller than full: step × (1 - world / full)
  slow        everything else: steps slower than the median (a straggler, the machine's load), and
              stalls without a restart and without a fault near them (negative when steps ran faster)
"""

from __future__ import annotations

import random
import statistics
from dataclasses import dataclass, field

NODES = ("n1", "n2", "n3")
# n1 hosts the c10d rendezvous store in both runs: a node-level fault there ends any c10d job
# (bench/faults.py's store-host-kill needs etcd). Node-level faults hit n2 or n3.
NODE_FAULTS = ("node-kill", "net-cut")
WORKER_FAULTS = ("worker-kill", "sigstop", "sleep-hang", "straggler")
KINDS = (*WORKER_FAULTS, *NODE_FAULTS, "disk-full")
STALL_STEPS = 10.0  # a gap this many healthy steps long (and at least STALL_MIN_S) is a stall
STALL_MIN_S = 1.0
NEAR_S = 2.0  # a fault injected this long before a stall began is its cause
WARMUP_S = 30.0  # no fault before the job trained a while
QUIET_END_S = 20.0  # nor in the last seconds: its outcome could not be seen


@dataclass(frozen=True)
class Fault:
    at: float  # seconds after the run's start
    kind: str  # one of KINDS, or "node-back"
    node: str


@dataclass(frozen=True)
class Step:
    t: float  # the worker's own time stamp of the step's end
    step: int
    world: int


@dataclass
class Breakdown:
    wall: float = 0.0
    trained: float = 0.0
    startup: float = 0.0
    detection: float = 0.0
    restart: float = 0.0
    false_kills: float = 0.0
    redone: float = 0.0
    shrunk: float = 0.0
    slow: float = 0.0
    steps: int = 0  # new steps trained
    stalls: list[tuple[float, float, str]] = field(default_factory=list)  # (start, end, cause)

    @property
    def ettr(self) -> float:
        return self.trained / self.wall if self.wall > 0 else 0.0

    def parts(self) -> dict[str, float]:
        return {"trained": self.trained, "startup": self.startup, "detection": self.detection, "restart": self.restart,
                "false kills": self.false_kills, "redone work": self.redone, "shrunk world": self.shrunk,
                "slow steps": self.slow}  # fmt: skip


def schedule(seed: int, minutes: float, mean_interval_s: float, kinds: tuple[str, ...] = KINDS) -> list[Fault]:
    """Faults at exponential intervals (mean ``mean_interval_s``), between WARMUP_S and QUIET_END_S
    before the end. At most one node is down at a time (the job runs on 2:3 nodes): while one is,
    a node-level fault draws that node's return instead, and any fault is its return with odds 1/2.
    ``kinds``: draw only these (a subset of KINDS, to look at one kind of fault's cost alone)."""
    rng = random.Random(seed)
    out: list[Fault] = []
    down: str | None = None
    t = WARMUP_S
    while True:
        t += rng.expovariate(1.0 / mean_interval_s)
        if t > minutes * 60 - QUIET_END_S:
            return out
        kind = rng.choice(kinds)
        if down is not None and (kind in NODE_FAULTS or rng.random() < 0.5):
            out.append(Fault(round(t, 3), "node-back", down))
            down = None
            continue
        if kind in NODE_FAULTS:
            down = rng.choice(NODES[1:])
            out.append(Fault(round(t, 3), kind, down))
            continue
        out.append(Fault(round(t, 3), kind, rng.choice([n for n in NODES if n != down])))


def healthy_step(steps: list[Step], full: int) -> float:
    """The median gap between consecutive new steps trained on the full world."""
    gaps, best = [], 0
    for a, b in zip(steps, steps[1:], strict=False):
        if b.step == a.step + 1 and b.step > best and a.world == b.world == full:
            gaps.append(b.t - a.t)
        best = max(best, a.step)
    return statistics.median(gaps) if gaps else 0.0


def _stall(
    bd: Breakdown, prev: float, cur: float, body: float, restarts: list[float], faults: list[float]
) -> None:
    """Put ``body`` seconds of the stall (prev, cur) into detection / restart / false kills / slow."""
    spawn = next((r for r in restarts if prev < r < cur), None)
    if any(start <= cur and end >= prev - NEAR_S for start, end in faults):
        det = body if spawn is None else min(spawn - prev, body)
        bd.detection += det
        bd.restart += body - det
        bd.stalls.append((prev, cur, "fault"))
    elif spawn is not None:
        bd.false_kills += body
        bd.stalls.append((prev, cur, "false kill"))
    else:
        bd.slow += body
        bd.stalls.append((prev, cur, "pause"))


def account(
    t0: float,
    t_end: float,
    steps: list[Step],
    restarts: list[float],
    faults: list[tuple[float, float]],
    h: float,
    full: int = 3,
) -> Breakdown:
    """The breakdown of the wall time ``t0`` -> ``t_end`` (absolute times): ``steps`` are rank 0's
    step records in time order, ``restarts`` when workers (re)started, ``faults`` when each fault
    acted (injected, reverted: a straggler or a full disk lasts), ``h`` the median healthy step time."""
    bd = Breakdown(wall=t_end - t0)
    steps = [s for s in steps if t0 <= s.t <= t_end]
    if not steps:
        bd.startup = bd.wall
        return bd
    bd.startup = steps[0].t - t0
    best, prev = 0, steps[0].t
    stall = max(STALL_STEPS * h, STALL_MIN_S)
    for s in steps:
        gap = s.t - prev
        if gap > stall:
            _stall(bd, prev, s.t, gap - h, restarts, faults)
            gap = h  # the step itself
        if s.step <= best:
            bd.redone += gap
        else:
            work = h * min(s.world, full) / full
            bd.trained += work
            bd.shrunk += h - work
            bd.slow += gap - h
            bd.steps += 1
            best = s.step
        prev = s.t
    tail = t_end - prev  # the step under way at the end, or a stall the run ended in
    if tail > stall:
        _stall(bd, prev, t_end, tail, restarts, faults)
    else:
        bd.slow += tail
    return bd
