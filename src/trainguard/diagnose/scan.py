"""Scan one log file: rule hits on candidate lines, and progress/step times from its tail.

The whole file goes through the keyword prefilter in big chunks; only candidate lines are decoded,
split into prefix fields and matched against the rules. The tail (last ``TAIL_BYTES``) is read
line by line for the last epoch/step of each rank, the time of each rank's last line, and step
times for slowdown detection.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from trainguard.diagnose.lines import parse_line, rank_in_text
from trainguard.diagnose.prefilter import Prefilter
from trainguard.diagnose.rules import Rule, RuleSet
from trainguard.diagnose.sources import Source, read_chunks
from trainguard.diagnose.steplog import StepTimer, parse_step

TAIL_BYTES = 256 << 10
MAX_LINE = 8192  # characters of a line kept for matching and evidence
MAX_HITS = 5000  # per file, per kind (hits, facts): bounded memory on error storms
MAX_STEP_SAMPLES = 4096
_EPOCH = re.compile(r"\b[Ee]poch\b\W{0,3}(\d+)")
_SUMMARY_REACH = 6  # candidate lines after an elastic summary "rank :" line that it applies to


@dataclass
class Hit:
    rule: Rule
    rank: int | None
    host: str | None
    time: float | None
    file: str
    line_no: int | None  # 1-based; None when the file was read from its tail
    line: str  # the whole line, as logged (truncated)
    message: str  # the line without its prefixes
    order: int = 0  # position among the file's candidate lines
    synthetic: bool = False  # made from failure info (exit codes, error files), not a log line
    failure_time: float | None = None  # for synthetic hits: when the agent saw the failure
    offset: int | None = None  # byte offset of the line in its (uncompressed, plain) file


@dataclass
class Progress:
    epoch: int | None
    step: int | None
    time: float | None
    line: str


@dataclass
class SourceScan:
    source: Source
    hits: list[Hit] = field(default_factory=list)
    facts: list[Hit] = field(default_factory=list)
    progress: dict[int | None, Progress] = field(default_factory=dict)  # rank -> last progress line
    last_time: dict[int | None, float] = field(default_factory=dict)  # rank -> time of its last line
    steps: dict[int | None, list[tuple[int, float]]] = field(default_factory=dict)  # rank -> samples
    ranks: set[int] = field(default_factory=set)
    bytes: int = 0
    dropped_hits: int = 0


def _decode(b: bytes) -> str:
    return b[: MAX_LINE * 2].decode("utf-8", errors="replace")[:MAX_LINE].replace("\x00", "")


def context_before(path: str, offset: int, lines: int = 8, reach: int = 8192) -> list[str]:
    """The lines logged just before the line at ``offset`` (a traceback's frames, say)."""
    try:
        with open(path, "rb") as f:
            f.seek(max(0, offset - reach))
            data = f.read(min(offset, reach))
    except OSError:
        return []
    text = data.decode("utf-8", errors="replace").split("\n")
    if offset > reach:
        text = text[1:]
    return [t[:MAX_LINE] for t in text if t.strip()][-lines:]


class Scanner:
    def __init__(self, rules: RuleSet, engine: str = "auto") -> None:
        self.rules = rules
        self.prefilter = Prefilter(rules.keywords(), engine)
        self._fact_rules = [r for r in rules.rules if r.role == "fact"]

    def scan(self, source: Source, max_bytes: int | None = None) -> SourceScan:
        out = SourceScan(source)
        file = str(source.path)
        tail: list[bytes] = []
        tail_len = 0
        pending: tuple[int | None, str | None, int] = (None, None, -1)  # elastic summary rank, host, until
        order = 0
        for chunk in read_chunks(source.path, max_bytes):
            buf = chunk.data
            out.bytes += len(buf)
            tail.append(buf)
            tail_len += len(buf)
            while tail_len - len(tail[0]) >= TAIL_BYTES:
                tail_len -= len(tail.pop(0))
            counted, line_no = 0, chunk.start_line
            for start, end in self.prefilter.lines(buf):
                if line_no is not None:
                    line_no += buf.count(b"\n", counted, start)
                    counted = start
                order += 1
                text = _decode(buf[start:end]).rstrip("\r")
                info = parse_line(text, source.year)
                matched = self.rules.match_line(info.message)
                if not matched:
                    continue
                rank = info.rank if info.rank is not None else source.rank
                if rank is None:
                    rank = rank_in_text(info.message)
                host = info.host or source.host
                ln = None if line_no is None else line_no + 1
                off = None if chunk.offset is None else chunk.offset + start
                for r in matched:
                    if r.role != "fact":
                        continue
                    if r.id == "elastic.summary_rank":
                        m = r.pattern.search(info.message)
                        pending = (int(m["rank"]), pending[1], order + _SUMMARY_REACH)
                    elif r.id == "elastic.summary_host":
                        m = r.pattern.search(info.message)
                        pending = (pending[0], m["host"], order + _SUMMARY_REACH)
                    elif len(out.facts) < MAX_HITS:
                        out.facts.append(Hit(r, rank, host, info.time, file, ln, text, info.message, order))
                best = next((r for r in matched if r.role != "fact"), None)
                if best is None:
                    continue
                if best.id.startswith("launcher.") and order <= pending[2] and info.rank is None:
                    rank = pending[0] if pending[0] is not None else rank
                    host = pending[1] or host
                if len(out.hits) >= MAX_HITS:
                    out.dropped_hits += 1
                    continue
                out.hits.append(
                    Hit(best, rank, host, info.time, file, ln, text, info.message, order, offset=off)
                )
                if rank is not None:
                    out.ranks.add(rank)
        if source.rank is not None:
            out.ranks.add(source.rank)
        self._scan_tail(b"".join(tail)[-TAIL_BYTES:], out)
        return out

    def _scan_tail(self, data: bytes, out: SourceScan) -> None:
        src = out.source
        timers: dict[int | None, StepTimer] = {}
        text = data.decode("utf-8", errors="replace")
        for raw in re.split(r"[\r\n]+", text):
            if not raw or len(raw) > MAX_LINE:
                continue
            info = parse_line(raw, src.year)
            msg = info.message
            rank = info.rank if info.rank is not None else src.rank
            if rank is None and ("ank" in msg):
                rank = rank_in_text(msg)
            if rank is not None:
                out.ranks.add(rank)
            if info.time is not None:
                out.last_time[rank] = info.time
            obs = parse_step(msg, info.time)
            e = _EPOCH.search(msg) if ("poch" in msg) else None
            if obs is None and e is None:
                continue
            if obs is not None and rank is None and obs.rank is not None:
                rank = obs.rank
            prev = out.progress.get(rank)
            out.progress[rank] = Progress(
                int(e[1]) if e else (prev.epoch if prev else None),
                obs.iteration if obs else (prev.step if prev else None),
                info.time,
                raw[:MAX_LINE],
            )
            if obs is not None:
                sample = timers.setdefault(rank, StepTimer()).feed(obs)
                series = out.steps.setdefault(rank, [])
                if sample is not None and len(series) < MAX_STEP_SAMPLES:
                    series.append(sample)
