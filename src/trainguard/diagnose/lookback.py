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

STALL_GAP_S = 30 * 60.0  # a look this long after the last logged line, nothing logged between: a stall
CADENCE_FACTOR = 3.0  # a silence must be this many times the longest earlier pause between timestamped lines
MAX_PROGRESS_AFTER = 2  # untimed progress lines allowed between the last timestamp and the look

# `date`'s default output on a line of its own: "Sat Aug 26 16:05:12 UTC 2023"
_DATE_CMD = re.compile(
    r"^\s*(?:Mon|Tue|Wed|Thu|Fri|Sat|Sun) (?P<mon>Jan|Feb|Mar|Apr|May|Jun|Jul|Aug|Sep|Oct|Nov|Dec) +(?P<D>\d{1,2}) "
    r"(?P<h>\d\d):(?P<m>\d\d):(?P<s>\d\d) (?:[A-Z]{2,5}[+-]?\d{0,4} )?(?P<Y>\d{4})\s*$"
)
# month/day/year stamps at a line's start (Python logging's %m/%d/%Y, rich's [%x %X]), which the
# prefix parser does not read: only used here, to place the last logged line in time
_US_STAMP = re.compile(r"^\[?(?P<M>\d\d)/(?P<D>\d\d)/(?P<Y>\d{4}|\d\d)[ ,]+(?P<h>\d\d):(?P<m>\d\d):(?P<s>\d\d)\b")
_MONTHS = {m: i for i, m in enumerate("Jan Feb Mar Apr May Jun Jul Aug Sep Oct Nov Dec".split(), 1)}


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


def us_stamp(line: str) -> float | None:
    m = _US_STAMP.match(line) if "/" in line[:12] else None
    if m is None:
        return None
    y = int(m["Y"])
    return _ts(y + 2000 if y < 100 else y, int(m["M"]), int(m["D"]), int(m["h"]), int(m["m"]), int(m["s"]))


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
    quoted: str = ""  # the last progress line after the look (a `tail` of the log quotes its last line)
    late: Late | None = None  # set while the last timestamped line came after a long silence
    progress_time: float | None = None  # the time of the last progress line (its own, or the last one before it)
    _gaps: list[float] = field(default_factory=list)  # recent intervals between timestamped lines

    def feed(self, at: int, raw: str, time: float | None, progress: bool) -> None:
        t = date_output(raw)
        if t is not None:
            self.look, self.progress_after_look = Look(at, t, raw), False
            return
        if time is None:
            time = us_stamp(raw)
        if time is not None:
            self._silence(raw, time, progress)
            self.last_time, self.progress_after = time, 0
        if progress:
            self.late = None
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
        if quiet and gap >= max(STALL_GAP_S, CADENCE_FACTOR * longest):
            self.late = Late(self.last_time, time, raw)  # kept until progress resumes (feed)
        if gap >= 0:
            self._gaps = (self._gaps + [gap])[-64:]


def _quotes(c: Clock, clocks: list[Clock]) -> bool:
    """The progress after the look only repeats another file's last progress line (`tail` output)."""
    return any(o is not c and o.last_progress == c.quoted for o in clocks)


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


def stalled(clocks: list[tuple[Clock, object]]) -> tuple[object, Look, float] | None:
    """(the scan with the look, the look, the gap in seconds) when a later look shows nothing logged
    for ``STALL_GAP_S``: the latest timestamped line of any file before the look is that old, and
    at most ``MAX_PROGRESS_AFTER`` progress lines followed it."""
    cs = [c for c, _ in clocks]
    looks = [(c.look, s) for c, s in clocks if c.look is not None and (not c.progress_after_look or _quotes(c, cs))]
    if not looks:
        return None
    look, owner = max(looks, key=lambda x: x[0].time)  # type: ignore[union-attr]
    before = [c for c, _ in clocks if c.last_time is not None and c.last_time <= look.time]  # type: ignore[union-attr]
    if not before:
        return None
    ref = max(before, key=lambda c: c.last_time or 0.0)
    gap = look.time - (ref.last_time or 0.0)  # type: ignore[union-attr]
    if gap < STALL_GAP_S or ref.progress_after > MAX_PROGRESS_AFTER:
        return None
    return owner, look, gap  # type: ignore[return-value]
