"""Log diagnosis: the first failure across ranks, its root cause, evidence and a fix.

from trainguard.diagnose import diagnose_paths, classify_text
result = diagnose_paths(["run/logs/attempt-0"])   # the same dict `trainguard diagnose --json` prints
verdict = classify_text(log_tail_lines)          # category, cause family, peer_loss of a short text
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from trainguard.detect.slowdown import DEFAULT_THRESHOLD, DEFAULT_WINDOW
from trainguard.diagnose.rules import RuleError, RuleSet
from trainguard.diagnose.scanners import own_scanner, shared_scanner
from trainguard.diagnose.sources import SourceError
from trainguard.diagnose.text import TextVerdict, classify_text

__all__ = ["diagnose_paths", "classify_text", "TextVerdict", "RuleError", "SourceError", "DiagnoseError"]

DiagnoseError = (RuleError, SourceError)

def _agent_order_first(failure_info: dict[int, dict[str, Any]]) -> None:
    """The agent saw which rank exited first (``first_failure``); every other rank failed after it,
    whatever its error file's clock says (ranks that lost that peer write theirs within ms)."""
    first = next((r for r, i in failure_info.items() if i.get("first_failure")), None)
    t0 = failure_info[first].get("timestamp") if first is not None else None
    if not isinstance(t0, int | float):
        return
    for rank, info in failure_info.items():
        ts = info.get("timestamp")
        if rank != first and (not isinstance(ts, int | float) or ts <= t0):
            info["timestamp"] = t0 + 1e-3


def diagnose_paths(
    paths: list[str | Path],
    extra_rules: list[Path] | None = None,
    *,
    failures: dict[int, dict[str, Any]] | None = None,
    oom: dict[str, Any] | None = None,
    max_bytes_per_file: int | None = None,
    window: int = DEFAULT_WINDOW,
    threshold: float = DEFAULT_THRESHOLD,
    engine: str = "auto",
    ruleset: RuleSet | None = None,
) -> dict[str, Any]:
    """Diagnose log files/dirs/globs. ``failures`` is the agent's failure info (rank -> exitcode,
    signal, error_file_data, ...). ``oom`` is the kernel's OOM-killer evidence for the attempt
    (``trainguard.probes.oom.OomEvidence.to_dict()``): a SIGKILL is host OOM only when it moved.
    ``max_bytes_per_file`` bounds the read to the head and the last bytes of each file. Raises
    RuleError / SourceError for bad rules files or paths. ``ruleset``: use these rules instead of the
    built-in ones (bench/diagnose_accuracy.py scores families without the rules fitted to them)."""
    from trainguard.diagnose.analyze import analyze, say_confidence
    from trainguard.diagnose.failures import failure_hits, oom_hits, read_error_files
    from trainguard.diagnose.readstats import read_stats
    from trainguard.diagnose.sources import describe, error_files, expand

    rules, scanner = shared_scanner(extra_rules, engine) if ruleset is None else own_scanner(ruleset, engine)
    notes: list[str] = []
    files = expand(paths, notes)
    scans = [scanner.scan(describe(f), max_bytes_per_file) for f in files if not f.name.endswith(".json")]
    failure_info = read_error_files(error_files([Path(p) for p in paths if Path(p).exists()]))
    for rank, info in (failures or {}).items():
        failure_info[int(rank)] = {**failure_info.get(int(rank), {}), **info}
    _agent_order_first(failure_info)
    extra = failure_hits(failure_info, rules) + oom_hits(oom, rules)
    live = failures is not None or oom is not None  # the agent asks: it knows the job stopped
    result, first = analyze(
        scans, extra, rules, has_failures=bool(failure_info), window=window, threshold=threshold, live=live
    )
    ff = result.get("first_failure")
    off = first.offset if first is not None else None
    if ff and off is not None and ff.get("file"):
        from trainguard.diagnose.scan import context_before

        ff["context"] = context_before(ff["file"], off)
    if result["category"] == "killed_external" and oom and oom.get("checked"):
        result["summary"] = result["summary"].replace(
            "(no OOM-killer event)", "(no OOM-killer event: the kernel's oom_kill counters did not move)"
        )
        result["confidence"] = "medium"
    elif result["category"] == "killed_external" and live:  # the agent could not read the kernel's counters
        result["confidence"] = "low"
    say_confidence(result)
    if oom:
        result["oom_check"] = oom
    if result["category"] == "healthy" and not any(s.bytes for s in scans):
        # Nothing read is no evidence of health: an empty dir, empty or unreadable files.
        result.update(category="no_logs", confidence="none", fix="give the job's log files or directories",
                      summary=f"nothing to diagnose: {len(scans)} file(s), no log line read")
    notes += [n for s in scans for n in s.notes]
    if notes:
        result["notes"] = notes
    result["stats"] = {
        "files": len(scans),
        **read_stats(scans, max_bytes_per_file),
        "bytes": sum(s.bytes for s in scans),
        "hits": sum(len(s.hits) for s in scans),
        "dropped_hits": sum(s.dropped_hits for s in scans),
        "prefilter": scanner.prefilter.engine,
    }
    if failure_info:
        result["failures"] = {
            str(r): {k: v for k, v in i.items() if k in ("exitcode", "signal", "pid", "error_file")}
            for r, i in sorted(failure_info.items())
        }
    return result
