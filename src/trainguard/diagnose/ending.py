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

And a SIGKILL read offline: the log's own memory report (DeepSpeed's ``CPU Virtual Memory ...
percent``) at 90 % or more says host RAM ran out (host OOM; high when it was loading too). Killed
while loading a model, checkpoint shards or optimizer state with no memory evidence stays a kill
from outside: host RAM OOM is then the likely sender, offered as the alternative (only ``dmesg``
on the node can confirm); loading alone is no proof that memory ran out.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

from trainguard.diagnose.lookback import silent_end, stalled
from trainguard.diagnose.progress import DATA_BAR
from trainguard.diagnose.scan import SourceScan

# a bar that counts one epoch's batches (fairseq's "epoch 001: 100%|", Lightning's "Epoch 3: 100%|"):
# at 100 % the epoch ended, not the run (validation, the checkpoint and the next epoch follow)
EPOCH_BAR = re.compile(r"(?i)\bepoch\s*\d+\s*:\s*\d{1,3}%\|")
HIGH_RAM_PERCENT = 90.0  # a memory report at or above this share of host RAM is memory pressure
MIN_WAIT_REPEATS = 2  # "still waiting for the other ranks" this many times with no progress: a stall


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




def _span(seconds: float) -> str:
    return f"{seconds / 3600:.1f} h" if seconds >= 3600 else f"{seconds / 60:.0f} min"


def _after_progress(s: SourceScan, at: int) -> bool:
    return at > max(s.last_step_at if s.last_step_at is not None else -1, s.last_metric_at if s.last_metric_at is not None else -1)


def _interrupted_waiting(scans: list[SourceScan]) -> Ending | None:
    """The user's interrupt whose traceback shows the process waiting in a collective or a barrier
    (a frame inside torch.distributed's barrier, all_reduce, work.wait()...), after the last
    progress: the process was stuck there when the user gave up. Read like a stack dump."""
    for s in scans:
        wait = s.marks.get("waited")
        if wait is not None and _after_progress(s, wait[0]):
            return _at("stack_dump", "the user's interrupt shows the process waiting in a collective or a barrier "
                       f"({wait[1].strip()}) after the last progress", s, wait[1], "waitframe")  # fmt: skip
    return None


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
    waited = next((s for s in scans if s.waits >= MIN_WAIT_REPEATS and _after_progress(s, s.marks["waiting"][0])), None)
    if waited is not None:
        return _at("stall", f"the log ends on a wait for the other ranks repeated {waited.waits} times with no progress "
                   "between or after", waited, waited.marks["waiting"][1], "waiting")  # fmt: skip
    stall = next((s for s in scans if "stall" in s.marks and s.marks["stall"][0] >= max(
        s.last_step_at if s.last_step_at is not None else -1, s.last_metric_at if s.last_metric_at is not None else -1)), None)
    if stall is not None:
        end = _at("stall", "the log ends on a stall warning (ranks waiting for the others, or a watcher seeing no change) with no progress after it",
                  stall, stall.marks["stall"][1], "stall")  # fmt: skip
        odd = next((r for r in (s.stalled_rank for s in scans) if r is not None), None)
        return replace(end, rank=odd, why=end.why + f"; the others wait for rank {odd}") if odd is not None else end
    waited = _interrupted_waiting(scans)
    if waited is not None:
        return waited
    # a run whose counter reached its total had done its work: time after it is no stall (a
    # validation or data bar at 100 % is not the run's counter)
    finished = any(s.last_step is not None and s.last_step.total and s.last_step.n == s.last_step.total
                   and not (s.last_step.style == "tqdm" and DATA_BAR.search(s.last_step_line))
                   and not EPOCH_BAR.search(s.last_step_line) for s in scans)  # fmt: skip
    later = None if finished else stalled([(s.clock, s) for s in scans])
    if later is not None:
        owner, look, gap = later
        if gap is None:  # owner: the quoted log; look.line: its last line, which a later look quotes unchanged
            return _at("looked_later", f"a later look quotes the log's last line unchanged ({look.line.strip()[:120]})",
                       owner, look.line)  # type: ignore[arg-type]  # fmt: skip
        when = f"came {_span(gap)} after the last logged line with no progress logged between"
        return _at("looked_later", f"a later look ({look.line.strip()}) {when}", owner, look.line)  # type: ignore[arg-type]
    quiet = None if finished else silent_end([(s.clock, s) for s in scans])
    if quiet is not None:
        owner, late = quiet
        by = "; then the user interrupted it" if owner.clock.interrupted else ""  # type: ignore[attr-defined]
        return _at("looked_later", f"the log's last timestamped line came {_span(late.time - late.before)} after the "
                   f"one before it, with no progress logged between{by}", owner, late.line)  # type: ignore[arg-type]  # fmt: skip
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
    memory: bool = False  # the log's own memory report says host RAM was nearly full


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
    return OomLikely(conf, lines, what, [x[3] for x in (loading, report) if x is not None], full)
