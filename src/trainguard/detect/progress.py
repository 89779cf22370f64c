"""Progress is not a hang: per-rank progress over a window, and the verdict on a stall.

Pure: takes samples as data (no clocks, no I/O, no processes).

When steps stop, a rank shows *progress* when any of these move across the window's samples: its
Python stack (the main thread's frames in several py-spy samples), its CPU time (the process and
its children: DataLoader workers, compile workers), its I/O counters, its span records, its GPU's
utilisation (seed 000: "no change" is a flat variance and median). A rank shows *no* progress when
it is stopped (SIGSTOP, a debugger), gone, in uninterruptible sleep (D) with no I/O, or idle: no CPU,
no I/O, no span and the very same stack for the whole window.

A rank in a collective (``Position.waiting``) waits for somebody else: its CPU (comm threads may
spin) and its I/O (a logging thread) say nothing about the job, only a moving stack, new spans or
a changing GPU do.

The verdict (``decide_stall``) on a stall longer than the step threshold:

- ``detected``: the job shows no progress — a rank is stopped / gone / stalled in D; or nobody
  progresses and the culprit is idle while the others wait for it (or all wait: a mismatched
  collective, a rank on another node); or a rank stayed busy on the very same frame for longer
  than its learned limit; or no step at all for ``detect_time`` (the seed's window, whatever
  the ranks do).
- ``suspected``: a rank is busy and progressing for longer than its phase's allowance: a warning,
  keep watching.
- ``watch``: a recognised healthy phase within its learned allowance, or too few samples yet.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from trainguard.detect.culprit import CulpritVerdict, FrameLike, Position
from trainguard.detect.hang import HangConfig, series_stats
from trainguard.detect.waits import Wait

PROGRESSING = "progressing"  # stack, I/O, spans or GPU moved
BUSY = "busy"  # on CPU, but on the very same frame, no I/O, no span: long work or a loop
IDLE = "idle"  # nothing moved
STOPPED = "stopped"  # SIGSTOP / job control / a debugger (state T or t)
STALLED = "stalled"  # uninterruptible sleep (D) the whole window, with no I/O
GONE = "gone"
UNKNOWN = "unknown"  # too few samples to say
NO_PROGRESS = (IDLE, STOPPED, STALLED, GONE)
NEVER_HEALTHY = (STOPPED, STALLED, GONE)  # no allowance covers these


@dataclass(frozen=True)
class RankSamples:
    """What one rank did over the judged window, oldest sample first."""

    rank: int
    times: Sequence[float] = ()  # /proc sample times
    states: Sequence[str] = ()  # /proc state letter at each ("" = gone)
    cpu: Sequence[float] = ()  # cumulative CPU seconds of the process tree at each
    io: Sequence[tuple[int, ...] | None] = ()  # cumulative I/O counters of the tree at each (None: unreadable)
    stacks: Sequence[Sequence[FrameLike] | None] = ()  # main thread frames per py-spy sample (None: unreadable)
    spans: Sequence[int] = ()  # cumulative span records seen at each /proc sample (empty: unknown)
    gpu: Sequence[float] = ()  # utilisation of this rank's GPU per sample (empty: no GPU known)
    # bytes the tree's TCP sockets moved (received + acknowledged), outside the job's own
    # connections, at each /proc sample (None: unknown). Socket reads do not move /proc/<pid>/io.
    net: Sequence[int | None] = ()
    # collectives the rank had started at each /proc sample (its always-on sequence counter; None:
    # unknown). A count that moves means its collectives complete: a rank looping over quick
    # collectives (gradient accumulation's flags) can show one all_reduce stack in every sample.
    collectives: Sequence[int | None] = ()


@dataclass(frozen=True)
class Progress:
    kind: str  # PROGRESSING BUSY IDLE STOPPED STALLED GONE UNKNOWN
    moved: tuple[str, ...] = ()  # the signals that moved: stack, cpu, io, spans, gpu
    cpu_percent: float = 0.0  # of one core, over the window
    seconds: float = 0.0  # the window's length
    samples: int = 0  # py-spy samples compared

    @property
    def progressing(self) -> bool:
        return self.kind in (PROGRESSING, BUSY)

    def describe(self) -> str:
        if self.kind == PROGRESSING:
            what = {"stack": "its stack moves", "io": "it does I/O", "spans": "it records spans",
                    "gpu": "its GPU utilisation changes", "cpu": f"CPU {self.cpu_percent:.0f}%",
                    "net": "its sockets move data", "collectives": "it starts new collectives"}  # fmt: skip
            return "progressing: " + ", ".join(what[m] for m in self.moved)
        return {
            BUSY: f"busy on the same frame: CPU {self.cpu_percent:.0f}%, same stack in {self.samples} samples, no I/O",
            IDLE: f"no progress for {self.seconds:.1f}s: CPU {self.cpu_percent:.0f}%, no I/O, same stack in "
            f"{self.samples} samples",
            STOPPED: "no progress: stopped (state T)",
            STALLED: f"no progress: uninterruptible sleep (state D) with no I/O for {self.seconds:.1f}s",
            GONE: "no progress: the process is gone",
            UNKNOWN: "not enough samples yet",
        }[self.kind]

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "moved": list(self.moved), "cpu_percent": round(self.cpu_percent, 1),
                "window_s": round(self.seconds, 2), "stack_samples": self.samples, "summary": self.describe()}  # fmt: skip


def _signature(frames: Sequence[FrameLike]) -> tuple[tuple[str, str, int], ...]:
    return tuple((f.name, f.filename, f.line) for f in frames)


def judge_progress(s: RankSamples, cfg: HangConfig, waiting: bool = False) -> Progress:
    """One rank's progress over the window. ``waiting``: its main thread waits in a collective."""
    if not s.times:
        return Progress(UNKNOWN)
    last = s.states[-1] if s.states else "?"
    if last in ("", "Z", "X", "gone"):
        return Progress(GONE)
    seconds = s.times[-1] - s.times[0]
    cpu = 100.0 * max(0.0, s.cpu[-1] - s.cpu[0]) / seconds if seconds > 0 and len(s.cpu) > 1 else 0.0
    stacks = [_signature(f) for f in s.stacks if f is not None]
    # A stop is unambiguous at once; standing still needs the whole window (80 %: sampling jitter).
    enough = len(s.times) >= 2 and seconds >= min(cfg.window, 2 * cfg.period) * 0.8
    full = len(s.times) >= 2 and seconds >= cfg.window * 0.8
    if enough and all(st in ("T", "t") for st in s.states[-2:]):
        return Progress(STOPPED, cpu_percent=cpu, seconds=seconds)
    readable = [x for x in s.io if x is not None]
    io = len(set(readable)) > 1
    moved = []
    if len(set(stacks)) > 1:
        moved.append("stack")
    if io and not waiting:
        moved.append("io")
    net = [x for x in s.net if x is not None]
    if len(set(net)) > 1 and not waiting:
        moved.append("net")
    if len(set(s.spans)) > 1:
        moved.append("spans")
    if len({c for c in s.collectives if c is not None}) > 1:
        moved.append("collectives")
    if len(s.gpu) >= 3 and not series_stats(list(s.gpu), cfg).unchanged:
        moved.append("gpu")
    if full and all(st == "D" for st in s.states) and not io:
        return Progress(STALLED, cpu_percent=cpu, seconds=seconds, samples=len(stacks))
    if moved:
        return Progress(PROGRESSING, tuple(moved), cpu, seconds, len(stacks))
    if cpu >= cfg.idle_cpu and not waiting:
        return Progress(BUSY, ("cpu",), cpu, seconds, len(stacks))
    if not full or len(stacks) < 2:
        return Progress(UNKNOWN, cpu_percent=cpu, seconds=seconds, samples=len(stacks))
    return Progress(IDLE, cpu_percent=cpu, seconds=seconds, samples=len(stacks))


