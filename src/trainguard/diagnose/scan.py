"""Scan one log file: rule hits on candidate lines, and progress/step times from its tail.

The whole file goes through the keyword prefilter in big chunks; only candidate lines are decoded,
split into prefix fields and matched against the rules. Fact lines feed the launcher context
(attribution.py) that gives unprefixed lines their rank and host. A line longer than ``MAX_LINE``
is matched in windows around its keywords, so text far into a huge line is still found. The tail
(last ``TAIL_BYTES``) is read line by line for the last epoch/step of each rank, the time of each
rank's last line, step times for slowdown detection, NaN/Inf in the training numbers
(nanwatch.py) and how far the training got (progress.py).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from trainguard.diagnose.attribution import Attribution, Who
from trainguard.diagnose.lines import _NCCL_HOST, LineInfo, parse_line, rank_in_text
from trainguard.diagnose.linesplit import HALF, LINE_CAP
from trainguard.diagnose.lookback import Clock
from trainguard.diagnose.nanwatch import NanWatch
from trainguard.diagnose.prefilter import Prefilter
from trainguard.diagnose.progress import DATA_BAR, Step, step_of
from trainguard.diagnose.rules import TAIL_TAGS, Rule, RuleSet
from trainguard.diagnose.sources import ReadReport, Source, read_chunks
from trainguard.diagnose.steplog import StepTimer, parse_step
from trainguard.diagnose.streams import TEXT_ERRORS

TAIL_BYTES = 256 << 10
WAIT_FRAME_LINES = 12  # an interrupt at most this many lines after a collective frame ends that traceback
MAX_LINE = 8192  # characters of a line kept for matching and evidence (longer: windows, see above)
MAX_WINDOWS = 64  # keyword windows tried in one huge line
MAX_HITS = 5000  # per file, per kind (hits, facts): bounded memory on error storms
MAX_STEP_SAMPLES = 4096
_EPOCH = re.compile(r"\b[Ee]poch\b\W{0,3}(\d+)")
_YEAR = re.compile(rb"\b((?:19|20)\d\d)-[01]\d-[0-3]\d[T _]\d\d:\d\d")


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
    pid: int | None = None  # the process the line is about (exit reports, OOM kills, NCCL lines)
    root: bool = False  # the launcher reports this as the first observed failure
    table: bool = False  # part of torch elastic's failure table


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
    last_step: Step | None = None  # the last progress line of the file (progress.py)
    last_step_line: str = ""
    styles: set[str] = field(default_factory=set)  # frameworks recognised from the progress lines
    completed: bool = False  # a completion line (rules tagged "completion")
    started: bool = False  # a start-up marker (rules tagged "startup")
    # tail-only markers (rules tagged startup, stackdump, loading, memreport): tag -> the last one,
    # as (position among the tail's lines, the line, the pattern's named groups, the rule's id)
    marks: dict[str, tuple[int, str, dict[str, str], str]] = field(default_factory=dict)
    last_step_at: int | None = None  # position of the last progress line among the tail's lines
    last_metric_at: int | None = None  # ... of the last line reporting a loss/accuracy value (any format)
    progress_at: list[tuple[int, int | None]] = field(default_factory=list)  # (file offset, rank) of progress lines in the tail
    notes: list[str] = field(default_factory=list)  # what could not be read, and why
    read: ReadReport = field(default_factory=ReadReport)  # how the file was read (compression, skips, cuts)
    clock: Clock = field(default_factory=Clock)  # the last logged time and a later look (lookback.py)
    stalled: set[int] = field(default_factory=set)  # ranks a stall inspector names as the ones not submitting
    ready: set[int] = field(default_factory=set)  # ranks a stall inspector names as ready (the others are missing)
    waits: int = 0  # "still waiting for ranks" lines since the last progress line (rules tagged "waiting")

    @property
    def stalled_rank(self) -> int | None:
        """The one rank Horovod's stall inspector says the others wait for: named under "Stalled
        ranks:" / "Missing ranks:", or the only rank missing from its "[ready ranks: ...]" lists."""
        if len(self.stalled) == 1:
            return next(iter(self.stalled))
        if self.stalled or not self.ready:
            return None
        missing = set(range(max(self.ready | self.ranks) + 1)) - self.ready
        return missing.pop() if len(missing) == 1 else None


