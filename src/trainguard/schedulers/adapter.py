"""What `trainguard run` does for the scheduler: its flags, autodetect before the launch, and the
calls when this node is excluded, when the job is preempted, and when the run ends.

- Excluded: the node joins ``RUN_DIR/exclude-nodes`` (one name a line) and the resubmit line
  ``sbatch --exclude=...`` is printed; ``--slurm-drain`` drains it (one line when not permitted);
  ``--on-exclude CMD`` runs CMD (split like a shell would, run without one) with
  ``TRAINGUARD_EXCLUDED_NODE``, ``TRAINGUARD_EXCLUDE_REASON`` and ``TRAINGUARD_RUN_DIR`` set;
  ``--requeue``: when the nodes left are fewer than the job's minimum, Slurm requeues it without
  the excluded nodes.
- Preempted (SIGTERM, or SIGUSR1 from ``sbatch --signal=USR1@N``): ``job_preempted`` is recorded;
  the agent's shutdown persists the newest in-memory snapshots; with ``--requeue`` a SIGUSR1 makes
  the node that serves the rendezvous requeue the job once they are on disk.
- End: the one-line verdict goes to the termination log (Kubernetes).
"""

from __future__ import annotations

import argparse
import logging
import os
import shlex
import signal
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainguard.options import SettingsError, node_name_problem, non_negative_int
from trainguard.schedulers import hostlist, kubernetes, slurm

log = logging.getLogger("trainguard")

EXCLUDE_FILE = "exclude-nodes"
ENV_NODE, ENV_REASON, ENV_RUN_DIR = "TRAINGUARD_EXCLUDED_NODE", "TRAINGUARD_EXCLUDE_REASON", "TRAINGUARD_RUN_DIR"
HOOK_TIMEOUT_S = 60.0
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1)


def _argv(text: str) -> list[str]:
    try:
        argv = shlex.split(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"cannot split {text!r} into arguments: {exc}") from None
    if not argv:
        raise argparse.ArgumentTypeError("expected a command, got an empty string")
    return argv


def add_run_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("scheduler")
    g.add_argument("--no-slurm", action="store_true",
                   help="ignore SLURM_* (default: inside a Slurm job, nnodes, rendezvous, node name and run dir "
                        "come from the allocation unless given)")
    g.add_argument("--slurm-drain", action="store_true",
                   help="drain a node trainguard excludes (scontrol update State=DRAIN Reason='trainguard: ...')")
    g.add_argument("--requeue", action="store_true",
                   help="Slurm: requeue the job without the excluded node when too few nodes are left; "
                        "on SIGUSR1 (sbatch --signal=USR1@N) requeue after the snapshot is on disk")
    g.add_argument("--standby-nodes", type=non_negative_int, default=0, metavar="N",
                   help="Slurm: the last N nodes of the step wait as warm standby nodes (as --standby) and the "
                   "others train (--nnodes, when not given, is the others' count): a lost node's place goes to a "
                   "standby, the world size stays")
    g.add_argument("--on-exclude", type=_argv, default=None, metavar="CMD",
                   help="run CMD when this node is excluded (no shell; env TRAINGUARD_EXCLUDED_NODE, "
                        "TRAINGUARD_EXCLUDE_REASON, TRAINGUARD_RUN_DIR)")


def autodetect(args: argparse.Namespace, env: Any = os.environ) -> slurm.SlurmJob | None:
    """Fill `trainguard run`'s flags from the Slurm allocation (before anything starts): a step
    of the run's settings builder (agent/settings.py), before the rooms read their flags."""
    if getattr(args, "no_slurm", False):
        return None
    try:
        job = slurm.detect(env)
    except hostlist.HostlistError as exc:  # a malformed allocation: one line and exit 2, nothing started
        raise SettingsError(f"cannot read the Slurm allocation's node list: {exc}") from None
    if job is None:
        return None
    args.slurm_applied = slurm.apply(args, job)
    return job


@dataclass(frozen=True)
class SchedulerSettings:
    """The scheduler's part of `trainguard run`'s settings: its flags and the allocation found."""

    drain: bool = False  # --slurm-drain
    requeue: bool = False  # --requeue
    on_exclude: tuple[str, ...] | None = None  # --on-exclude CMD, split into its words
    job: slurm.SlurmJob | None = None  # the Slurm allocation (``autodetect``), None outside one or with --no-slurm
    applied: tuple[str, ...] = ()  # the flags the allocation filled, for the launch's log line

    @classmethod
    def from_options(cls, args: argparse.Namespace, job: slurm.SlurmJob | None = None) -> SchedulerSettings:
        on_exclude = getattr(args, "on_exclude", None)
        return cls(bool(getattr(args, "slurm_drain", False)), bool(getattr(args, "requeue", False)),
                   tuple(on_exclude) if on_exclude else None, job, tuple(getattr(args, "slurm_applied", ())))


def describe(settings: SchedulerSettings) -> None:
    """The launch's log line about the allocation (once logging is set up)."""
    job = settings.job
    if job is not None:
        applied = "; ".join(settings.applied) or "all rendezvous flags given"
        log.info("slurm job %s step %s on %d node(s): %s", job.job_id, job.step_id or "batch", job.nnodes, applied)