# --------------------------------------------------------------------------------------------
# the verdict on a stall


@dataclass(frozen=True)
class StallVerdict:
    state: str  # "watch" | "suspected" | "detected"
    culprit: int | None
    rule: str = ""  # for "detected": "steps" or "detect-time"
    why: str = ""  # one sentence: what the culprit does and why that is (not) a hang
    phase: str = ""  # the culprit's phase ("checkpoint", "eval", "forward", "dataloader", "" = unrecognised)
    limit: float = 0.0  # the allowance or limit the stall was held against

    def to_dict(self) -> dict[str, Any]:
        return {"state": self.state, "culprit": self.culprit, "rule": self.rule, "why": self.why,
                "phase": self.phase, "limit_s": round(self.limit, 2)}  # fmt: skip


def phase_of(p: Position) -> str:
    """The healthy-phase kind a rank's position shows (the key of its learned allowance)."""
    if p.phase:
        return p.phase
    return "dataloader" if p.kind == "dataloader" else ""


@dataclass(frozen=True)
class Limits:
    """The allowances in force (seconds), from detect.hang's learned-allowance functions."""

    threshold: float  # the step threshold (or the first-step allowance before steps are regular)
    detect_time: float
    allowance: Callable[[int, str], float]  # (rank, phase) -> seconds a progressing rank may take
    busy_limit: Callable[[int, str], float]  # (rank, phase) -> seconds busy on the same frame
    frozen_for: Mapping[int, float] = field(default_factory=dict)  # rank -> seconds its stack has not changed
    # Uninterruptible sleep (D) with no I/O is proof only past this many seconds (a slow NFS or
    # os.sync() can hold a rank in D for long); the monitor passes HangConfig.stalled_limit.
    stalled_limit: float = 0.0
    stalled_for: Mapping[int, float] = field(default_factory=dict)  # rank -> seconds in D without I/O


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