def _decode(b: bytes) -> str:
    return b[: MAX_LINE * 2].decode("utf-8", errors=TEXT_ERRORS)[:MAX_LINE].replace("\x00", "")


def context_before(path: str, offset: int, lines: int = 8, reach: int = 8192) -> list[str]:
    """The lines logged just before the line at ``offset`` (a traceback's frames, say)."""
    try:
        with open(path, "rb") as f:
            f.seek(max(0, offset - reach))
            data = f.read(min(offset, reach))
    except OSError:
        return []
    text = data.decode("utf-8", errors=TEXT_ERRORS).splitlines()  # a lone CR ends a line too
    if offset > reach:
        text = text[1:]
    return [t[:MAX_LINE] for t in text if t.strip()][-lines:]


def _groups(m) -> dict[str, str | None]:
    try:
        return m.groupdict()
    except AttributeError:  # pragma: no cover - engines without named groups
        return {}


# a training metric with its value, in any format (fairseq "loss=9.1", torchtune "Loss: 2.3",
# pytorch examples "Loss: 0.352"): progress even where no step counter is recognised
# a compound key counts too: detectron2's "total_loss: 1.6", "triplet_loss=0.69", "softmax_accuracy=0.1"
_METRIC = re.compile(r"(?i)(?<![\w/])(?:[a-z]{1,24}_|train |lm |total )?(?:loss|ppl|perplexity|acc|accuracy)\b['\"]?\s*[:=]?\s*['\"]?\d")
# Horovod's stall inspector: "Stalled ranks:" then one "4: [tensor, ...]" line per rank, or
# "Missing ranks: 4, 7" on one line, or per tensor "[ready ranks: 0, 1, 3]" (the others are missing).
_STALLED_RANK = re.compile(r"^\s*(\d{1,5}): \[")
_MISSING_RANKS = re.compile(r"Missing ranks:\s*((?:\d{1,5}(?:,\s*)?)+)")
_READY_RANKS = re.compile(r"\[ready ranks: ((?:\d{1,5}(?:,\s*)?)+)\]")


def stall_ranks(out: SourceScan, msg: str, after_header: bool) -> None:
    """Collect the ranks a stall inspector line names (``after_header``: the line follows
    "Stalled ranks:")."""
    m = _STALLED_RANK.match(msg) if after_header else None
    if m:
        out.stalled.add(int(m[1]))
        return
    m = _MISSING_RANKS.search(msg) if "Missing ranks" in msg else None
    if m:
        out.stalled.update(int(x) for x in re.findall(r"\d+", m[1]))
    for m in _READY_RANKS.finditer(msg) if "ready ranks" in msg else ():
        out.ready.update(int(x) for x in re.findall(r"\d+", m[1]))


# A step counter followed by other numeric key:value fields on the same line (verl's "step:3 -
# actor/pg_loss:-0.002 - ...", "global_step=40, lr=..."): a training record in any framework.
_STEP_RECORD = re.compile(r"\b(?:global_step|step)\s*[:=]\s*[1-9]\d*\b.{0,40}?[\s,|-][\w/.]{1,60}\s*[:=]\s*-?\d")


