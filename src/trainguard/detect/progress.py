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
a changing GPU do. Children that compute (DataLoader workers decoding, an evaluator process) are
progress of the rank that waits for them, whatever its own frame.

The verdict on a stall is detect.verdict's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from trainguard.detect.culprit import FrameLike
from trainguard.detect.hang import HangConfig, series_stats

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
    # CPU seconds of the rank's own process at each /proc sample (empty: unknown); ``cpu`` minus
    # this is what its children computed.
    own_cpu: Sequence[float] = ()


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
                    "net": "its sockets move data", "collectives": "it starts new collectives",
                    "children": "its child processes compute"}  # fmt: skip
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
    if len(s.own_cpu) == len(s.cpu) > 1 and seconds > 0:
        children = 100.0 * max(0.0, (s.cpu[-1] - s.own_cpu[-1]) - (s.cpu[0] - s.own_cpu[0])) / seconds
        if children >= cfg.idle_cpu:
            moved.append("children")
    if full and all(st == "D" for st in s.states) and not io:
        return Progress(STALLED, cpu_percent=cpu, seconds=seconds, samples=len(stacks))
    if moved:
        return Progress(PROGRESSING, tuple(moved), cpu, seconds, len(stacks))
    if cpu >= cfg.idle_cpu and not waiting:
        return Progress(BUSY, ("cpu",), cpu, seconds, len(stacks))
    if not full or len(stacks) < 2:
        return Progress(UNKNOWN, cpu_percent=cpu, seconds=seconds, samples=len(stacks))
    return Progress(IDLE, cpu_percent=cpu, seconds=seconds, samples=len(stacks))
