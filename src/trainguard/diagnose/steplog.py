"""Step times from training logs (pure: text in, samples out).

Understood formats (one per line):
- Megatron-LM: ``iteration  100/ 5000 | ... | elapsed time per iteration (ms): 3101.2 | ...``
- tqdm progress (HF Trainer, LLaMA-Factory, Accelerate): `` 83/800 [04:12<36:00,  3.10s/it]``
  (``it/s`` too); ``\\r``-separated updates are separate lines. With line timestamps (trainguard's
  rank logs stamp every bar update) a bar is timed by them, per interval between its updates, and
  an interval in which another bar ran (evaluation, "Writing model shards") is not a step time;
  without, by the bar's own smoothed rate (which a pause drags down for several updates).
- LLaMA-Factory ``trainer_log.jsonl``: ``{"current_steps": 10, ..., "elapsed_time": "0:01:23", ...}``
- DeepSpeed / HF JSON log lines / plain lines with a step number: ``step=100``, ``global_step=100``,
  ``Step 100``, ``{"step": 100, ...}``,
  timed by ``t=<unix time>`` in the line (trainguard's example prints ``step=<n> rank=<r> t=<t>``)
  or else by the line's own timestamp. Step time = time difference / step difference, taken over
  at least ``MIN_SPAN_TICKS`` ticks of the clock: a log with one-second timestamps and several
  steps per second is timed over ten seconds or more at once, never as 0 ms steps.
Numbers that are not numbers (``(ms): .``) make the line a non-step line, never an error.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import NamedTuple

_NUM = r"(\d+(?:\.\d*)?|\.\d+)"  # a decimal number: "3101.2", "3.", ".5" (not ".")
_MEGATRON = re.compile(r"iteration\s+(\d+)\s*/\s*\d+\s*\|.*?elapsed time per iteration \(ms\):\s*" + _NUM)
_TQDM = re.compile(r"(\d+)/(\d+) \[[\d:]+<[\d:?]+,\s*" + _NUM + r"\s*(s/it|it/s)")
_LLAMAFACTORY = re.compile(
    r'"current_steps":\s*(\d+).*?"elapsed_time":\s*"(?:(\d+) days?, )?(\d+):(\d\d):(\d\d)"'
)
_STEP = re.compile(
    r"(?<!resume )\b(?:global_step|step|Step|STEP|iteration|iter)\b[\"']?\s*[=:]?\s*\[?(\d+)\b(?!\s*/\s*\d+\s*\|)"
)
_T = re.compile(r"\bt=(\d{9,11})(?:\.(\d+))?\b")
_RANK = re.compile(r"\b[Rr]ank\s*[=:]?\s*(\d+)\b")


@dataclass(frozen=True)
class StepObs:
    iteration: int
    ms: float | None = None  # step time given directly by the log
    t: float | None = None  # a clock reading for the end of this step
    clock: str = ""  # "t" (unix t=), "elapsed" (LLaMA-Factory), "line" (line timestamp)
    rank: int | None = None
    tick: float | None = None  # the clock's resolution in seconds, when the text shows it
    bar_total: int = 0  # a progress bar's total (tqdm): tells the training bar from eval/save bars

    def source_rank(self) -> tuple[int, int]:
        """How good a source of step times this line's format is (higher is better): an explicit
        time per iteration (Megatron-LM), then a progress bar (the one with the largest total: the
        training bar, not an evaluation's or a save's), then step numbers timed by a clock."""
        if self.bar_total:
            return (2, self.bar_total)
        if self.ms is not None:
            return (3, 0)
        return (1, 0) if self.clock == "elapsed" else (0, 0)


class StepSample(NamedTuple):
    """``iterations`` steps ending at ``iteration`` took ``ms`` each on average."""

    iteration: int
    ms: float
    iterations: int = 1


MIN_SPAN_TICKS = 10  # a step time read from a clock spans >= 10 of its ticks: <= 10 % rounding error


def parse_step(message: str, line_time: float | None = None) -> StepObs | None:
    """One step observation from a log message, or None."""
    try:
        return _parse_step(message, line_time)
    except ValueError:  # a number Python will not convert (e.g. more than 4300 digits): not a step
        return None


def _parse_step(message: str, line_time: float | None) -> StepObs | None:
    if "iteration" in message:
        m = _MEGATRON.search(message)
        if m:
            return StepObs(int(m[1]), ms=float(m[2]))
    if "/it" in message or "it/s" in message:
        m = _TQDM.search(message)
        if m:
            if line_time is not None:
                return StepObs(int(m[1]), t=line_time, clock=f"bar{m[2]}", bar_total=int(m[2]))
            v = float(m[3])
            ms = v * 1000.0 if m[4] == "s/it" else (1000.0 / v if v > 0 else None)
            return StepObs(int(m[1]), ms=ms, bar_total=int(m[2]))
    if "current_steps" in message:
        m = _LLAMAFACTORY.search(message)
        if m:
            secs = int(m[2] or 0) * 86400 + int(m[3]) * 3600 + int(m[4]) * 60 + int(m[5])
            return StepObs(int(m[1]), t=float(secs), clock="elapsed", tick=1.0)
    m = _STEP.search(message)
    if m is None:
        return None
    r = _RANK.search(message)
    rank = int(r[1]) if r else None
    t = _T.search(message)
    if t:
        frac = t[2] or ""
        return StepObs(int(m[1]), t=float(f"{t[1]}.{frac or 0}"), clock="t", rank=rank, tick=10.0 ** -len(frac))
    if line_time is not None:
        return StepObs(int(m[1]), t=line_time, clock="line", rank=rank)
    return None


@dataclass
class StepTimer:
    """Turns observations of one series (one rank) into step-time samples.

    Clock readings are differenced from an anchor that only moves when a sample is taken: steps
    that share a timestamp (several steps per tick) are merged with the following ones until the
    span covers ``MIN_SPAN_TICKS`` ticks. A line clock's tick is one second until a reading with a
    fraction shows it is finer."""

    _anchor: dict[str, tuple[int, float]] = field(default_factory=dict)
    _fine: set[str] = field(default_factory=set)  # line clocks seen with sub-second readings

    def feed(self, obs: StepObs) -> StepSample | None:
        if obs.ms is not None:
            return StepSample(obs.iteration, obs.ms)
        if obs.t is None:
            return None
        prev = self._anchor.get(obs.clock)
        if prev is None or obs.iteration < prev[0] or obs.t < prev[1]:  # first, or restarted
            self._anchor[obs.clock] = (obs.iteration, obs.t)
            return None
        if obs.iteration == prev[0]:  # the same step logged again
            return None
        if obs.t - prev[1] < MIN_SPAN_TICKS * self._tick(obs):
            return None
        self._anchor[obs.clock] = (obs.iteration, obs.t)
        n = obs.iteration - prev[0]
        return StepSample(obs.iteration, (obs.t - prev[1]) * 1000.0 / n, n)

    def interrupt(self) -> None:
        """Something else ran since the last reading (another progress bar: an evaluation, a
        save): the time until the next reading is not the steps' own."""
        self._anchor.clear()

    def _tick(self, obs: StepObs) -> float:
        if obs.tick is not None:
            return obs.tick
        if obs.clock in self._fine or obs.t % 1:
            self._fine.add(obs.clock)
            return 1e-6
        return 1.0