class Scanner:
    def __init__(self, rules: RuleSet, engine: str = "auto") -> None:
        self.all_rules = rules
        self._tail_rules = [r for r in rules.rules if TAIL_TAGS & set(r.tags)]
        self.rules = rules = rules.for_logs()
        self.prefilter = Prefilter(rules.keywords(), engine)
        self.text_prefilter = Prefilter(self.all_rules.keywords(), engine)
        # Keywords that only ever lead to facts (NCCL init lines, table fields, markers): such lines
        # take a short path (no time or rank parsing), which keeps chatty NCCL INFO logs fast.
        sup = rules._index()[2]
        self._fact_only = {
            i
            for i, k in enumerate(self.prefilter.keywords)
            if all(rules.rules[j].role == "fact" for j in sup.get(k, ()))
        }
        self._nan_rule = rules.by_id("nan.watch")

    def _candidates(self, raw: bytes) -> list[tuple[str, bool]]:
        """(text, windowed) pieces of one candidate line to match: the line, or keyword windows of it."""
        if len(raw) <= MAX_LINE:
            return [(_decode(raw).rstrip("\r"), False)]
        if len(raw) > LINE_CAP:  # the line cap: only its first and last HALF bytes are matched
            return self._windows(raw[:HALF]) + self._windows(raw[-HALF:], cut=True)
        return self._windows(raw)

    def _windows(self, raw: bytes, cut: bool = False) -> list[tuple[str, bool]]:
        out, last_end = [], -1
        for pos in self.prefilter.positions(raw, MAX_WINDOWS):
            lo = max(0, pos - MAX_LINE // 2)
            if lo < last_end:
                continue
            last_end = lo + MAX_LINE
            text = raw[lo:last_end].decode("utf-8", errors=TEXT_ERRORS).replace("\x00", "")
            out.append(("…" + text + "…" if lo or cut else text + "…", True))
        return out

    def scan(self, source: Source, max_bytes: int | None = None) -> SourceScan:
        out = SourceScan(source)
        file = str(source.path)
        year = source.year
        ctx = Attribution()
        tail: list[bytes] = []
        tail_len = 0
        order = 0
        end_offset: int | None = None  # where the last chunk ends in the file (None: not known, .gz)
        for chunk in read_chunks(source.path, max_bytes, out.notes, out.read):
            buf, size = chunk.data, chunk.end  # buf is used again for the next chunk: copy what is kept
            end_offset = None if chunk.offset is None else chunk.offset + size
            if out.bytes == 0:  # the log's own year dates glog/syslog lines (they have none)
                y = _YEAR.search(buf, 0, min(size, 1 << 16))
                year = int(y.group(1)) if y else year
            out.bytes += size
            tail.append(bytes(buf[max(0, size - TAIL_BYTES) : size]))
            tail_len += len(tail[-1])
            while tail_len - len(tail[0]) >= TAIL_BYTES:
                tail_len -= len(tail.pop(0))
            counted, line_no = 0, chunk.start_line
            kws = self.prefilter.keywords
            for start, end, ids in self.prefilter.lines_ids(buf, size):
                if line_no is not None:
                    line_no += buf.count(b"\n", counted, start)
                    counted = start
                order += 1
                raw = buf[start:end]
                found = None if ids is None or len(raw) > MAX_LINE else [kws[i] for i in ids]
                if found is not None and ids <= self._fact_only:
                    self._fact_line(out, ctx, _decode(raw).rstrip("\r"), found, file, order, year)
                    continue
                head = parse_line(_decode(raw[:4096]).rstrip("\r"), year) if len(raw) > MAX_LINE else None
                for text, windowed in self._candidates(raw):
                    info = (
                        parse_line(text, year)
                        if head is None
                        else LineInfo(head.time, head.rank, head.host, text, head.pid)
                    )
                    matched = self.rules.match_rules(info.message, found)
                    if not matched:
                        continue
                    ln = None if line_no is None else line_no + 1
                    off = None if chunk.offset is None else chunk.offset + start
                    self._line(out, ctx, info, matched, text, file, ln, off, order)
                    if windowed:
                        break
        if source.rank is not None:
            out.ranks.add(source.rank)
        self._file_rank(out, ctx.file_rank())
        data = b"".join(tail)[-TAIL_BYTES:]
        self._scan_tail(data, out, year, None if end_offset is None else end_offset - len(data))
        unranked = {(h.host, h.pid) for h in out.hits if h.rank is None and h.pid is not None and h.host}
        if unranked:
            self._nccl_ranks(out, unranked, max_bytes)
        return out

    def _nccl_ranks(self, out: SourceScan, procs: set[tuple[str, int]], max_bytes: int | None) -> None:
        """NCCL lines name a process (host:pid), not a rank. Its communicator init line does
        (``host:pid:tid [dev] NCCL INFO comm 0x.. rank R nranks N``; NCCL >= 2.19 writes
        ``ncclCommInitRank comm 0x..``, ``ncclCommSplit comm 0x..``): read the file again for those
        processes only, which costs nothing when no unranked NCCL error was found."""
        alts = b"|".join(re.escape(f"{h}:{p}:".encode()) for h, p in sorted(procs))
        comm = re.compile(
            rb"(?:^|[\s\]])(" + alts + rb")\d+ \[\d+\] NCCL INFO (?:ncclComm\w+ )?comm 0x[0-9a-f]+ rank (\d+) nranks \d+"
        )
        ranks: dict[tuple[str, int], int] = {}
        for chunk in read_chunks(out.source.path, max_bytes):
            for m in comm.finditer(chunk.data, 0, chunk.end):
                host, pid = m.group(1).decode().rstrip(":").rsplit(":", 1)
                ranks.setdefault((host, int(pid)), int(m.group(2)))
            if len(ranks) == len(procs):
                break
        for h in out.hits:
            if h.rank is None and (h.host, h.pid) in ranks:
                h.rank = ranks[(h.host, h.pid)]
                out.ranks.add(h.rank)

    def _fact_line(
        self, out: SourceScan, ctx: Attribution, text: str, found: list[str], file: str, order: int, year: int
    ) -> None:
        """A line that can only match facts: its NCCL host/pid and the facts' groups are all it gives
        (and its time, for facts tagged "timed": one event is matched to another by time)."""
        n = _NCCL_HOST.search(text, 0, 300) if "NCCL" in text else None
        host, pid = (n["host"], int(n["pid"])) if n else (None, None)
        matched = self.rules.match_rules(text, found)
        if matched:
            timed = any("timed" in r.tags for r, _ in matched)
            info = parse_line(text, year) if timed else LineInfo(None, None, host, text, pid)
            self._line(out, ctx, info, matched, text, file, None, None, order)

    def _line(self, out: SourceScan, ctx: Attribution, info: LineInfo, matched: list[tuple[Rule, object]],
              text: str, file: str, ln: int | None, off: int | None, order: int) -> None:  # fmt: skip
        if info.rank is not None and "Traceback (most recent call last)" in info.message:
            ctx.traceback(info.rank, order)
        for r, m in matched:
            if r.role != "fact":
                continue
            if "completion" in r.tags:
                out.completed = True
            elif "startup" in r.tags:
                out.started = True
            groups = {k: v for k, v in _groups(m).items() if v is not None}
            if groups:
                ctx.fact(groups, order, info.host, info.pid)
            elif len(out.facts) < MAX_HITS and set(r.tags) <= {"timed"}:
                out.facts.append(Hit(r, self._rank(info, out.source, Who()), info.host or out.source.host,
                                     info.time, file, ln, text, info.message, order))  # fmt: skip
        best, bm = next(((r, m) for r, m in matched if r.role != "fact"), (None, None))
        if best is None:
            return
        who = ctx.resolve(info.message, order, info.host, info.pid)
        blamed = next((v for k, v in _groups(bm).items() if k.startswith("rank") and v is not None), None)
        rank = int(blamed) if blamed is not None else self._rank(info, out.source, who)
        host = info.host or who.host or out.source.host
        if len(out.hits) >= MAX_HITS:
            out.dropped_hits += 1
            return
        out.hits.append(Hit(best, rank, host, info.time, file, ln, text, info.message, order, offset=off,
                            pid=who.pid if who.pid is not None else info.pid, root=who.root and "exit" in best.tags, table=who.table))  # fmt: skip
        if rank is not None:
            out.ranks.add(rank)

    @staticmethod
    def _file_rank(out: SourceScan, rank: int | None) -> None:
        """The file names one rank as its own (or spawn's failed one): its rankless failures are that rank's."""
        if rank is None:
            return
        for h in out.hits:
            if h.rank is None:
                h.rank = rank
                out.ranks.add(rank)

    @staticmethod
    def _rank(info: LineInfo, source: Source, who: Who) -> int | None:
        for r in (info.rank, source.rank, who.rank):
            if r is not None:
                return r
        return rank_in_text(info.message)

    def _mark(self, out: SourceScan, at: int, raw: str, msg: str) -> None:
        for r in self._tail_rules:
            m = r.match(msg)
            if m is None:
                continue
            for tag in TAIL_TAGS & set(r.tags):
                out.marks[tag] = (at, raw[:MAX_LINE], {k: v for k, v in m.groupdict().items() if v is not None}, r.id)
            out.waits += "waiting" in r.tags
            wait = out.marks.get("waitframe")
            if "interrupt" in r.tags and wait is not None and at - wait[0] <= WAIT_FRAME_LINES:
                out.marks["waited"] = wait  # the interrupt ended a traceback waiting there (ending.py)
            out.started = out.started or "startup" in r.tags

    def _scan_tail(self, data: bytes, out: SourceScan, year: int, base: int | None = None) -> None:
        """Progress, markers and the NaN watch over the log's last bytes. ``base``: the file offset
        of ``data`` (None when not known), to place progress lines relative to error lines."""
        src = out.source
        timers: dict[int | None, StepTimer] = {}
        nan = NanWatch()
        header = False
        for at, m in enumerate(re.finditer(rb"[^\r\n]+", data)):
            if m.end() - m.start() > MAX_LINE:
                continue
            raw = m.group().decode("utf-8", errors=TEXT_ERRORS)
            info = parse_line(raw, year)
            msg = info.message
            rank = info.rank if info.rank is not None else src.rank
            if rank is None and ("ank" in msg):
                rank = rank_in_text(msg)
            if rank is not None:
                out.ranks.add(rank)
            if info.time is not None:
                out.last_time[rank] = info.time
            self._mark(out, at, raw, msg)
            # Horovod's "3: [tensor]" list entry reads like srun -l's "3: " prefix: the whole line names the rank
            entry = raw if header and _STALLED_RANK.match(msg) is None else msg
            stall_ranks(out, entry, header)
            header = msg.rstrip().endswith("Stalled ranks:") or (header and _STALLED_RANK.match(entry) is not None)
            metric = (("oss" in msg or "cc" in msg or "ppl" in msg) and _METRIC.search(msg) is not None) or (
                "step" in msg and _STEP_RECORD.search(msg) is not None)
            if metric:
                out.last_metric_at, out.waits = at, 0
            st = step_of(msg)
            if st is not None:
                out.last_step, out.last_step_line, out.last_step_at = st, raw, at
                out.styles.add(st.style)
            training = st is not None and st.n and not (st.style == "tqdm" and DATA_BAR.search(raw))
            if training:
                out.waits = 0
            out.clock.feed(at, raw, info.time, bool(metric or training))
            if base is not None and (metric or training) and len(out.progress_at) < MAX_STEP_SAMPLES:
                out.progress_at.append((base + m.start(), rank))
            watched = nan.feed(rank, msg)
            if watched and self._nan_rule is not None and len(out.hits) < MAX_HITS:
                out.hits.append(Hit(self._nan_rule, rank, info.host or src.host, info.time, str(src.path), None,
                                    nan.anchor or raw, watched, order=1 << 30))  # fmt: skip
                nan.anchor = None
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
        for rank, record, verdict in nan.finish() if self._nan_rule is not None else ():
            if len(out.hits) < MAX_HITS:
                out.hits.append(Hit(self._nan_rule, rank, src.host, None, str(src.path), None, record, verdict,  # type: ignore[arg-type]
                                    order=1 << 30))  # fmt: skip
