"""Failure info (exit codes, signals, torch elastic error files) as evidence lines.

The agent knows how each worker ended; torch elastic error files (``error-<rank>.json``) hold the
exception message. Both are turned into synthetic lines and run through the same rules as log
lines, so the rules stay the one place that maps text to a category.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from trainguard.diagnose.rules import RuleSet
from trainguard.diagnose.scan import Hit
from trainguard.exitcodes import signal_name, signal_number

_MAX_ERROR_FILE = 1 << 20


def _error_message(data: Any) -> str:
    """The exception text of a torch elastic error file: {"message": {"message": str, ...}} or {"message": str}."""
    if not isinstance(data, dict):
        return ""
    msg = data.get("message")
    if isinstance(msg, dict):
        msg = msg.get("message", "")
    return msg if isinstance(msg, str) else ""


def failure_hits(failures: dict[int, dict[str, Any]], rules: RuleSet, origin: str = "<agent>") -> list[Hit]:
    hits: list[Hit] = []
    for rank, info in sorted(failures.items(), key=lambda kv: kv[0]):
        if not isinstance(info, dict):
            continue
        exitcode = info.get("exitcode")
        sig = signal_name(exitcode, info.get("signal"))
        num = signal_number(sig)
        lines = []
        if num is not None:
            lines.append(f"Signal {num} ({sig}) received by PID {info.get('pid')}")
        elif isinstance(exitcode, int) and exitcode != 0:
            lines.append(f"exitcode : {exitcode} (pid: {info.get('pid')})")
        msg = _error_message(info.get("error_file_data")) or info.get("message") or ""
        lines += [ln for ln in str(msg).splitlines()[-20:] if ln.strip()]
        ts = info.get("timestamp")
        for order, text in enumerate(lines):
            best = next((r for r in rules.match_line(text) if r.role != "fact"), None)
            if best is None:
                continue
            pid = info.get("pid") if isinstance(info.get("pid"), int) else None
            hits.append(Hit(best, int(rank), None, None, origin, None, text, text, order, synthetic=True,
                            failure_time=float(ts) if isinstance(ts, int | float) else None, pid=pid))  # fmt: skip
    return hits


def oom_hits(oom: dict[str, Any] | None, rules: RuleSet, origin: str = "<agent>") -> list[Hit]:
    """The agent's OOM-killer check as an evidence line: present only when the counters moved."""
    if not isinstance(oom, dict) or not oom.get("moved"):
        return []
    text = f"oom_kill event: the kernel's oom_kill counter rose by {oom.get('delta', 1)} during this attempt"
    sources = oom.get("sources") or []
    if sources:
        text += f" ({', '.join(map(str, sources))[:200]})"
    best = next((r for r in rules.match_line(text) if r.role != "fact"), None)
    if best is None:
        return []
    return [Hit(best, None, None, None, origin, None, text, text, 0, synthetic=True)]


_ERROR_FILE_RANK = re.compile(r"error-(\d+)\.json$")


def read_error_files(paths: list[Path]) -> dict[int, dict[str, Any]]:
    """rank -> failure info from torch elastic error files named ``error-<rank>.json``."""
    out: dict[int, dict[str, Any]] = {}
    for p in paths:
        m = _ERROR_FILE_RANK.search(p.name)
        if not m:
            continue
        try:
            with open(p, "rb") as f:
                data = json.loads(f.read(_MAX_ERROR_FILE).decode("utf-8", errors="replace"))
        except (OSError, ValueError):
            continue
        ts = None
        if isinstance(data, dict) and isinstance(data.get("message"), dict):
            extra = data["message"].get("extraInfo") or {}
            try:
                ts = float(extra.get("timestamp"))
            except (TypeError, ValueError):
                ts = None
        try:  # the file's mtime is when the exception was recorded, to the microsecond
            ts = p.stat().st_mtime
        except OSError:
            pass
        out[int(m[1])] = {"error_file_data": data, "exitcode": 1, "timestamp": ts, "error_file": str(p)}
    return out