def decide_stall(
    verdict: CulpritVerdict, progress: Mapping[int, Progress], stall: float, limits: Limits,
    waits: Mapping[int, Wait] | None = None, others_wait: bool = False,
) -> StallVerdict:  # fmt: skip
    """The verdict on a stall of ``stall`` seconds (already longer than ``limits.threshold``).

    ``waits``: what each blocked rank waits on (detect.waits, from the kernel). With it, a rank
    that stands still is a hang only on proof that its wait is dead; a wait on the outside world
    is a named suspicion until ``detect_time``. Without it (no kernel view) a rank idle while the
    others wait for it is detected, as before issue 26. ``others_wait``: ranks on other nodes wait
    in a collective (their latest shared stacks), so a local idle rank is waited for."""
    order = [r for r in _order(verdict) if r in progress]
    pos = verdict.positions
    if stall >= limits.detect_time:
        culprit = verdict.rank if verdict.rank is not None else (order[0] if order else None)
        why = f"no step finished for {stall:.0f}s (--hang-detect-time {limits.detect_time:.0f}s)"
        if culprit is not None and culprit in progress:
            why += f"; {_what(culprit, verdict, progress, waits)}"
        return StallVerdict("detected", culprit, "detect-time", why, limit=limits.detect_time)
    proof = _proven(order, verdict, progress, limits, waits or {})
    if proof is not None:
        return proof
    moving: list[int] = []
    frozen: list[tuple[int, float]] = []
    for r in order:
        p = progress[r]
        if p.kind == PROGRESSING:
            moving.append(r)
        elif p.kind == BUSY:
            limit = limits.busy_limit(r, phase_of(pos[r]))
            if limits.frozen_for.get(r, 0.0) >= limit:
                frozen.append((r, limit))
            else:
                moving.append(r)
    if moving:
        r = moving[0]
        phase = phase_of(pos[r])
        allowed = limits.allowance(r, phase)
        state = "watch" if stall <= allowed else "suspected"
        return StallVerdict(state, r, "", _what(r, verdict, progress, waits), phase, allowed)
    if frozen:
        r, limit = frozen[0]
        why = f"{_what(r, verdict, progress)}: the same frame for {limits.frozen_for[r]:.0f}s, over its limit {limit:.0f}s"
        return StallVerdict("detected", r, "steps", why, phase_of(pos[r]), limit)
    if any(progress[r].kind in (UNKNOWN, STALLED) for r in order):
        return StallVerdict("watch", verdict.rank, "", "waiting for more samples", limit=limits.threshold)
    return _nobody_progresses(order, verdict, progress, stall, limits, waits, others_wait)


def stopped_proof(
    verdict: CulpritVerdict, progress: Mapping[int, Progress], stopped_for: Mapping[int, float], hold_s: float,
) -> StallVerdict | None:  # fmt: skip
    """Before the step threshold: a rank stopped (state T) for ``hold_s`` (the progress window)
    while every other rank here waits in a collective or shows no progress is proof already — a
    stopped process cannot finish the step its peers wait for, and no allowance covers it. The
    threshold only delays it: under load it grows with the slow steps (issue 33's soak: 15 s on
    0.47 s steps). None when that proof is not in hand (the usual rules judge at the threshold)."""
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
    """A rank whose wait can never end: stopped, gone, in D past the long limit, or blocked on a
    wait the kernel shows dead. No allowance covers it."""
    pos = verdict.positions
    for r in order:
        kind = progress[r].kind
        stalled = kind == STALLED and limits.stalled_for.get(r, math.inf) >= limits.stalled_limit
        if kind in (STOPPED, GONE) or stalled:
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
        if waits is None:  # no kernel view at all: the rule before issue 26
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
    # a suspicion once the stall outlasts the learned allowance of what they do, then detect_time.
    r = idle[0]
    phase = phase_of(pos[r])
    allowed = limits.allowance(r, phase)
    state = "watch" if stall <= allowed else "suspected"
    return StallVerdict(state, r, "", _what(r, verdict, progress, waits), phase, allowed)
