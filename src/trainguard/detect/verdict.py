"""The hang verdict: one pure function over every rank's evidence (no clocks, no I/O).

``judge_stall`` answers *watch*, *suspected* or *detected* for a stall (no step finished for
``stall`` seconds, already past the step threshold), from where each rank is (detect.culprit),
how it progressed over the last window (detect.progress), what each blocked rank waits on
(detect.waits, from the kernel) and the job-wide window facts (``JobWindow``: I/O of every
process of the job, utilisation). The monitor gathers that evidence and acts on the answer;
only ``detected`` may restart the job (``--hang-action restart``).

A rank that progresses is never a culprit. *Progressing at the window* means: its stack moves
while it uses CPU, or it starts new collectives, records spans, its GPU's utilisation changes,
its children compute, it does I/O or moves socket bytes.

| verdict | when (checked in this order) |
|---|---|
| detected (`steps`) | a proof at any time: a rank stopped (T); a rank gone while a peer waits in a collective for it; a rank in uninterruptible sleep (D) with no I/O past `stalled_limit`; a rank standing still on a wait the kernel shows dead (a stopped or gone peer, a pipe nobody else can write, a wait-for cycle, every thread on a private lock with no timeout, ...) |
| detected (`steps`) | nobody progresses and every rank waits in a collective, not all in the same call (mismatched collectives; a rank still serialising its side of an object collective is not waiting) |
| detected (`steps`) | nobody progresses, the culprit stands still while the others wait for it, and it sleeps past the window (no step can finish before it) — or no kernel view of its wait exists |
| detected (`detect-time` / `io+utilisation`) | at the window (`stall >= --hang-detect-time`), the seed's rule: no I/O of any process of the job for the whole window, flat utilisation (GPU where there is one, else each rank's CPU), and no rank progressing; the culprit is the rank standing still or spinning on one frame |
| suspected (`window`) | at the window otherwise: the job is alive (a rank progresses, or I/O, or utilisation moves); named with what it does, re-announced once per window, never restarted |
| suspected | before the window: a rank busy or progressing past its phase's allowance; a culprit standing still whose wait is alive or unknown (a download, a child, a lock another process holds); every rank idle past its allowance |
| watch | a rank progressing within its phase's allowance; too few samples yet |
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from trainguard.detect.culprit import CulpritVerdict, Position
from trainguard.detect.progress import BUSY, GONE, IDLE, PROGRESSING, STALLED, STOPPED, UNKNOWN, Progress
from trainguard.detect.waits import Wait

# Progress signals that are progress at the window by themselves; a moving stack counts only with CPU.
WINDOW_SIGNALS = ("io", "net", "spans", "collectives", "gpu", "children")
WINDOW_MIN_STACKS = 3  # stack samples a rank must stand still in before the window calls it still


@dataclass(frozen=True)
class StallVerdict:
    state: str  # "watch" | "suspected" | "detected"
    culprit: int | None
    rule: str = ""  # "steps", "detect-time" or "io+utilisation" when detected; "window" for a suspicion at the window
    why: str = ""  # one sentence: what the culprit does and why that is (not) a hang
    phase: str = ""  # the culprit's phase ("checkpoint", "eval", "forward", "dataloader", "" = unrecognised)
    limit: float = 0.0  # the allowance or limit the stall was held against

    def to_dict(self) -> dict[str, Any]:
        return {"state": self.state, "culprit": self.culprit, "rule": self.rule, "why": self.why,
                "phase": self.phase, "limit_s": round(self.limit, 2)}  # fmt: skip


@dataclass(frozen=True)
class Limits:
    """The allowances in force (seconds), from detect.hang's learned-allowance functions."""

    threshold: float  # the step threshold (or the first-step allowance before steps are regular)
    detect_time: float
    allowance: Callable[[int, str], float]  # (rank, phase) -> seconds a progressing rank may take
    # Uninterruptible sleep (D) with no I/O is proof only past this many seconds (a slow NFS or
    # os.sync() can hold a rank in D for long); the monitor passes HangConfig.stalled_limit.
    stalled_limit: float = 0.0
    stalled_for: Mapping[int, float] | None = None  # rank -> seconds in D without I/O
    idle_cpu: float = 5.0  # percent of one core: a moving stack with less is no progress at the window


@dataclass(frozen=True)
class JobWindow:
    """The seed's window facts for the whole job (every rank, its descendants, their sockets)."""

    io_quiet: float  # seconds since any process of the job last did I/O or moved socket bytes
    util_flat: bool  # utilisation unchanged over the window (variance and median)
    util_source: str = "cpu"  # "gpu" or "cpu"
    rule: str = "detect-time"  # the rule a window verdict is recorded under ("io+utilisation": no steps known)
    io_bytes: int | None = None  # bytes read and written by the job since the stall began (None: unknown)


def phase_of(p: Position) -> str:
    """The healthy-phase kind a rank's position shows (the key of its learned allowance)."""
    if p.phase:
        return p.phase
    return "dataloader" if p.kind == "dataloader" else ""