@dataclass
class Scheduler:
    """One per launch: the scheduler side of exclusion, preemption and the run's end."""

    run_dir: Path
    emit: Any  # EventBus.emit
    job: slurm.SlurmJob | None = None
    drain: bool = False
    requeue_on_shortfall: bool = False
    on_exclude: list[str] | None = None
    runner: Any = subprocess.run
    _requeue: list[str] | None = None  # set when the run's end must requeue the job (exclusions)

    @classmethod
    def from_settings(cls, settings: SchedulerSettings, run_dir: Path, emit: Any) -> Scheduler:
        on_exclude = list(settings.on_exclude) if settings.on_exclude else None
        return cls(run_dir, emit, settings.job, settings.drain, settings.requeue, on_exclude)

    # ---- exclusion ------------------------------------------------------------------------------
    def excluded_nodes(self) -> list[str]:
        """The names in the exclude file: one a line; a line that is not a node name (damaged, or
        edited by hand) is skipped, never split into other names."""
        try:
            lines = (self.run_dir / EXCLUDE_FILE).read_text(errors="replace").splitlines()
        except (OSError, ValueError):
            return []
        names = [ln.strip() for ln in lines if ln.strip()]
        bad = [n for n in names if node_name_problem(n)]
        if bad:
            log.warning("trainguard: ignoring %d line(s) of %s that are not node names: %s", len(bad),
                        self.run_dir / EXCLUDE_FILE, ", ".join(map(repr, bad[:3])))
        return list(dict.fromkeys(n for n in names if not node_name_problem(n)))

    def _remember(self, node: str) -> list[str]:
        nodes = self.excluded_nodes()
        if node_name_problem(node):  # refused at the parser; never written where Slurm lists are made from it
            return nodes
        if node not in nodes:
            with open(self.run_dir / EXCLUDE_FILE, "a") as f:  # O_APPEND: nodes sharing the run dir
                f.write(node + "\n")
            nodes.append(node)
        return nodes

    def resubmit_line(self, nodes: list[str]) -> str:
        script = slurm.batch_script(self.job.job_id, self.runner) if self.job else None
        return f"sbatch {shlex.quote('--exclude=' + ','.join(nodes))} {shlex.quote(script) if script else '<your batch script>'}"

    def on_excluded(self, node: str, reason: str, nodes_left: int | None, min_nodes: int | None) -> None:
        nodes = self._remember(node)
        if self.job is not None or self.drain:
            line = self.resubmit_line(nodes)
            listed = "added to" if node in nodes else "not a node name, not added to"
            print(f"trainguard: {node} {listed} {self.run_dir / EXCLUDE_FILE}; to resubmit without it: {line}", flush=True)
        else:
            line = ""
        evidence: dict[str, Any] = {"node": node, "reason": reason, "exclude_list": nodes, "resubmit": line}
        if self.drain and (problem := node_name_problem(node)):
            print(f"trainguard: not draining: {problem}", flush=True)
        elif self.drain:
            out = slurm.drain(node, reason, self.runner)
            evidence["drained"] = out.ok
            if out.ok:
                self.emit("node_drained", f"drained {node} in Slurm: trainguard: {reason}", severity="warning", evidence=evidence)
            else:
                print(f"trainguard: could not drain {node} ({out.detail}); it stays in the exclude list", flush=True)
                self.emit("node_drain_failed", f"could not drain {node}: {out.detail}", severity="warning", evidence={**evidence, "error": out.detail})
        if self.on_exclude:
            self._run_hook(node, reason)
        if self.requeue_on_shortfall and self.job is not None and nodes_left is not None and min_nodes is not None and nodes_left < min_nodes:
            self._requeue = nodes

    def _run_hook(self, node: str, reason: str) -> None:
        env = {**os.environ, ENV_NODE: node, ENV_REASON: reason, ENV_RUN_DIR: str(self.run_dir)}
        argv = list(self.on_exclude or [])
        try:
            res = self.runner(argv, env=env, capture_output=True, text=True, timeout=HOOK_TIMEOUT_S)
            ok, detail = res.returncode == 0, " ".join((res.stderr or res.stdout or "").split())[:300]
            code: int | str = res.returncode
        except (OSError, subprocess.SubprocessError) as exc:
            ok, detail, code = False, str(exc), "error"
        self.emit("exclude_hook", f"--on-exclude {argv[0]}: {'ok' if ok else f'failed ({code})'}",
                  severity="info" if ok else "warning", evidence={"argv": argv, "exit": code, "output": detail})

    # ---- preemption -----------------------------------------------------------------------------
    def on_preempted(self, signum: int, node: str) -> None:
        name = signal.Signals(signum).name
        # One node asks: the one serving the rendezvous (all of them got the signal).
        first = self.job is not None and self.job.node_name in (None, self.job.first_host)
        requeue = self.requeue_on_shortfall and first and signum == signal.SIGUSR1
        self.emit("job_preempted", f"{name}: persisting the newest snapshots and exiting"
                  + ("; the job will be requeued" if requeue else ""), severity="warning",
                  evidence={"signal": name, "node": node, "requeue": requeue,
                            "slurm_job": self.job.job_id if self.job else None})
        if requeue:
            self._requeue = self.excluded_nodes()

    # ---- the end --------------------------------------------------------------------------------
    def finish(self, code: int, message: str) -> None:
        """After the agent closed (snapshots persisted): requeue when asked, write the verdict."""
        kubernetes.write_verdict(code, message, kubernetes.termination_log_path())
        if self._requeue is None or self.job is None:
            return
        # requeue(hold) ends this very step with SIGTERM: ignore it until the job is released.
        for sig in STOP_SIGNALS:
            signal.signal(sig, signal.SIG_IGN)
        out = slurm.requeue(self.job.job_id, self._requeue, self.runner)
        self.emit("job_requeued" if out.ok else "job_requeue_failed", f"slurm: {out.detail}",
                  severity="warning" if out.ok else "error", evidence={"exclude": self._requeue, "ok": out.ok})
        print(f"trainguard: {'requeued' if out.ok else 'could not requeue'} slurm job {self.job.job_id}: {out.detail}", flush=True)
