"""Cross-rank analysis (pure): from rule hits and progress of every file to one verdict.

0. Evidence before labels: lines without a rank take the rank the launcher reports as the first
   failure in the same file (torchrun's root cause, DeepSpeed's failing --local_rank) when it
   names exactly one; lines about the same process (pid) share its rank. A SIGKILL is called host
   OOM only when an OOM-killer line (kernel, scheduler, kubelet, or the agent's oom_kill counters)
   exists for that node or process; otherwise it stays killed_external (a SIGKILL not from the OOM killer).
1. Hits are grouped per rank into incidents (hits within ``INCIDENT_WINDOW_S`` of the incident's
   first hit). An incident is decided by its most specific hit (highest priority); its role is that
   hit's role, so a rank whose traceback ends in "Connection closed by peer" is a symptom.
2. The first failure is the earliest incident whose role is ``cause`` (else the earliest symptom);
   an incident the launcher reports as the first observed failure comes first.
   Hits without a time (failure info) join their rank's first incident; incidents without any time
   come after timed ones, ordered by when the agent saw the failure, then by priority.
3. Cross-rank findings: GDR on some hosts only, ranks at different epochs/steps at the end,
   collective timeouts not reported by some ranks (suspects), an error on a rank that did not exit.
4. No failure: a slowdown from step times, a hang (ranks stopped at different steps, or stopped
   from outside), a log that ends before its work was done (progress.py), or healthy.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from typing import Any

from trainguard.detect.slowdown import DEFAULT_THRESHOLD, DEFAULT_WINDOW, SlowdownWarning, detect
from trainguard.diagnose.ending import Ending, log_ending, oom_likely
from trainguard.diagnose.lines import iso
from trainguard.diagnose.lookback import silent_before, stamp_in
from trainguard.diagnose.progress import stopped
from trainguard.diagnose.rules import Rule, RuleSet
from trainguard.diagnose.scan import Hit, Progress, SourceScan

INCIDENT_WINDOW_S = 10.0
MAX_EVIDENCE = 12
MAX_CASCADE = 16
ERROR_NO_EXIT_S = 10.0  # the failing rank kept logging this long after its error: it did not exit


@dataclass
class Incident:
    key: Any
    hits: list[Hit] = field(default_factory=list)

    @property
    def start(self) -> float | None:
        times = [h.time for h in self.hits if h.time is not None]
        return min(times) if times else None

    @property
    def end(self) -> float | None:
        times = [h.time for h in self.hits if h.time is not None]
        return max(times) if times else None

    @property
    def best(self) -> Hit:
        # most specific; then a real log line over failure info; then the earliest
        top = max(self.hits, key=lambda h: (h.rule.priority, not h.synthetic,
                                            -h.time if h.time is not None else float("-inf"), -h.order))  # fmt: skip
        return _why_aborted(top, self.hits) or top

    @property
    def failure_time(self) -> float | None:
        times = [h.failure_time for h in self.hits if h.failure_time is not None]
        return min(times) if times else None

    @property
    def root(self) -> bool:
        return any(h.root for h in self.hits)


# An abort is how a process ends when C++ `terminate` runs or a watchdog takes it down on purpose;
# a segfault (SIGSEGV, SIGBUS, SIGILL) is a crash of its own.
_ABORT = re.compile(r"(?i)\baborted\b|SIGABRT|signal 6\b|core dumped|terminate called")
_CRASH = re.compile(r"(?i)segmentation|SIGSEGV|SIGBUS|SIGILL|signal (?:11|7|4)\b|bus error|illegal instruction")
_REASON = re.compile(r"what\(\):|taking the entire process down")


def _why_aborted(top: Hit, hits: list[Hit]) -> Hit | None:
    """The abort's own reason: when the process aborted (native category) and its log names the
    error it aborted on (C++'s ``what():`` line, a watchdog taking the process down), that error is
    the failure, in any framework: the abort is only how the process ended."""
    if top.rule.category != "segfault" or not _ABORT.search(top.line) or _CRASH.search(top.line):
        return None
    why = [h for h in hits if h.rule.category != "segfault" and not h.synthetic and _REASON.search(h.line)]
    return max(why, key=lambda h: (h.rule.priority, -h.order)) if why else None


def hit_dict(h: Hit) -> dict[str, Any]:
    return {
        "rank": h.rank,
        "host": h.host,
        "time": iso(h.time),
        "line": h.line,
        "file": h.file,
        "line_no": h.line_no,
        "rule": h.rule.id,
        "category": h.rule.category,
        "role": h.rule.role,
    }


def _key(h: Hit) -> Any:
    if h.rank is not None:
        return ("rank", h.rank)
    if h.host is not None:
        return ("host", h.host)
    return ("file", h.file)


def incidents(hits: Sequence[Hit]) -> list[Incident]:
    by_key: dict[Any, list[Hit]] = {}
    for h in hits:
        by_key.setdefault(_key(h), []).append(h)
    out: list[Incident] = []
    for key, hs in by_key.items():
        timed = sorted((h for h in hs if h.time is not None), key=lambda h: (h.time, h.order))
        untimed = [h for h in hs if h.time is None]
        mine: list[Incident] = []
        for h in timed:
            # A launcher's exit report ends the failure that started before it (a watchdog abort can
            # come minutes after the timeout it reports): it joins that incident, whatever the gap.
            if mine and (h.time - mine[-1].hits[0].time <= INCIDENT_WINDOW_S or "exit" in h.rule.tags):  # type: ignore[operator]
                mine[-1].hits.append(h)
            else:
                mine.append(Incident(key, [h]))
        if untimed:
            if mine:
                mine[0].hits.extend(untimed)
            else:
                mine.append(Incident(key, untimed))
        out += mine
    return out


def _order(inc: Incident) -> tuple:
    # The agent's exit times (failure_time) order failures exactly; then the launcher's own report
    # of its first observed failure; then log times. A rank the agent saw fail first beats a rank
    # that only logged losing it a moment later.
    start, ft = inc.start, inc.failure_time
    rank = inc.key[1] if inc.key[0] == "rank" else 1 << 30
    return (ft is None, ft or 0.0, not inc.root, start is None, start or 0.0, -inc.best.rule.priority, rank)


def attribute(hits: list[Hit], guessed: dict[str, str | None] | None = None) -> None:
    """Give rankless lines the rank the launcher reports as the first failure in their file, and
    every line about one process the rank of that process (the elastic table knows global ranks).
    ``guessed``: file -> the host its name suggests; a host the launcher reports beats that guess."""
    guessed = guessed or {}

    def take(h: Hit, root: Hit) -> None:
        h.rank = root.rank
        if h.host is None or (h.host == guessed.get(h.file) and root.host):
            h.host = root.host or h.host

    pid_rank = {h.pid: (h.rank, h.host) for h in hits if h.table and h.pid is not None and h.rank is not None}
    for h in hits:
        if h.pid is not None and h.pid in pid_rank and not h.synthetic:
            h.rank, h.host = pid_rank[h.pid][0], h.host or pid_rank[h.pid][1]
    roots: dict[str, list[Hit]] = {}
    for h in hits:
        if h.root and h.rank is not None:
            roots.setdefault(h.file, []).append(h)
    for h in hits:
        found = roots.get(h.file)
        if h.rank is not None or not found:
            continue
        if len({r.rank for r in found}) == 1:
            take(h, found[0])
            continue
        # several launchers' reports in one file (one per node): the report that follows a line
        # ends the failure it belongs to
        after = min((r for r in found if r.order > h.order), key=lambda r: r.order, default=None)
        if after is not None and not h.synthetic:
            take(h, after)


def oom_evidence(hits: list[Hit], rules: RuleSet) -> tuple[list[Hit], dict[int, list[Hit]]]:
    """SIGKILLs with an OOM-killer line for the same process or node become host_oom; those OOM
    lines then count as evidence of the kill, not as failures of their own."""
    ooms = [h for h in hits if "oom_kill" in h.rule.tags]
    kills = [h for h in hits if h.rule.category == "killed_external"]
    used: set[int] = set()
    evidence: dict[int, list[Hit]] = {}
    if not ooms or not kills:
        return hits, evidence
    by_pid = {o.pid for o in ooms if o.pid is not None}
    for k in kills:
        near = [o for o in ooms if o.host is None or k.host is None or o.host == k.host]
        if k.pid is not None and k.pid in by_pid:  # the kernel names this very process
            match = [o for o in ooms if o.pid == k.pid] + [o for o in near if o.pid is None]
        else:
            others = {x.pid for x in kills if x.pid != k.pid}
            match = [o for o in near if o.pid is None or o.pid not in others]
        if not match:
            continue
        k.rule = replace(k.rule, id=k.rule.id + "+oom_kill", category="host_oom", confidence="high",
                         summary="killed by the kernel OOM killer (host out of memory)", fix="")  # fmt: skip
        evidence[id(k)] = match
        used |= {id(o) for o in match}
        for o in match:
            if o.rank is None and k.rank is not None and o.pid is not None and o.pid == k.pid:
                o.rank = k.rank
    return [h for h in hits if id(h) not in used], evidence


SESSION_STOP_S = 10.0  # a stop signal this close to the user's session closing was sent by its end


def _clock(t: float) -> tuple:
    # syslog lines carry no year (they are read with the log's year, or 1970): match by date and time
    d = datetime.fromtimestamp(t, tz=UTC)
    return (d.month, d.day, d.hour * 3600 + d.minute * 60 + d.second + d.microsecond / 1e6)


def session_stops(hits: list[Hit], facts: list[Hit]) -> None:
    """A stop signal (a cancel, SIGTERM/SIGHUP) logged when the user's login session closed: the
    session's end stopped the job from outside (killed_external), it is no sign of a hang."""
    closes = [_clock(f.time) for f in facts if f.rule.id == "host.session_closed" and f.time is not None]
    if not closes:
        return
    for h in hits:
        at = h.time if h.time is not None else stamp_in(h.message)  # Slurm's "CANCELLED AT <time>"
        if h.rule.id != "launcher.sigterm" or at is None:
            continue
        mo, d, s = _clock(at)
        if any(mo == c[0] and d == c[1] and abs(s - c[2]) <= SESSION_STOP_S for c in closes):
            h.rule = replace(h.rule, id=h.rule.id + "+session_closed", category="killed_external",
                             summary="stopped when the user's login session that owned the job closed")  # fmt: skip


def _confidence(h: Hit) -> str:
    if h.rule.confidence:
        return h.rule.confidence
    if h.rule.role == "cause" and h.rule.priority >= 60:
        return "high"
    if h.rule.priority >= 30:
        return "medium"
    return "low"


def _gdr_finding(facts: list[Hit]) -> dict[str, Any] | None:
    gdr_hosts = {h.host for h in facts if h.rule.id == "nccl.gdr_channel" and h.host}
    channel_hosts = {h.host for h in facts if h.rule.id == "nccl.channel" and h.host}
    without = sorted(channel_hosts - gdr_hosts)
    if not gdr_hosts or not without:
        return None
    ev = [
        next(h for h in facts if h.rule.id == "nccl.gdr_channel" and h.host == host)
        for host in sorted(gdr_hosts)
    ][:4]
    ev += [next(h for h in facts if h.rule.id == "nccl.channel" and h.host == host) for host in without][:4]
    return {
        "id": "gdr_mismatch",
        "message": f"GPUDirect RDMA (GDRDMA) is used on {', '.join(sorted(gdr_hosts))} but not on {', '.join(without)}",
        "fix": 'Turn GDR off everywhere (os.environ["NCCL_NET_GDR_LEVEL"] = "0" at the start of the program) '
        "or have operations enable GDR on the nodes without it.",
        "hosts_with_gdr": sorted(gdr_hosts),
        "hosts_without_gdr": without,
        "evidence": [hit_dict(h) for h in ev],
    }


def _alignment_findings(progress: dict[Any, Progress]) -> list[dict[str, Any]]:
    ranked = {r: p for r, p in progress.items() if r is not None}
    if len(ranked) < 2:
        return []
    epochs = {r: p.epoch for r, p in ranked.items() if p.epoch is not None}
    if len(set(epochs.values())) > 1 and len(epochs) == len(ranked):
        groups: dict[int, list[int]] = {}
        for r, e in sorted(epochs.items()):
            groups.setdefault(e, []).append(r)
        desc = "; ".join(f"epoch {e}: ranks {rs}" for e, rs in sorted(groups.items()))
        return [{
            "id": "data_misaligned",
            "message": f"ranks ended at different epochs ({desc}): the data split is not aligned, so some "
            "ranks finished while others wait for them",
            "fix": "Give every rank the same number of batches (DistributedSampler with drop_last=True, or "
            "split the tensors evenly), so no rank leaves the last epoch early.",
            "ranks_behind": groups[min(groups)],
            "evidence": [{"rank": r, "time": iso(ranked[r].time), "line": ranked[r].line} for r in sorted(ranked)][:8],
        }]  # fmt: skip
    steps = {r: p.step for r, p in ranked.items() if p.step is not None}
    if len(steps) >= 2 and max(steps.values()) - min(steps.values()) >= 2:
        low = min(steps.values())
        behind = sorted(r for r, s in steps.items() if s == low)
        return [{
            "id": "ranks_at_different_steps",
            "message": f"at the end, rank(s) {behind} were at step {low} while others reached step "
            f"{max(steps.values())}: the ranks behind were stuck (or the data is not aligned)",
            "fix": "Look at what the ranks behind were doing (py-spy dump); make sure every rank runs the same "
            "number of steps.",
            "ranks_behind": behind,
            "evidence": [{"rank": r, "time": iso(ranked[r].time), "line": ranked[r].line} for r in behind][:8],
        }]  # fmt: skip
    return []


def _suspects(hits: list[Hit], ranks_seen: set[int]) -> dict[str, Any] | None:
    timed_out = {h.rank for h in hits if h.rule.category == "nccl_timeout" and h.rank is not None}
    missing = sorted(ranks_seen - timed_out)
    if not timed_out or not missing:
        return None
    return {
        "id": "suspect_ranks",
        "message": f"ranks {sorted(timed_out)} reported a collective timeout but rank(s) {missing} did not: "
        "those were most likely stuck or dead and are the place to look",
        "ranks": missing,
    }


def _no_exit(
    first: Incident, scans: list[SourceScan], all_hits: list[Hit], has_failures: bool
) -> dict[str, Any] | None:
    if has_failures or first.end is None or first.key[0] != "rank":
        return None
    if any(h.rule.id.startswith(("launcher.", "elastic.")) for h in all_hits):
        return None
    rank = first.key[1]
    last = max((s.last_time.get(rank, float("-inf")) for s in scans), default=float("-inf"))
    progressed = any(p.time is not None and p.time > first.end for s in scans for p in s.progress.values())
    if last < first.end + ERROR_NO_EXIT_S or progressed:
        return None
    return {
        "id": "error_without_exit",
        "message": f"rank {rank} logged an error but kept running without progress (its log goes on "
        f"{last - first.end:.0f} s after the error): the job did not exit, so the other ranks wait for it",
        "fix": "Fix the error; and let errors end the process (do not catch and continue in a rank; set "
        "TORCH_NCCL_ASYNC_ERROR_HANDLING=1) so the job fails fast instead of hanging.",
        "rank": rank,
    }


def _sustained(warns: list[SlowdownWarning]) -> list[SlowdownWarning]:
    """The warnings of slow windows that follow one another: a slowdown lasts. One slow window
    between normal ones is a pause (an evaluation, a checkpoint save, fp16 overflow steps skipped
    while the loss scale settles), not a slower run."""
    keep = set()
    for i, (a, b) in enumerate(zip(warns, warns[1:], strict=False)):
        if b.first_iter == a.last_iter + 1:
            keep.update((i, i + 1))
    return [w for i, w in enumerate(warns) if i in keep]


def _slowdown(scans: list[SourceScan], window: int, threshold: float) -> dict[str, Any] | None:
    series: dict[Any, list[tuple[int, float]]] = {}
    for s in scans:
        for rank, samples in s.steps.items():
            series.setdefault(rank, []).extend(samples)
    found = {}
    for rank, samples in series.items():
        warns = _sustained(detect(samples, window, threshold))
        if warns:
            found[rank] = warns
    if not found:
        return None
    rank = min(found, key=lambda r: (r is None, r if r is not None else 0))
    warns = found[rank]
    return {
        "rank": rank,
        "ranks": sorted(r for r in found if r is not None),
        "warnings": [w.to_dict() for w in warns[-5:]],
        "worst_ratio": round(max(w.ratio for w in warns), 4),
    }


def _stopped(scans: list[SourceScan]) -> tuple[str, SourceScan | None] | None:
    """Live (the job stopped): a log that ends before its work was done (progress.py), with the
    file that shows it."""
    if not scans or any(s.completed for s in scans):
        return None
    styles = set().union(*(s.styles for s in scans))
    started = any(s.started for s in scans)
    with_steps = [s for s in scans if s.last_step is not None]
    for s in sorted(with_steps, key=lambda s: (not s.last_step.unfinished, str(s.source.path))):  # type: ignore[union-attr]
        why = stopped(s.last_step, styles, False, started)
        if why:
            return why, s
    why = stopped(None, styles, False, started) if not with_steps else None
    return (why, next((s for s in scans if s.started), None)) if why else None


NEEDS_EXIT_LINES = 30  # an error message counts when the launcher's exit report follows within this


def gate_needs_exit(hits: list[Hit]) -> list[Hit]:
    """Hits of rules tagged ``needs_exit`` (an error message without an exception type) count only
    when a launcher's non-zero exit report for the same rank follows them closely in the same file;
    they take that report's rank."""
    exits = [h for h in hits if "exit" in h.rule.tags and h.rule.category == "exit_nonzero"]
    out = []
    for h in hits:
        if "needs_exit" not in h.rule.tags:
            out.append(h)
            continue
        e = next((e for e in exits if e.file == h.file and 0 < e.order - h.order <= NEEDS_EXIT_LINES
                  and (e.line_no is None or h.line_no is None or 0 < e.line_no - h.line_no <= NEEDS_EXIT_LINES)
                  and (h.rank is None or e.rank is None or e.rank == h.rank)), None)  # fmt: skip
        if e is not None:
            h.rank, h.host = (h.rank if h.rank is not None else e.rank), h.host or e.host
            out.append(h)
    return out


_WORK = re.compile(r"SeqNum=(\d+), OpType=(\w+)(?:, NumelIn=(\d+))?")


def odd_rank(hits: list[Hit]) -> int | None:
    """NCCL watchdog timeouts at one sequence number: the one rank whose op (type, and element
    count) differs from all the others' is the odd one out (it called another collective, or the
    same one on another tensor), not the lowest rank."""
    ops: dict[int, dict[int, tuple[str, str | None]]] = {}
    for h in hits:
        m = _WORK.search(h.message) if h.rule.category == "nccl_timeout" and h.rank is not None else None
        if m:
            ops.setdefault(int(m[1]), {})[h.rank] = (m[2], m[3])  # type: ignore[index]
    for by_rank in ops.values():
        # the op type first: element counts differ between ranks in uneven collectives (all-to-all)
        for key in (lambda op: op[0], lambda op: op):
            counts = Counter(key(op) for op in by_rank.values()).most_common()
            if len(by_rank) >= 3 and len(counts) == 2 and counts[1][1] == 1:
                return next(r for r, op in by_rank.items() if key(op) == counts[1][0])
            if len(counts) > 1:
                break
    return _behind(hits)


_ENQUEUED = re.compile(r"last enqueued (?:NCCL )?work: (-?\d+)")


def _behind(hits: list[Hit]) -> int | None:
    """The one rank whose last enqueued collective is behind every other rank's: it never reached
    the collective the others wait in."""
    last: dict[int, int] = {}
    for h in hits:
        m = _ENQUEUED.search(h.message) if h.rank is not None and "enqueued" in h.message else None
        if m:
            last[h.rank] = max(last.get(h.rank, -1), int(m[1]))  # type: ignore[index]
    if len(last) < 3:
        return None
    low = min(last.values())
    behind = [r for r, n in last.items() if n == low]
    return behind[0] if len(behind) == 1 else None


@dataclass
class Context:
    """What every file and hit of one diagnosis show, gathered once."""

    scans: list[SourceScan]
    hits: list[Hit]
    oom_ev: dict[int, list[Hit]]
    ranks_seen: set[int]
    findings: list[dict[str, Any]]
    gdr: dict[str, Any] | None
    slow: dict[str, Any] | None
    incs: list[Incident]
    recovered: list[Incident] = field(default_factory=list)  # errors the process went on training after
    guessed: dict[str, str | None] = field(default_factory=dict)  # file -> the host its name suggests


def gather(scans: list[SourceScan], extra_hits: list[Hit], rules: RuleSet, window: int, threshold: float) -> Context:
    hits = [h for s in scans for h in s.hits] + list(extra_hits)
    guessed = {str(s.source.path): s.source.host for s in scans}
    attribute(hits, guessed)
    hits = gate_needs_exit(hits)
    hits, oom_ev = oom_evidence(hits, rules)
    facts = [h for s in scans for h in s.facts]
    session_stops(hits, facts)
    ranks_seen: set[int] = set().union(*(s.ranks for s in scans)) if scans else set()
    ranks_seen |= {h.rank for h in hits if h.rank is not None}
    progress: dict[Any, Progress] = {}
    for s in scans:
        for r, p in s.progress.items():
            old = progress.get(r)
            if old is None or (p.time or 0) >= (old.time or 0):
                progress[r] = p
    findings: list[dict[str, Any]] = []
    gdr = _gdr_finding(facts)
    if gdr:
        findings.append(gdr)
    findings += _alignment_findings(progress)
    return Context(scans, hits, oom_ev, ranks_seen, findings, gdr, _slowdown(scans, window, threshold), incidents(hits),
                   guessed=guessed)  # fmt: skip


RECOVERED_STEPS = 3  # progress lines of the same rank after an error that did not end the run
_GO_ON = ("nan_loss", "hang_no_error", "slowdown")  # failures that do not stop the progress lines


def recovered(inc: Incident, ctx: Context) -> bool:
    """The process went on training after this error (the same rank logged several progress lines
    after it, and no launcher reported an exit after it): a warning it survived, not the failure
    (HF's batch-size finder catching an OOM, a retried connection, a NCCL fallback)."""
    offs = [h.offset for h in inc.hits if h.offset is not None and not h.synthetic]
    if inc.best.rule.category in _GO_ON or not offs or any(h.synthetic for h in inc.hits):
        return False
    last, file = max(offs), inc.best.file
    rank = inc.key[1] if inc.key[0] == "rank" else None
    scan = next((s for s in ctx.scans if str(s.source.path) == file), None)
    if scan is None:
        return False
    after = [o for o, r in scan.progress_at if o > last and (rank is None or r is None or r == rank)]
    exits = [h for h in ctx.hits if h.file == file and "exit" in h.rule.tags and (h.offset or 0) > last]
    return len(after) >= RECOVERED_STEPS and not exits


def _logged_first(first: Incident, rivals: list[Incident]) -> Incident:
    """Untimed, the same failure on several ranks in one file (interleaved output of one launcher):
    the rank whose line was logged first failed first, not the lowest rank number; the same for a
    process known only by its host (an NCCL line whose init line is not in the log)."""
    if first.start is not None or first.failure_time is not None or first.key[0] not in ("rank", "host"):
        return first
    b = first.best
    same = [i for i in rivals if i.key[0] in ("rank", "host") and i.start is None and i.failure_time is None
            and i.root == first.root and i.best.rule.category == b.rule.category and i.best.file == b.file
            and not i.best.synthetic and not i.best.table and i.best.offset is not None]  # fmt: skip
    return min(same, key=lambda i: i.best.offset or 0) if first in same and len(same) > 1 else first


def _exit_report(i: Incident, file: str) -> Hit | None:
    """The incident's launcher exit report (an untimed log line) in ``file``, if any."""
    return next((h for h in i.hits if "exit" in h.rule.tags and h.file == file and h.time is None
                 and not h.synthetic and not h.table and h.offset is not None), None)  # fmt: skip


def _killed_after(first: Incident, live: list[Incident]) -> Incident:
    """A launcher reports exits in the order it sees them and then kills the rest (srun's
    "Terminating StepId", mpirun's abort, torchrun's closing signals): a rank reported killed after
    another rank's exit in the same report was killed by the launcher; that other rank came first."""
    if first.best.rule.category != "killed_external" or first.key[0] != "rank":
        return first
    mine = _exit_report(first, first.best.file)
    if mine is None:
        return first
    earlier = [(h, i) for i in live if i.key[0] == "rank" and i.key != first.key
               for h in [_exit_report(i, mine.file)] if h is not None and (h.offset or 0) < (mine.offset or 0)]  # fmt: skip
    return min(earlier, key=lambda x: x[0].offset or 0)[1] if earlier else first


def first_incident(ctx: Context) -> Incident | None:
    survived = [i for i in ctx.incs if recovered(i, ctx)]
    ctx.recovered = survived
    live = [i for i in ctx.incs if i not in survived]
    causes = sorted((i for i in live if i.best.rule.role == "cause"), key=_order)
    symptoms = sorted((i for i in live if i.best.rule.role != "cause"), key=_order)
    first = causes[0] if causes else (symptoms[0] if symptoms else None)
    if first is not None:
        first = _killed_after(_logged_first(first, causes if causes else symptoms), live)
    if first is not None and first.best.rule.category == "nccl_timeout":
        odd = odd_rank(ctx.hits)
        alt = next((i for i in causes + symptoms if i.key == ("rank", odd) and i.best.rule.category == "nccl_timeout"), None)
        first = alt or first
    return first


def _end_report(rule: Rule) -> bool:
    """A report of how a process ended (a launcher's exit line, a signal's symptom), not a cause."""
    return "exit" in rule.tags or rule.role == "symptom"


def _rank_of_host_failure(first: Incident, ctx: Context) -> tuple[int | None, str | None]:
    """A failure seen on a host without a rank (a kernel line): the rank that failed the same way
    within the incident window after it, on that host or one not named, is the rank it hit; else
    (untimed reports: slurmstepd's oom-kill, then srun's "gpu001: task 0: Out Of Memory") the rank
    whose untimed report of the same failure follows it in the same file, and that report's host
    when the failure's own host is only guessed from the file name. (rank, host or None)"""
    start, host, cat, b = first.start, first.best.host, first.best.rule.category, first.best
    guessed = host is None or host == ctx.guessed.get(b.file)
    same = [i for i in ctx.incs if i.key[0] == "rank" and i.best.rule.category == cat]
    on_host = [i for i in same if i.best.host in (None, host) or i.best.host == ctx.guessed.get(i.best.file)]
    near = [i for i in on_host if start is not None and i.start is not None and 0 <= i.start - start <= INCIDENT_WINDOW_S]
    after = [i for i in ctx.incs if i.key[0] == "rank" and i.start is None and i.best.file == b.file and i.best.order > b.order]
    if not near:
        near = [i for i in after if i in (same if guessed else on_host)]
    if not near and start is None:
        # no report of the same failure: the launcher's report of the one process whose end
        # followed it (mp.spawn's "process 1 terminated with signal SIGABRT") names the rank
        near = [i for i in after if _end_report(i.best.rule)]
    ranks = {i.key[1] for i in near}
    if len(ranks) != 1:
        return None, None
    # a host the following report names in its line (not one guessed from its file name)
    hosts = {i.best.host for i in near if i.start is None and i.best.host != ctx.guessed.get(i.best.file)}
    named = hosts.pop() if guessed and len(hosts) == 1 and near[0].best.rule.category == cat else None
    return ranks.pop(), named


def _failure(result: dict[str, Any], first: Incident, ctx: Context, rules: RuleSet, has_failures: bool) -> None:
    best = first.best
    cat = best.rule.category
    result.update(category=cat, confidence=_confidence(best), family=rules.family_for(best.rule))
    result["first_failure"] = {k: v for k, v in hit_dict(best).items() if k not in ("category", "role")}
    guess = ctx.guessed.get(best.file)
    if best.host is None or best.host == guess:  # another line of the failure may name it (the elastic table)
        result["first_failure"]["host"] = next((h.host for h in first.hits if h.host and h.host != guess), best.host)
    ev = sorted(first.hits, key=lambda h: (h.synthetic, h.time or 0.0, h.order))
    oom = sorted({id(x): x for h in first.hits for x in ctx.oom_ev.get(id(h), [])}.values(), key=lambda h: h.order)
    ev = [best] + oom + [h for h in ev if h is not best]
    result["evidence"] = [hit_dict(h) for h in ev[:MAX_EVIDENCE]]
    result["fix"] = rules.fix_for(best.rule)
    host = result["first_failure"]["host"]
    rank, named = (best.rank, None) if best.rank is not None else _rank_of_host_failure(first, ctx)
    if named:
        host = result["first_failure"]["host"] = named
    result["first_failure"]["rank"] = rank
    where = f"rank {rank}" if rank is not None else (host or best.file)
    if host and rank is not None:
        where += f" on {host}"
    result["summary"] = f"{best.rule.summary or rules.summary_for(cat)} ({where})"
    seen_keys: set[Any] = set()
    for inc in sorted(ctx.incs, key=_order):
        if inc is first or inc.key == first.key or inc.key in seen_keys:
            continue
        seen_keys.add(inc.key)
        result["cascade"].append(hit_dict(inc.best))
        if len(result["cascade"]) >= MAX_CASCADE:
            break
    if cat == "nccl_timeout":
        sus = _suspects(ctx.hits, ctx.ranks_seen)
        if sus:
            ctx.findings.append(sus)
    ne = _no_exit(first, ctx.scans, ctx.hits, has_failures)
    if ne:
        ctx.findings.append(ne)


def _hang_at(result: dict[str, Any], rules: RuleSet, confidence: str, summary: str, fix: str = "") -> None:
    result.update(category="hang_no_error", confidence=confidence, summary=summary, family=rules.family_for("hang_no_error"),
                  fix=fix or rules.fix_for("hang_no_error"))  # fmt: skip


def _ff(rank: int | None, host: str | None, line: str, file: str | None, rule: str, time: Any = None) -> dict[str, Any]:
    return {"rank": rank, "host": host, "time": time, "line": line, "file": file, "line_no": None, "rule": rule}


def _no_failure(result: dict[str, Any], ctx: Context, rules: RuleSet, live: bool) -> Ending | None:
    """No error in the logs: a lag between ranks, a GDR mismatch, a slowdown, or how the logs end
    (live: the job stopped, so a log short of its work is a hang; offline: ending.py)."""
    lag = next((f for f in ctx.findings if f["id"] in ("data_misaligned", "ranks_at_different_steps")), None)
    if lag is not None:
        _hang_at(result, rules, "medium", f"{rules.summary_for('hang_no_error')}; {lag['message']}",
                 lag["fix"] + " " + rules.fix_for("hang_no_error"))  # fmt: skip
        e0 = lag["evidence"][0]
        result["first_failure"] = _ff(lag["ranks_behind"][0], None, e0["line"], None, lag["id"], e0["time"])
        result["evidence"] = lag["evidence"]
    elif ctx.gdr is not None:
        _hang_at(result, rules, "low", f"no error logged, but {ctx.gdr['message']}: a known cause of hangs at start",
                 ctx.gdr["fix"])  # fmt: skip
        result["evidence"] = ctx.gdr["evidence"]
    elif ctx.slow is not None:
        w = ctx.slow["warnings"][0]
        result.update(category="slowdown", confidence="high", fix=rules.fix_for("slowdown"),
                      summary=f"{rules.summary_for('slowdown')}: {w['message']}")  # fmt: skip
        result["evidence"] = [{"rank": ctx.slow["rank"], "line": x["message"]} for x in ctx.slow["warnings"]]
    elif live:
        _live_stopped(result, ctx, rules)
    else:
        return _offline_end(result, ctx, rules)
    return None


def _live_stopped(result: dict[str, Any], ctx: Context, rules: RuleSet) -> None:
    halt = _stopped(ctx.scans)
    if halt is None:
        result.update(summary=rules.summary_for("healthy"), fix=rules.fix_for("healthy"), confidence="medium")
        return
    why, scan = halt
    _hang_at(result, rules, "low", f"{why} with no error and no completion line: the job hung or was stopped from outside")
    line = scan.last_step_line if scan is not None else ""
    result["first_failure"] = _ff(scan.source.rank if scan else None, scan.source.host if scan else None, line,
                                  str(scan.source.path) if scan else None, "progress.stopped")  # fmt: skip
    result["evidence"] = [{"line": line, "file": str(scan.source.path)}] if scan is not None and line else []


# Seed 000 (训练前卡死, hang before training): the live hang report's init_hang advice, offline.
START_HANG_FIX = (
    "Hung during start-up, before the first training step: on a multi-node job, check that every node is "
    "given the master address and port (master_ip: MASTER_ADDR/MASTER_PORT or --rdzv-endpoint) and its rank "
    "(RANK / --node-rank) and that the world size matches the processes started; set NCCL_DEBUG=INFO "
    "(os.environ[\"NCCL_DEBUG\"] = \"INFO\") to see NCCL's progress: a hang before any NCCL INFO line means "
    "the ranks never reached NCCL (a master_ip or rank not passed). "
)


def _offline_end(result: dict[str, Any], ctx: Context, rules: RuleSet) -> Ending:
    end = log_ending(ctx.scans)
    if end.hang:
        where = {"stack_dump": "the stack dump shows where", "stalled_at_start": "before its first training step",
                 "zero_steps": "before its first training step"}.get(end.kind, "after its last logged progress")
        _hang_at(result, rules, "medium", f"{end.why}: the job hung ({where})",
                 START_HANG_FIX + rules.fix_for("hang_no_error") if end.kind == "stalled_at_start" else "")
        result["first_failure"] = _ff(end.rank, end.host, end.line, end.file, f"ending.{end.kind}")
        result["evidence"] = [{"rank": end.rank, "host": end.host, "line": end.line, "file": end.file, "rule": end.rule}]
        return end
    conf = "high" if end.kind == "completed" else "medium"
    result.update(summary=rules.summary_for("healthy") + (f" ({end.why})" if end.kind != "nothing" else ""),
                  fix=rules.fix_for("healthy"), confidence=conf)  # fmt: skip
    if end.line:
        result["evidence"] = [{"rank": end.rank, "host": end.host, "line": end.line, "file": end.file, "rule": end.rule}]
    return end


def _offline_kill(result: dict[str, Any], first: Incident, ctx: Context, rules: RuleSet) -> bool:
    """Offline, a SIGKILL with no kernel line while loading (or with host RAM nearly full):
    host RAM OOM likely, to be confirmed with dmesg. Live, the oom_kill counters decide instead."""
    likely = oom_likely(ctx.scans)
    if result["category"] != "killed_external" or likely is None:
        return False
    where = result["summary"].rsplit(" (", 1)[-1] if result["summary"].endswith(")") else ""
    if not likely.memory:  # loading alone does not show memory ran out: the kill stands, OOM is the lead
        result["summary"] = (f"killed by SIGKILL {likely.why}; these logs have no OOM-killer line, so only the kill "
                             "is certain: host RAM OOM is the likely sender (confirm with `dmesg -T | grep -i oom` "
                             "on the node)" + (f" ({where}" if where else ""))  # fmt: skip
        return False
    result.update(category="host_oom", confidence=likely.confidence, family=rules.family_for("host_oom"),
                  fix=rules.fix_for("host_oom"),
                  summary=f"host RAM OOM likely (confirm with dmesg): killed by SIGKILL {likely.why}, and these logs "
                          "have no kernel line; the kernel's OOM killer is the likely sender, `dmesg -T | grep -i oom` "
                          "on the node confirms it" + (f" ({where}" if where else ""))  # fmt: skip
    result["evidence"] = [{"line": ln, "rank": first.best.rank, "rule": rid}
                          for ln, rid in zip(likely.lines, likely.rules, strict=True)] + result["evidence"]
    return True


_LOWER = {"high": "medium", "medium": "low", "low": "low"}
# A stop that ends a wait rather than causing a failure: the scheduler's time limit, the user's
# interrupt (^C, SIGINT). Not a SIGKILL: that is also how the kernel's OOM killer stops a job.
_WAIT_ENDER = re.compile(r"DUE TO TIME LIMIT|SIGINT|got signal: 2\b|KeyboardInterrupt|^\s*\^C")


def _stopped_stall(result: dict[str, Any], best: Hit, ctx: Context, rules: RuleSet) -> bool:
    """Offline, a time-limit cancel or the user's interrupt of a job whose logs, read without the
    stop, show a stall (no training step after start-up, a later look, a long silence): the job had
    hung and the stop only ended the wait."""
    if _WAIT_ENDER.search(best.line) is None:
        return False
    end = log_ending(ctx.scans)
    if not end.hang:
        return False
    _hang_at(result, rules, "medium", f"{end.why}, and then the job was stopped ({best.line.strip()[:120]}): the job "
             "hung, and the stop ended the wait")  # fmt: skip
    result["first_failure"] = _ff(end.rank, end.host, end.line, end.file, f"ending.{end.kind}")
    return True




def _offline_idle_stop(result: dict[str, Any], first: Incident, ctx: Context, rules: RuleSet) -> bool:
    """Offline, a stop from outside (a scheduler's time limit, a kill) that came after a long
    silence in the same log: the job had hung, and the stop only ended it."""
    best = first.best
    if result["category"] != "killed_external" or best.synthetic:
        return False
    late = silent_before([s.clock for s in ctx.scans if str(s.source.path) == best.file],
                         [s.clock for s in ctx.scans], best.time, best.line)  # fmt: skip
    if late is None:
        return _stopped_stall(result, best, ctx, rules)
    hours = (late.time - late.before) / 3600
    _hang_at(result, rules, "medium", f"nothing was logged for {hours:.1f} h before the job was stopped from outside "
             f"({best.line.strip()[:120]}): the job hung, and the stop ended it")  # fmt: skip
    result["first_failure"]["rule"] = "ending.silent_before_stop"
    return True


def _hypo(category: str, confidence: str, summary: str, evidence: list[Any], rank: int | None = None) -> dict[str, Any]:
    lines = [e.get("line") if isinstance(e, dict) else str(e) for e in evidence]
    return {"category": category, "confidence": confidence, "summary": summary, "rank": rank,
            "evidence": [ln for ln in lines if ln][:3]}  # fmt: skip


def hypotheses(result: dict[str, Any], first: Incident | None, ctx: Context, rules: RuleSet,
               end: Ending | None, oom_guess: bool) -> list[dict[str, Any]]:  # fmt: skip
    """The verdict first, then the other readings of the same logs, each with its evidence."""
    ff = result.get("first_failure") or {}
    out = [_hypo(result["category"], result["confidence"], result["summary"], result["evidence"], ff.get("rank"))]
    if oom_guess:
        out.append(_hypo("killed_external", "low", "killed by SIGKILL from outside the job (a scheduler, a person, a "
                         "watchdog): nothing in these logs names the sender", [ff], ff.get("rank")))  # fmt: skip
    elif ff.get("rule") == "dataloader.worker_killed":
        out.append(_hypo("host_oom", "low", "the kernel's OOM killer is the usual sender of that signal (confirm with "
                         "dmesg on the node)", [ff], ff.get("rank")))  # fmt: skip
    elif ff.get("rule") == "ending.silent_before_stop":
        out.append(_hypo("killed_external", "low", "stopped from outside while it was still working (only the "
                         "silence before the stop says it was not)", [ff], ff.get("rank")))  # fmt: skip
    elif result["category"] == "killed_external":
        likely = oom_likely(ctx.scans)
        out.append(_hypo("host_oom", "medium" if likely else "low",
                         f"host RAM OOM likely: killed {likely.why}; confirm with dmesg on the node" if likely else
                         "host RAM OOM is possible: these logs have no kernel line to tell "
                         "(confirm or rule out with dmesg on the node)", [ff] + (likely.lines if likely else []),
                         ff.get("rank")))  # fmt: skip
    if end is not None and end.kind == "ended_on_progress":
        out.append(_hypo("hang_no_error", "low", "the job may have hung right after the last progress line, if it "
                         "was still running when the log ended", [{"line": end.line}], end.rank))  # fmt: skip
    for inc in ctx.recovered[:2]:
        b = inc.best
        out.append(_hypo(b.rule.category, "low", f"{b.rule.summary or rules.summary_for(b.rule.category)}, but "
                         "training went on after it (a warning the run survived?)", [hit_dict(b)], b.rank))  # fmt: skip
    seen = {h["category"] for h in out}
    for inc in sorted(ctx.incs, key=_order):
        b = inc.best
        if inc is first or b.rule.category in seen or b.rule.role == "fact" or inc in ctx.recovered:
            continue
        seen.add(b.rule.category)
        out.append(_hypo(b.rule.category, _LOWER[_confidence(b)], b.rule.summary or rules.summary_for(b.rule.category),
                         [hit_dict(b)], b.rank))  # fmt: skip
        if len(out) >= 5:
            break
    return out


def say_confidence(result: dict[str, Any]) -> None:
    """Keep the first hypothesis at the verdict's confidence, and a low-confidence verdict saying so
    in one line."""
    result["hypotheses"][0]["confidence"] = result["confidence"]
    result.pop("low_confidence", None)
    if result["confidence"] == "low":
        alt = next((h["category"] for h in result["hypotheses"][1:]), None)
        basis = (result.get("first_failure") or {}).get("rule") or "no rule"
        result["low_confidence"] = (f"low confidence: only weak evidence ({basis}); a lead, not a verdict"
                                    + (f"; also possible: {alt}" if alt else ""))  # fmt: skip


def analyze(
    scans: list[SourceScan],
    extra_hits: list[Hit],
    rules: RuleSet,
    has_failures: bool = False,
    window: int = DEFAULT_WINDOW,
    threshold: float = DEFAULT_THRESHOLD,
    live: bool = False,
) -> tuple[dict[str, Any], Hit | None]:
    """The verdict (a JSON-able dict) and the hit it names as the first failure (None if none).
    ``live``: the agent asks after its workers failed (it knows the job stopped); otherwise the
    logs are read offline, where a log that just ends is no failure."""
    ctx = gather(scans, extra_hits, rules, window, threshold)
    first = first_incident(ctx)
    result: dict[str, Any] = {"category": "healthy", "summary": "", "confidence": "medium", "family": None,
                              "first_failure": None, "evidence": [], "fix": "", "findings": ctx.findings,
                              "cascade": [], "slowdown": ctx.slow}  # fmt: skip
    end, oom_guess = None, False
    if first is not None:
        _failure(result, first, ctx, rules, has_failures)
        oom_guess = not live and _offline_kill(result, first, ctx, rules)
        if not live and not oom_guess:
            _offline_idle_stop(result, first, ctx, rules)
    else:
        end = _no_failure(result, ctx, rules, live or has_failures)
    result["hypotheses"] = hypotheses(result, first, ctx, rules, end, oom_guess)
    say_confidence(result)
    result["ranks"] = sorted(ctx.ranks_seen)
    return result, (first.best if first is not None else None)
