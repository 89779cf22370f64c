"""Diagnose the job's own logs after every worker failure.

On ``on_workers_failed`` the monitor reads ``RUN_DIR/logs/attempt-<restart_count>/`` (bounded: the
first MB and the last ``--diagnose-max-mb`` of each file) together with the agent's failure info
(exit codes, signals, error files: strong evidence, e.g. SIGKILL means not the user's code), emits
one ``diagnosis`` event (rank = first failing rank, evidence = the diagnosis) and puts the same
dict into ``ctx.extra["diagnosis"]`` for the policy.

A SIGKILL with a silent log is host OOM only when the kernel says so: the kernel's ``oom_kill``
counters (the workers' cgroups, else /proc/vmstat) are read when workers start and again when they
fail (probes/oom.py); the diagnosis gets the difference, so an outside ``kill -9`` reads
"killed from outside the job", not host_oom.
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path
from typing import Any

from trainguard.launch.monitor import Monitor, MonitorContext

log = logging.getLogger(__name__)

# Categories where the job can not go on by itself: an error event. The rest are warnings.
_ERROR_CATEGORIES = {"gpu_hardware", "cuda_oom", "host_oom", "disk_full_or_io", "segfault", "python_exception",
                     "nan_loss", "cuda_error_other", "dataloader", "rendezvous_failure", "killed_external"}  # fmt: skip


def add_run_arguments(group: argparse._ArgumentGroup) -> None:
    group.add_argument(
        "--no-diagnose", action="store_true", help="do not diagnose the logs after a worker failure"
    )
    group.add_argument("--diagnose-rules", action="append", type=Path, default=[], metavar="FILE",
                       help="extra diagnosis rules file (TOML); repeatable")  # fmt: skip
    group.add_argument("--diagnose-max-mb", type=float, default=4.0, metavar="MB",
                       help="read at most the last MB of each rank log when diagnosing (default 4)")  # fmt: skip


def create(options: argparse.Namespace) -> Monitor | None:
    if getattr(options, "no_diagnose", False):
        return None
    rules = list(getattr(options, "diagnose_rules", None) or [])
    max_mb = float(getattr(options, "diagnose_max_mb", 4.0) or 4.0)
    if rules:  # fail at start, with the file named, rather than at the first failure
        from trainguard.diagnose.rules import load_rules

        load_rules(rules)
    return DiagnosisMonitor(rules, int(max_mb * (1 << 20)))


def _jsonable_failures(failures: dict[int, dict[str, Any]]) -> dict[int, dict[str, Any]]:
    keep = ("local_rank", "pid", "exitcode", "signal", "error_file_data", "message", "timestamp", "first_failure")
    out = {}
    for r, i in failures.items():
        row = {k: v for k, v in (i or {}).items() if k in keep}
        if (i or {}).get("exit_time"):  # the agent's exact exit time orders failures best
            row["timestamp"] = i["exit_time"]
        out[int(r)] = row
    return out


class DiagnosisMonitor(Monitor):
    name = "diagnosis"

    def __init__(self, rules: list[Path], max_bytes: int) -> None:
        self.rules = rules
        self.max_bytes = max_bytes
        self._oom_files: list[str] = []
        self._oom_before = None

    def on_workers_started(self, ctx: MonitorContext) -> None:
        from trainguard.probes import oom

        self._oom_files = oom.files_for(w.pid for w in ctx.workers)  # while the workers live
        self._oom_before = oom.read_counters(self._oom_files)

    def _oom_evidence(self) -> dict[str, Any] | None:
        from trainguard.probes import oom

        if self._oom_before is None:
            return None
        return oom.compare(self._oom_before, oom.read_counters(self._oom_files)).to_dict()

    def diagnose(self, ctx: MonitorContext, failures: dict[int, dict[str, Any]]) -> dict[str, Any]:
        from trainguard.diagnose import diagnose_paths

        logs = Path(ctx.run_dir) / "logs" / f"attempt-{ctx.restart_count}"
        paths: list[Path] = [logs] if logs.is_dir() else []
        info = _jsonable_failures(failures)
        if not paths:  # no rank logs: the tails the agent kept are the log
            for r, i in info.items():
                if not i.get("message") and failures[r].get("log_tail"):
                    i["message"] = "\n".join(str(x) for x in failures[r]["log_tail"][-20:])
        result = diagnose_paths(paths, self.rules or None, failures=info, oom=self._oom_evidence(),
                                max_bytes_per_file=self.max_bytes)  # fmt: skip
        if not paths:  # no rank logs (yet): the agent's log tails are all there is
            result["note"] = f"no rank logs under {logs}"
        result["attempt"] = ctx.restart_count
        return result

    def on_workers_failed(self, ctx: MonitorContext, failures: dict[int, dict[str, Any]]) -> None:
        try:
            result = self.diagnose(ctx, failures)
        except Exception as exc:  # never let the diagnosis take the agent down
            log.warning("diagnosis failed: %s", exc)
            result = {"category": "unknown", "summary": f"diagnosis failed: {exc}", "first_failure": None,
                      "evidence": [], "fix": "", "findings": []}  # fmt: skip
        ctx.extra["diagnosis"] = result
        ff = result.get("first_failure") or {}
        rank = ff.get("rank") if isinstance(ff.get("rank"), int) else (min(failures) if failures else None)
        severity = "error" if result.get("category") in _ERROR_CATEGORIES else "warning"
        msg = f"{result.get('category')}: {result.get('summary', '')}"
        if result.get("fix"):
            msg += f" — fix: {result['fix'].split('. ')[0]}"
        ctx.events.emit("diagnosis", msg, severity=severity, rank=rank, evidence=result)
