"""Step times from training logs (pure: text in, samples out).

Understood formats (one per line):
- Megatron-LM: ``iteration  100/ 5000 | ... | elapsed time per iteration (ms): 3101.2 | ...``
- tqdm progress (HF Trainer, LLaMA-Factory, Accelerate): `` 83/800 [04:12<36:00,  3.10s/it]``
  (``it/s`` too); ``\\r``-separated updates are separate lines
- LLaMA-Factory ``trainer_log.jsonl``: ``{"current_steps": 10, ..., "elapsed_time": "0:01:23", ...}``
- DeepSpeed / HF JSON log lines / plain lines with a step number: ``step=100``, ``global_step=100``,
  ``Step 100``, ``{"step": 100, ...}``,
  timed by ``t=<unix time>`` in the line (trainguard's example prints ``step=<n> rank=<r> t=<t>``)
  or else by the line's own timestamp. Step time = time difference / step difference.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

_MEGATRON = re.compile(r"iteration\s+(\d+)\s*/\s*\d+\s*\|.*?elapsed time per iteration \(ms\):\s*([\d.]+)")
_TQDM = re.compile(r"(\d+)/\d+ \[[\d:]+<[\d:?]+,\s*([\d.]+)\s*(s/it|it/s)")
_LLAMAFACTORY = re.compile(
    r'"current_steps":\s*(\d+).*?"elapsed_time":\s*"(?:(\d+) days?, )?(\d+):(\d\d):(\d\d)"'
)
_STEP = re.compile(
    r"(?<!resume )\b(?:global_step|step|Step|STEP|iteration|iter)\b[\"']?\s*[=:]?\s*\[?(\d+)\b(?!\s*/\s*\d+\s*\|)"
)
_T = re.compile(r"\bt=(\d{9,11}(?:\.\d+)?)\b")
_RANK = re.compile(r"\b[Rr]ank\s*[=:]?\s*(\d+)\b")


@dataclass(frozen=True)
class StepObs:
    iteration: int
    ms: float | None = None  # step time given directly by the log
    t: float | None = None  # a clock reading for the end of this step
    clock: str = ""  # "t" (unix t=), "elapsed" (LLaMA-Factory), "line" (line timestamp)
    rank: int | None = None


def parse_step(message: str, line_time: float | None = None) -> StepObs | None:
    """One step observation from a log message, or None."""
    if "iteration" in message:
        m = _MEGATRON.search(message)
        if m:
            return StepObs(int(m[1]), ms=float(m[2]))
    if "/it" in message or "it/s" in message:
        m = _TQDM.search(message)
        if m:
            v = float(m[2])
            ms = v * 1000.0 if m[3] == "s/it" else (1000.0 / v if v > 0 else None)
            return StepObs(int(m[1]), ms=ms)
    if "current_steps" in message:
        m = _LLAMAFACTORY.search(message)
        if m:
            secs = int(m[2] or 0) * 86400 + int(m[3]) * 3600 + int(m[4]) * 60 + int(m[5])
            return StepObs(int(m[1]), t=float(secs), clock="elapsed")
    m = _STEP.search(message)
    if m is None:
        return None
    r = _RANK.search(message)
    rank = int(r[1]) if r else None
    t = _T.search(message)
    if t:
        return StepObs(int(m[1]), t=float(t[1]), clock="t", rank=rank)
    if line_time is not None:
        return StepObs(int(m[1]), t=line_time, clock="line", rank=rank)
    return None


@dataclass
class StepTimer:
    """Turns observations of one series (one rank) into (iteration, step ms) samples."""

    _last: dict[str, tuple[int, float]] = field(default_factory=dict)

    def feed(self, obs: StepObs) -> tuple[int, float] | None:
        if obs.ms is not None:
            return obs.iteration, obs.ms
        if obs.t is None:
            return None
        prev = self._last.get(obs.clock)
        self._last[obs.clock] = (obs.iteration, obs.t)
        if prev is None or obs.iteration <= prev[0] or obs.t < prev[1]:
            return None
        return obs.iteration, (obs.t - prev[1]) * 1000.0 / (obs.iteration - prev[0])
