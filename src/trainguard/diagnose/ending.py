"""How logs without an error end, read offline (pure): the question is what the logs show, not
whether the job stopped (offline nothing says it did, or why).

- A completion line: the run finished ("no failure found", high confidence).
- A later look (``date`` printed next to the log) long after the last logged line, with no
  progress between (lookback.py): time passed and the job logged nothing, a hang.
- A stack dump of a live process (py-spy) in the logs: someone looked at a job that made no
  progress: a hang. So is a log that ends on a stall warning (Horovod: ranks waiting for the
  others) with no progress after it.
- Start-up got through (NCCL communicators, DDP's first bucket rebuild, Megatron's "training ...")
  and no training step was ever logged, or the only counter reads 0/N: the job stopped right at
  its start, a hang.
- Progress lines and then the end of the log (regular cadence, even the planned last iteration):
  an excerpt that just ends, or a run that ended normally: "no failure found in these logs". That
  the job may have hung right there is offered as a low-confidence alternative, not claimed.

And a SIGKILL read offline: killed while loading a model, checkpoint shards or optimizer state
with no kernel line is most likely the host running out of RAM (the kernel's OOM killer; only
``dmesg`` on the node can confirm); the log's own memory report (DeepSpeed's ``CPU Virtual
Memory ... percent``) raises the confidence.
"""

from __future__ import annotations

from dataclasses import dataclass

from trainguard.diagnose.lookback import silent_end, stalled
from trainguard.diagnose.progress import DATA_BAR
from trainguard.diagnose.scan import SourceScan

HIGH_RAM_PERCENT = 90.0  # a memory report at or above this share of host RAM is memory pressure


@dataclass(frozen=True)
class Ending:
    kind: str  # completed | stack_dump | stall | looked_later | stalled_at_start | zero_steps | ended_on_progress | nothing
    why: str
    line: str = ""  # the line that shows it
    file: str | None = None
    rank: int | None = None
    host: str | None = None
    rule: str = ""  # the rule whose line shows it (a tail marker), if any

    @property
    def hang(self) -> bool:
        return self.kind in ("stack_dump", "stall", "looked_later", "stalled_at_start", "zero_steps")


def _at(kind: str, why: str, s: SourceScan | None, line: str, tag: str = "") -> Ending:
    if s is None:
        return Ending(kind, why, line)
    rule = s.marks[tag][3] if tag in s.marks else ""
    return Ending(kind, why, line, str(s.source.path), s.source.rank, s.source.host, rule)




def _stepped(s: SourceScan) -> bool:
    """Some training step was logged (a counter past 0, a step line, a step-timed sample)."""
    st, line = s.last_step, s.last_step_line
    if st is not None and st.n is None and (st.style == "lightning" or "{'" in line):  # a metrics record
        return True
    if st is not None and st.n and not (st.style == "tqdm" and DATA_BAR.search(line)):
        return True
    if any(p.step for p in s.progress.values()) or any(s.steps.values()):
        return True
    start = s.marks.get("startup")
    return s.last_metric_at is not None and (start is None or s.last_metric_at > start[0])


def log_ending(scans: list[SourceScan]) -> Ending:
    done = next((s for s in scans if s.completed), None)
    if done is not None:
        return _at("completed", "the run logged its completion line", done, "")
    dump = next((s for s in scans if "stackdump" in s.marks), None)
    if dump is not None:
        return _at("stack_dump", "a stack dump of the live processes is among the logs (taken because the job "
                   "made no progress) and no error was logged", dump, dump.marks["stackdump"][1], "stackdump")  # fmt: skip
    # >=: a watcher line may quote the last progress line it keeps seeing
    stall = next((s for s in scans if "stall" in s.marks and s.marks["stall"][0] >= max(
        s.last_step_at if s.last_step_at is not None else -1, s.last_metric_at if s.last_metric_at is not None else -1)), None)
    if stall is not None:
        return _at("stall", "the log ends on a stall warning (ranks waiting for the others, or a watcher seeing no change) with no progress after it",
                   stall, stall.marks["stall"][1], "stall")  # fmt: skip
    # a run whose counter reached its total had done its work: time after it is no stall
    finished = any(s.last_step is not None and s.last_step.total and s.last_step.n == s.last_step.total for s in scans)
    later = None if finished else stalled([(s.clock, s) for s in scans])
    if later is not None:
        owner, look, gap = later
        return _at("looked_later", f"a later look ({look.line.strip()}) came {gap / 3600:.1f} h after the last "
                   "logged line with no progress logged between", owner, look.line)  # type: ignore[arg-type]  # fmt: skip
    quiet = None if finished else silent_end([(s.clock, s) for s in scans])
    if quiet is not None:
        owner, late = quiet
        return _at("looked_later", f"the log's last timestamped line came {(late.time - late.before) / 3600:.1f} h "
                   "after the one before it, with no progress logged between", owner, late.line)  # type: ignore[arg-type]  # fmt: skip
    stepped = [s for s in scans if _stepped(s)]
    if not stepped:
        start = next((s for s in scans if "startup" in s.marks), None)
        if start is not None:
            return _at("stalled_at_start", "the log stops right after start-up with no training step logged",
                       start, start.marks["startup"][1], "startup")  # fmt: skip
        zero = next((s for s in scans if s.last_step is not None and s.last_step.n == 0 and s.last_step.total), None)
        if zero is not None:
            st = zero.last_step
            return _at("zero_steps", f"the log ends at 0/{st.total}: no training step finished",  # type: ignore[union-attr]
                       zero, zero.last_step_line)  # fmt: skip
        return Ending("nothing", "no error, no progress line")
    last = max(stepped, key=lambda s: max(s.last_time.values(), default=0.0))
    line = last.last_step_line or next((p.line for p in last.progress.values()), "")
    return _at("ended_on_progress", "the log ends on normal progress with no error", last, line)


@dataclass(frozen=True)
class OomLikely:
    confidence: str  # high | medium
    lines: list[str]  # the loading line and the memory report, as logged
    why: str
    rules: list[str]  # the ids of the rules that matched them


def oom_likely(scans: list[SourceScan]) -> OomLikely | None:
    """A SIGKILL read offline: host RAM OOM likely, when the logs were loading (no training step
    after it) or report the host's memory nearly full; None when nothing points at memory."""
    loading = next((s.marks["loading"] for s in scans if "loading" in s.marks
                    and (s.last_step_at is None or s.last_step_at <= s.marks["loading"][0])), None)  # fmt: skip
    report, percent = None, 0.0
    for s in scans:
        m = s.marks.get("memreport")
        try:
            p = float(m[2].get("percent", "")) if m else 0.0
        except ValueError:
            continue
        if p >= percent:
            report, percent = m, p
    full = report is not None and percent >= HIGH_RAM_PERCENT
    if loading is None and not full:
        return None
    lines = [x[1] for x in (loading, report) if x is not None]
    what = "while loading the model, checkpoint shards or optimizer state" if loading else "with host memory nearly full"
    if full:
        what += f" (the log's memory report: {percent:g} % of host RAM used)"
    conf = "high" if loading and full else "medium"
    return OomLikely(conf, lines, what, [x[3] for x in (loading, report) if x is not None])
