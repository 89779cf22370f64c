"""Diagnose the job's own logs after every worker failure.

On ``on_workers_failed`` the monitor reads ``RUN_DIR/logs/attempt-<restart_count>/`` (bounded: the
first MB and the last ``--diagnose-max-mb`` of each file) together with the agent's failure info
(exit codes, signals, error files: strong evidence, e.g. SIGKILL means not the user's code), emits
one ``diagnosis`` event (rank = first failing rank, evidence = the diagnosis) and returns it as a
``Diagnosis`` for the policy.

A SIGKILL with a silent log is host OOM only when the kernel says so: the kernel's ``oom_kill``
counters (the workers' cgroups, else /proc/vmstat) are read when workers start and again when they
fail (probes/oom.py); the diagnosis gets the difference, so an outside ``kill -9`` reads
killed_external (not by the OOM killer), not host_oom. Live, the counters decide: the offline
reading "host RAM OOM likely" of a SIGKILL while loading (diagnose/ending.py) is not used here.
A low-confidence diagnosis says so in its event, and the policy does not stop the job on it.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainguard.evidence import Diagnosis, RankFailure
from trainguard.monitors.api import Monitor, MonitorContext
from trainguard.options import SettingsError, given, positive
from trainguard.spawn.failures import lost_peer
from trainguard.spawn.logs import attempt_dir

log = logging.getLogger(__name__)

# Categories where the job can not go on by itself: an error event. The rest are warnings.
_ERROR_CATEGORIES = {"gpu_hardware", "cuda_oom", "host_oom", "disk_full_or_io", "segfault", "python_exception",
                     "nan_loss", "cuda_error_other", "dataloader", "rendezvous_failure", "killed_external",
                     "environment"}  # fmt: skip


@dataclass(frozen=True)
class DiagnosisSettings:
    enabled: bool = True
    rules: tuple[Path, ...] = ()  # extra rules files (TOML)
    max_mb: float = 4.0  # read at most the last MB of each rank log

    @classmethod
    def from_options(cls, options: argparse.Namespace) -> DiagnosisSettings:
        if options.no_diagnose:
            return cls(enabled=False)
        return cls(rules=tuple(options.diagnose_rules or ()), **given(options, {"max_mb": "diagnose_max_mb"}))


def add_run_arguments(group: argparse._ArgumentGroup) -> None:
    group.add_argument(
        "--no-diagnose", action="store_true", help="do not diagnose the logs after a worker failure"
    )
    group.add_argument("--diagnose-rules", action="append", type=Path, default=[], metavar="FILE",
                       help="extra diagnosis rules file (TOML); repeatable")  # fmt: skip
    group.add_argument("--diagnose-max-mb", type=positive, default=None, metavar="MB",
                       help=f"read at most the last MB of each rank log when diagnosing (default {DiagnosisSettings.max_mb:g})")  # fmt: skip


def settings(options: argparse.Namespace) -> DiagnosisSettings:
    return DiagnosisSettings.from_options(options)


def create(settings: DiagnosisSettings) -> Monitor | None:
    if not settings.enabled:
        return None
    if settings.rules:  # fail at start, with the file named, rather than at the first failure
        from trainguard.diagnose.rules import RuleError, load_rules

        try:
            load_rules(list(settings.rules))
        except RuleError as exc:
            raise SettingsError(f"--diagnose-rules: {exc} (or --no-diagnose to switch diagnosis off)") from None
    return DiagnosisMonitor(list(settings.rules), int(settings.max_mb * (1 << 20)))


def _elsewhere(diagnosis: Diagnosis, failures: dict[int, RankFailure]) -> Diagnosis:
    """When this node's first failure only lost its peer (a gloo/NCCL connection closed by another
    node), the logs here show a network error, but the cause is on the node that went first (killed,
    lost, restarting on a verdict): say so instead of blaming the network."""
    first = next((f for f in failures.values() if f.first_failure), None)
    if first is None or not lost_peer(first):
        return diagnosis
    return dataclasses.replace(
        diagnosis,
        summary=f"lost a peer on another node, where the cause is (this node's logs: {diagnosis.summary})",
        fix="Look at the other nodes' events (node_lost, their diagnosis, a hang verdict): this node's "
        "ranks only lost their connection to a rank that failed or stopped first.",
        details={**diagnosis.details, "cause_elsewhere": True},
    )


def _jsonable_failures(failures: dict[int, RankFailure]) -> dict[int, dict[str, Any]]:
    """The failure info ``diagnose_paths`` reads (the agent's exact exit time orders failures best)."""
    out = {}
    for r, f in failures.items():
        out[int(r)] = {
            "local_rank": f.local_rank,
            "pid": f.pid,
            "exitcode": f.exitcode,
            "signal": f.signal,
            "error_file_data": f.error_file_data,
            "message": f.message,
            "timestamp": f.exit_time or f.timestamp,
            "first_failure": f.first_failure,
        }
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

    def diagnose(self, ctx: MonitorContext, failures: dict[int, RankFailure]) -> Diagnosis:
        from trainguard.diagnose import diagnose_paths

        logs = attempt_dir(Path(ctx.run_dir), ctx.restart_count)  # this attempt's only: never an earlier run's
        paths: list[Path] = [logs] if logs.is_dir() else []
        info = _jsonable_failures(failures)
        if not paths:  # no rank logs: the tails the agent kept are the log
            for r, i in info.items():
                if not i.get("message") and failures[r].log_tail:
                    i["message"] = "\n".join(str(x) for x in failures[r].log_tail[-20:])
        result = diagnose_paths(paths, self.rules or None, failures=info, oom=self._oom_evidence(),
                                max_bytes_per_file=self.max_bytes)  # fmt: skip
        if not paths:  # no rank logs (yet): the agent's log tails are all there is
            result["note"] = f"no rank logs under {logs}"
        result["attempt"] = ctx.restart_count
        return Diagnosis.from_dict(result)

    def on_workers_failed(self, ctx: MonitorContext, failures: dict[int, RankFailure]) -> Diagnosis:
        try:
            diagnosis = _elsewhere(self.diagnose(ctx, failures), failures)
        except Exception as exc:  # never let the diagnosis take the agent down
            log.warning("diagnosis failed: %s", exc)
            diagnosis = Diagnosis("unknown", summary=f"diagnosis failed: {exc}")
        rank = diagnosis.rank if diagnosis.rank is not None else (min(failures) if failures else None)
        severity = "error" if diagnosis.category in _ERROR_CATEGORIES else "warning"
        msg = f"{diagnosis.category}: {diagnosis.summary}"
        if diagnosis.confidence == "low":  # a lead, not a verdict: the policy does not stop the job on it
            msg += " (low confidence)"
        if diagnosis.fix:
            msg += f" — fix: {diagnosis.fix.split('. ')[0]}"
        ctx.events.emit("diagnosis", msg, severity=severity, rank=rank, evidence=diagnosis.to_dict())
        return diagnosis
