"""A later look at a job that logged nothing since (pure).

Offline, a log that simply ends says nothing about whether the job stopped: an excerpt, or a run
that ended normally. What does show a stall is time passing with nothing logged: someone (or a
cron job) ran ``date`` next to the log hours after its last line, or printed ``ps``/``nvidia-smi``
with a timestamp, and no progress line came in between. That shape does not depend on the
framework: any log whose lines (or some of them) carry a time can be compared with a later look.

``Clock`` follows one file's tail: the time of its last timestamped line, how many progress lines
came after it (a couple of untimed tqdm lines may follow the last timestamp; many mean the run went
on for an unknown time), and the last whole-line ``date`` output (the look).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from datetime import UTC, datetime

from trainguard.diagnose.progress import step_of

STALL_GAP_S = 30 * 60.0  # a look this long after the last logged line, nothing logged between: a stall
CADENCE_FACTOR = 3.0  # a silence must be this many times the longest earlier pause between timestamped lines
MAX_CUTS = 8  # lines after a look kept to compare with the logs' last progress
MIN_TAIL_CUT = 40  # a quoted tail this long that ends the log's last progress line is that line
MAX_PROGRESS_AFTER = 2  # untimed progress lines allowed between the last timestamp and the look
# The user's ^C after this long with nothing logged (and CADENCE_FACTOR times any earlier pause): a
# person waited for a job that stopped moving, then interrupted it. Shorter than STALL_GAP_S because
# the interrupt itself is the evidence that the wait was noticed, not only time passing.
INTERRUPT_GAP_S = 5 * 60.0

# `date`'s default output on a line of its own: "Sat Aug 26 16:05:12 UTC 2023"
_DATE_CMD = re.compile(
    r"^\s*(?:Mon|Tue|Wed|Thu|Fri|Sat|Sun) (?P<mon>Jan|Feb|Mar|Apr|May|Jun|Jul|Aug|Sep|Oct|Nov|Dec) +(?P<D>\d{1,2}) "
    r"(?P<h>\d\d):(?P<m>\d\d):(?P<s>\d\d) (?:[A-Z]{2,5}[+-]?\d{0,4} )?(?P<Y>\d{4})\s*$"
)
# month/day/year stamps at a line's start (Python logging's %m/%d/%Y, rich's [%x %X]), which the
# prefix parser does not read: only used here, to place the last logged line in time
_US_STAMP = re.compile(r"^\[?(?P<M>\d\d)/(?P<D>\d\d)/(?P<Y>\d{4}|\d\d)[ ,]+(?P<h>\d\d):(?P<m>\d\d):(?P<s>\d\d)\b")
# a `tail` of a log typed at a shell prompt ("$ tail -n 1 train.log", "$ tail -c 200 run.log")
_TAIL_CMD = re.compile(r"^\s*[$#]\s+(?:\S+[^;]*;\s*)*tail\s+(?:-\w+\s*\d*\s+)*\S+")
UNTIMED = float("-inf")  # the time of a look that printed none
_MONTHS = {m: i for i, m in enumerate("Jan Feb Mar Apr May Jun Jul Aug Sep Oct Nov Dec".split(), 1)}
# A date a program prints inside its own message ("BEGIN fit on node7 at Wed Nov  1 06:12:02 CDT
# 2023", `date`'s format) and the time Slurm stamps on its cancel ("CANCELLED AT 2023-11-02T06:12:11"):
# they place an otherwise untimed line in time (only used here)
_CTIME_IN = re.compile(
    r"\b(?:Mon|Tue|Wed|Thu|Fri|Sat|Sun) (?P<mon>Jan|Feb|Mar|Apr|May|Jun|Jul|Aug|Sep|Oct|Nov|Dec) +(?P<D>\d{1,2}) "
    r"(?P<h>\d\d):(?P<m>\d\d):(?P<s>\d\d) (?:[A-Z]{2,5}[+-]?\d{0,4} )?(?P<Y>\d{4})\b"
)
_CANCELLED_AT = re.compile(r"CANCELLED AT (?P<Y>\d{4})-(?P<M>\d\d)-(?P<D>\d\d)T(?P<h>\d\d):(?P<m>\d\d):(?P<s>\d\d)")


def _ts(y: int, mo: int, d: int, h: int, mi: int, s: int) -> float | None:
    try:
        return datetime(y, mo, d, h, mi, min(s, 59), tzinfo=UTC).timestamp()
    except ValueError:
        return None


def date_output(line: str) -> float | None:
    m = _DATE_CMD.match(line) if len(line) < 48 else None
    if m is None:
        return None
    return _ts(int(m["Y"]), _MONTHS[m["mon"]], int(m["D"]), int(m["h"]), int(m["m"]), int(m["s"]))


def stamp_in(line: str) -> float | None:
    """A time the line's message carries (a printed date, Slurm's cancel time), if any."""
    m = _CTIME_IN.search(line) if ":" in line else None
    if m is not None:
        return _ts(int(m["Y"]), _MONTHS[m["mon"]], int(m["D"]), int(m["h"]), int(m["m"]), int(m["s"]))
    m = _CANCELLED_AT.search(line) if "CANCELLED AT" in line else None
    if m is not None:
        return _ts(int(m["Y"]), int(m["M"]), int(m["D"]), int(m["h"]), int(m["m"]), int(m["s"]))
    return None


def us_stamp(line: str) -> float | None:
    m = _US_STAMP.match(line) if "/" in line[:12] else None
    if m is None:
        return stamp_in(line)
    y = int(m["Y"])
    return _ts(y + 2000 if y < 100 else y, int(m["M"]), int(m["D"]), int(m["h"]), int(m["m"]), int(m["s"]))


_SIGINT = re.compile(r"Received (?:2|Signals\.SIGINT) death signal|got signal: 2\b")


def is_interrupt(raw: str) -> bool:
    """The user's interrupt: ^C echoed by the terminal, a traceback's closing KeyboardInterrupt, or
    the launcher reporting the SIGINT it got (torchrun's "Received Signals.SIGINT death signal")."""
    s = raw.strip()
    if s.startswith("^C") or s == "KeyboardInterrupt":
        return True
    return ("death signal" in raw or "got signal" in raw) and _SIGINT.search(raw) is not None


@dataclass
class Look:
    at: int  # position among the tail's lines
    time: float
    line: str


@dataclass
class Late:
    """The file's last timestamped line, logged long after the one before it with (almost) no
    progress between: time passed in silence before it."""

    before: float  # the time of the line before the silence
    time: float
    line: str


@dataclass
class Clock:
    last_time: float | None = None  # the last timestamped line that is not a look
    progress_after: int = 0  # progress lines after it
    look: Look | None = None  # the last `date` output
    progress_after_look: bool = False
    last_progress: str = ""  # the last progress line, as logged
    last_line: str = ""  # the last line, as logged (a log that never stepped is quoted by its last line)
    quoted: str = ""  # the last progress line after the look (a `tail` of the log quotes its last line)
    cuts: list[str] = field(default_factory=list)  # other long lines after the look (`tail -c N` cuts a line)
    late: Late | None = None  # set while the last timestamped line came after a long silence
    progress_time: float | None = None  # the time of the last progress line (its own, or the last one before it)
    interrupted: bool = False  # the user's ^C / KeyboardInterrupt came after the last progress line
    _gaps: list[float] = field(default_factory=list)  # recent intervals between timestamped lines

    @property
    def end_line(self) -> str:
        """The line a stall stopped on: the last progress line, or the last line of a log that never stepped."""
        return self.last_progress or self.last_line

    def feed(self, at: int, raw: str, time: float | None, progress: bool) -> None:
        t = date_output(raw)
        if t is not None:
            self.look, self.progress_after_look = Look(at, t, raw), False
            return
        if self.look is None and _TAIL_CMD.match(raw):
            # a `tail` typed at a prompt with no `date`: a look of unknown time; it shows a stall only
            # by quoting the last line of a log that carries no time either (stalled())
            self.look, self.progress_after_look = Look(at, UNTIMED, raw), False
            return
        if self.look is not None and not progress and len(raw) >= MIN_TAIL_CUT:
            self.cuts = (self.cuts + [raw.strip()])[-MAX_CUTS:]
        self.last_line = raw.strip() or self.last_line
        if time is None:
            time = us_stamp(raw)
        if not progress and is_interrupt(raw):
            self.interrupted = True
        if time is not None:
            self._silence(raw, time, progress)
            self.last_time, self.progress_after = time, 0
        if progress:
            self.late, self.interrupted = None, False
            self.progress_time = time if time is not None else self.last_time
            self.progress_after += 1
            self.last_progress = raw.strip()
            if self.look is not None:
                self.progress_after_look, self.quoted = True, raw.strip()

    def _silence(self, raw: str, time: float, progress: bool) -> None:
        if self.last_time is None:
            return
        gap = time - self.last_time
        longest = max(self._gaps, default=0.0)
        quiet = self.progress_after <= MAX_PROGRESS_AFTER and not progress
        # long in absolute terms and against the log's own cadence: several times any pause it
        # had before (hourly epoch lines, a long evaluation are no stall)
        floor = INTERRUPT_GAP_S if self.interrupted else STALL_GAP_S
        if quiet and gap >= max(floor, CADENCE_FACTOR * longest):
            self.late = Late(self.last_time, time, raw)  # kept until progress resumes (feed)
        if gap >= 0:
            self._gaps = (self._gaps + [gap])[-64:]


def _same_progress(a: str, b: str) -> bool:
    """Two progress lines at the same point: equal, or the same step counter (a bar redrawn later
    shows the same count with a new elapsed time)."""
    if a == b:
        return bool(a)
    if len(b) >= MIN_TAIL_CUT and a.endswith(b):  # `tail -c N` quotes the end of the last line
        return True
    sa, sb = step_of(a), step_of(b)
    return sa is not None and sb is not None and sa.n is not None and (sa.n, sa.total, sa.style) == (sb.n, sb.total, sb.style)


def _quoted(c: Clock, clocks: list[Clock]) -> Clock | None:
    """The log whose last progress line the progress after the look only repeats (`tail` output)."""
    said = ([c.quoted] if c.quoted else []) + c.cuts
    return next((o for o in clocks if o is not c and any(_repeats(o, q) for q in said)), None)


def _repeats(o: Clock, q: str) -> bool:
    """``q`` (a line after the look) is the log's last progress line; or, for a log that never logged
    progress (stuck at start), its very last line (`tail -n 1` of a log that did not move)."""
    return _same_progress(o.last_progress, q) or (not o.last_progress and bool(o.last_line) and o.last_line == q)


def _quotes(c: Clock, clocks: list[Clock]) -> bool:
    return _quoted(c, clocks) is not None


def _everywhere(late: Late, clocks: list[Clock]) -> bool:
    """The silence holds in every log: no file logged progress during it (on other nodes, ranks
    other than 0 are often silent while rank 0 reports the steps)."""
    return not any(c.progress_time is not None and late.before < c.progress_time < late.time for c in clocks)


def silent_before(clocks: list[Clock], everyone: list[Clock], time: float | None, line: str) -> Late | None:
    """The long silence (in ``clocks``, and no progress in ``everyone``) that ended with this line
    (a kill, a scheduler's cancel), if any."""
    return next((c.late for c in clocks if c.late is not None and (c.late.time == time or c.late.line == line)
                 and _everywhere(c.late, everyone)), None)  # fmt: skip


def silent_end(clocks: list[tuple[Clock, object]]) -> tuple[object, Late] | None:
    """A log whose last timestamped line (no progress after it) came after a long silence that
    holds in every log."""
    every = [c for c, _ in clocks]
    return next(((s, c.late) for c, s in clocks if c.late is not None and _everywhere(c.late, every)), None)


def stalled(clocks: list[tuple[Clock, object]]) -> tuple[object, Look, float | None] | None:
    """(the scan with the look, the look, the gap in seconds) when a later look shows nothing logged
    for ``STALL_GAP_S``: the latest timestamped line of any file before the look is that old, and
    at most ``MAX_PROGRESS_AFTER`` progress lines followed it. Or the look quotes a log's last
    progress line unchanged (``date; tail train.log``): the log did not move between its end and the
    look; the gap is then None when the log carries no time to measure it with."""
    cs = [c for c, _ in clocks]
    looks = [(c.look, s, c) for c, s in clocks if c.look is not None and (not c.progress_after_look or _quotes(c, cs))]
    if not looks:
        return None
    look, owner, lc = max(looks, key=lambda x: x[0].time)  # type: ignore[union-attr]
    before = [c for c, _ in clocks if c.last_time is not None and c.last_time <= look.time]  # type: ignore[union-attr]
    ref = max(before, key=lambda c: c.last_time or 0.0) if before else None
    gap = look.time - (ref.last_time or 0.0) if ref is not None else None  # type: ignore[union-attr]
    if gap is not None and gap >= STALL_GAP_S and ref.progress_after <= MAX_PROGRESS_AFTER:  # type: ignore[union-attr]
        return owner, look, gap  # type: ignore[return-value]
    quoted = _quoted(lc, cs) if lc.progress_after_look or lc.cuts else None
    if quoted is None or quoted.last_time is not None and look.time - quoted.last_time < STALL_GAP_S:  # type: ignore[union-attr]
        return None
    if quoted.last_time is None:  # no time to measure: the evidence is the quoted log's end, name it
        return next(s for c, s in clocks if c is quoted), Look(look.at, look.time, quoted.end_line), None
    return owner, look, look.time - quoted.last_time