def progressing_at_window(p: Progress, idle_cpu: float) -> bool:
    """Whether a rank's window shows progress the seed's window must respect."""
    if p.kind != PROGRESSING:
        return False
    return any(m in WINDOW_SIGNALS for m in p.moved) or ("stack" in p.moved and p.cpu_percent >= idle_cpu)


def _order(verdict: CulpritVerdict) -> list[int]:
    """Ranks, the culprit finder's candidates first (most telling first), then the others."""
    rest = [r for r in sorted(verdict.positions) if r not in verdict.candidates]
    return [r for r in verdict.candidates if r in verdict.positions] + rest


def _what(rank: int, verdict: CulpritVerdict, progress: Mapping[int, Progress],
          waits: Mapping[int, Wait] | None = None) -> str:  # fmt: skip
    pos = verdict.positions[rank]
    w = waits.get(rank) if waits else None
    on = f"; waits on {w.describe()}" if w is not None and w.kind not in ("running", "unknown") else ""
    return f"rank {rank} {pos.describe()} ({progress[rank].describe()}){on}"


def _duration(seconds: float) -> str:
    if seconds >= 5400:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 60:.0f} min" if seconds >= 180 else f"{seconds:.0f}s"


def _size(n: int) -> str:
    for unit, div in (("GB", 1 << 30), ("MB", 1 << 20), ("KB", 1 << 10)):
        if n >= div:
            return f"{n / div:.1f} {unit}"
    return f"{n} B"


def judge_stall(
    verdict: CulpritVerdict, progress: Mapping[int, Progress], stall: float, limits: Limits,
    waits: Mapping[int, Wait] | None = None, others_wait: bool = False, job: JobWindow | None = None,
) -> StallVerdict:  # fmt: skip
    """The verdict on a stall of ``stall`` seconds (see the module's table).

    ``waits``: what each blocked rank waits on (None: no kernel view at all). ``others_wait``:
    ranks on other nodes wait in a collective (their latest shared stacks). ``job``: the window
    facts; without them the window never proves a hang."""
    order = [r for r in _order(verdict) if r in progress]
    proof = _proven(order, verdict, progress, limits, waits or {})
    if proof is not None:
        return proof
    if stall >= limits.detect_time:
        return _at_window(order, verdict, progress, stall, limits, waits, job)
    moving = [r for r in order if progress[r].kind in (PROGRESSING, BUSY)]
    if moving:
        r = moving[0]
        phase = phase_of(verdict.positions[r])
        allowed = limits.allowance(r, phase)
        state = "watch" if stall <= allowed else "suspected"
        return StallVerdict(state, r, "", _what(r, verdict, progress, waits), phase, allowed)
    if any(progress[r].kind in (UNKNOWN, STALLED) for r in order):
        return StallVerdict("watch", verdict.rank, "", "waiting for more samples", limit=limits.threshold)
    return _nobody_progresses(order, verdict, progress, stall, limits, waits, others_wait)


def _at_window(
    order: Sequence[int], verdict: CulpritVerdict, progress: Mapping[int, Progress], stall: float, limits: Limits,
    waits: Mapping[int, Wait] | None, job: JobWindow | None,
) -> StallVerdict:  # fmt: skip
    """No step for the whole window and no proof: the seed's rule decides."""
    pos = verdict.positions
    if any(progress[r].kind == UNKNOWN or (progress[r].kind in (BUSY, IDLE) and progress[r].samples < WINDOW_MIN_STACKS)
           for r in order):  # fmt: skip
        # standing still must be seen in several stack samples (a job without steps is first
        # looked at when the seed's rule opens the watch, at the window itself)
        return StallVerdict("watch", verdict.rank, "", "waiting for more samples", limit=limits.detect_time)
    alive = [r for r in order if progressing_at_window(progress[r], limits.idle_cpu)]
    still = [r for r in order if r not in alive]
    # The culprit: the finder's, else a rank standing still (a spinner before an idle waiter).
    culprit = verdict.rank if verdict.rank in still else next(
        (r for r in still if progress[r].kind == BUSY), next((r for r in still if not pos[r].waiting), None))
    if culprit is None:
        culprit = (alive or list(order) or [None])[0]
    head = f"no step finished for {_duration(stall)} (--hang-detect-time {_duration(limits.detect_time)})"
    what = _what(culprit, verdict, progress, waits) if culprit is not None else "no rank named"
    io = f", I/O {_size(job.io_bytes)} since the last step" if job is not None and job.io_bytes is not None else ""
    reasons = []
    if alive:
        reasons.append(f"rank {alive[0]} progresses")
    if job is None:
        reasons.append("no job-wide I/O and utilisation view")
    else:
        if job.io_quiet < limits.detect_time:
            reasons.append(f"the job did I/O {job.io_quiet:.0f}s ago")
        if not job.util_flat:
            reasons.append(f"{job.util_source.upper()} utilisation changes")
    phase = phase_of(pos[culprit]) if culprit is not None else ""
    if reasons:
        why = f"{head}; {_what(alive[0], verdict, progress, waits) if alive else what}{io}. Alive: {', '.join(reasons)}"
        return StallVerdict("suspected", alive[0] if alive else culprit, "window", why, phase, limits.detect_time)
    assert job is not None
    why = (f"{head}, no I/O from any process of the job for {job.io_quiet:.0f}s, {job.util_source.upper()} "
           f"utilisation flat, no rank progressing; {what}")  # fmt: skip
    return StallVerdict("detected", culprit, job.rule, why, phase, limits.detect_time)


def stopped_proof(
    verdict: CulpritVerdict, progress: Mapping[int, Progress], stopped_for: Mapping[int, float], hold_s: float,
) -> StallVerdict | None:  # fmt: skip
    """Before the step threshold: a rank stopped (state T) for ``hold_s`` (the progress window)
    while every other rank here waits in a collective or shows no progress is proof already — a
    stopped process cannot finish the step its peers wait for, and no allowance covers it. The
    threshold only delays it: under load it grows with the slow steps (15 s on 0.47 s steps in
    the soak). None when that proof is not in hand (the usual rules judge at the threshold)."""
    pos = verdict.positions
    stopped = [r for r in _order(verdict) if r in progress and progress[r].kind == STOPPED
               and stopped_for.get(r, 0.0) >= hold_s]  # fmt: skip
    if not stopped:
        return None
    others = [r for r in progress if r not in stopped]
    if any(progress[r].progressing and not pos[r].waiting for r in others if r in pos):
        return None  # a peer still works outside a collective: the threshold judges
    r = stopped[0]
    why = f"{_what(r, verdict, progress)} for {stopped_for[r]:.0f}s while its peers wait"
    return StallVerdict("detected", r, "steps", why, phase_of(pos[r]), hold_s)


def _proven(
    order: Sequence[int], verdict: CulpritVerdict, progress: Mapping[int, Progress], limits: Limits,
    waits: Mapping[int, Wait],
) -> StallVerdict | None:  # fmt: skip
    """A rank whose wait can never end: stopped, gone while a peer waits for it, in D past the
    long limit, or standing still on a wait the kernel shows dead. No allowance covers it."""
    pos = verdict.positions
    stalled_for = limits.stalled_for or {}
    waited_for = any(pos[r].waiting and progress[r].kind != GONE for r in order)
    for r in order:
        kind = progress[r].kind
        stalled = kind == STALLED and stalled_for.get(r, math.inf) >= limits.stalled_limit
        # A rank that left while nobody waits for it has finished its part (its peer uploads,
        # evaluates ...): not a culprit.
        if kind == STOPPED or stalled or (kind == GONE and waited_for):
            return StallVerdict("detected", r, "steps", _what(r, verdict, progress), phase_of(pos[r]), limits.threshold)
    for r in order:
        w = waits.get(r)
        if w is not None and w.dead and progress[r].kind in (IDLE, BUSY):  # a full window standing still
            why = f"rank {r} {pos[r].describe()} ({progress[r].describe()}); waits on {w.describe()}"
            return StallVerdict("detected", r, "steps", why, phase_of(pos[r]), limits.threshold)
    return None


def _nobody_progresses(
    order: Sequence[int], verdict: CulpritVerdict, progress: Mapping[int, Progress], stall: float, limits: Limits,
    waits: Mapping[int, Wait] | None, others_wait: bool = False,
) -> StallVerdict:  # fmt: skip
    """Every rank is idle or waits in a collective, and no wait is proven dead."""
    pos = verdict.positions
    waiting = [r for r in order if pos[r].waiting]
    idle = [r for r in order if not pos[r].waiting]
    if verdict.rank is not None and (waiting or others_wait) and verdict.rank in idle:
        # The culprit stands still while the others wait for it.
        r = verdict.rank
        why = f"{verdict.reason} ({progress[r].describe()})"
        w = waits.get(r) if waits is not None else None
        if waits is None:  # no kernel view at all: standing still while waited for is all there is
            return StallVerdict("detected", r, "steps", why, phase_of(pos[r]), limits.threshold)
        if w is not None and w.kind == "sleep" and w.sleep_left is not None and stall + w.sleep_left >= limits.detect_time:
            why += (f"; it sleeps {w.sleep_left:.0f}s more: no step can finish before --hang-detect-time "
                    f"({limits.detect_time:.0f}s)")  # fmt: skip
            return StallVerdict("detected", r, "steps", why, phase_of(pos[r]), limits.threshold)
        on = f"; waits on {w.describe()}" if w is not None else "; its wait is unknown"
        return StallVerdict("suspected", r, "", why + on, phase_of(pos[r]), limits.detect_time)
    if not idle:  # all wait, no single culprit: mismatched collectives, or a rank on another node
        return StallVerdict("detected", verdict.rank, "steps", verdict.reason, "", limits.threshold)
    # Nobody waits for anybody (all sleep, all wait on the outside world): never a fast verdict —
    # a suspicion once the stall outlasts the learned allowance of what they do, then the window.
    r = idle[0]
    phase = phase_of(pos[r])
    allowed = limits.allowance(r, phase)
    state = "watch" if stall <= allowed else "suspected"
    return StallVerdict(state, r, "", _what(r, verdict, progress, waits), phase, allowed)
