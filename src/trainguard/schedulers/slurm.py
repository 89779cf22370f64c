"""Slurm: the allocation read from ``SLURM_*`` into `trainguard run`'s rendezvous flags, and the
``scontrol`` calls that tell Slurm about an excluded node (drain, requeue without it).

Inside an allocation ``srun trainguard run --nproc-per-node 2 train.py`` needs no rendezvous flag:

- ``--nnodes``: the nodes of the step (``SLURM_STEP_NUM_NODES``, else the job's); an explicit
  ``--nnodes`` wins (``MIN:MAX`` makes a job with a spare elastic);
- ``--rdzv-backend c10d``, ``--rdzv-endpoint``: the first host of the step's node list (Slurm
  hostlist syntax), port 29400 + job id mod 500 so that two jobs sharing a node do not collide;
  the agent on that host serves the rendezvous store (``is_host``), whatever its hostname says;
- ``--rdzv-id``: ``slurm-<job>.<step>`` (``.r<n>`` after the n-th requeue);
- ``--standby-nodes N``: the last N nodes of the step run as warm standbys (``--standby``) and
  ``--nnodes`` (when not given) counts the others;
- ``--node-name``: ``SLURMD_NODENAME``; the run dir: ``trainguard-runs/slurm-<job>``, the same for
  every node and for the requeued job, which finds its checkpoints there.

Every call is an argv list (never a shell string): node names and reasons are data.
"""

from __future__ import annotations

import argparse
import logging
import re
import shutil
import subprocess
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from trainguard.options import SettingsError, node_name_problem
from trainguard.schedulers import hostlist

log = logging.getLogger(__name__)

PORT_BASE = 29400  # c10d's usual port; + job id mod PORT_SPREAD (below the ephemeral range)
PORT_SPREAD = 500
REASON_MAX = 200  # Slurm keeps reasons short in sinfo -R; the event holds the full text

Runner = Callable[..., subprocess.CompletedProcess]


@dataclass(frozen=True)
class SlurmJob:
    job_id: str  # "1234", or "1234_7" for an array task
    step_id: str | None  # None in the batch script itself
    nodes: list[str]  # hosts of the step (else of the job), first one hosts the rendezvous
    nnodes: int
    node_name: str | None  # SLURMD_NODENAME
    restart_count: int  # SLURM_RESTART_COUNT: times the job was requeued

    @property
    def first_host(self) -> str:
        return self.nodes[0]

    @property
    def port(self) -> int:
        digits = re.sub(r"\D", "", self.job_id) or "0"
        return PORT_BASE + int(digits[-9:]) % PORT_SPREAD

    @property
    def rdzv_id(self) -> str:
        rid = f"slurm-{self.job_id}.{self.step_id if self.step_id is not None else 'batch'}"
        return rid + (f".r{self.restart_count}" if self.restart_count else "")

    @property
    def run_name(self) -> str:
        return f"slurm-{self.job_id}"


def _int(env: Mapping[str, str], *names: str) -> int | None:
    for name in names:
        value = env.get(name, "").strip()
        m = re.match(r"\d+", value)  # SLURM_JOB_NUM_NODES is plain; be lenient with "2(x3)" forms
        if m:
            return int(m.group())
    return None


def detect(env: Mapping[str, str], expand: Callable[[str], list[str]] = hostlist.expand) -> SlurmJob | None:
    """The Slurm job this process runs in, or None outside Slurm (no SLURM_JOB_ID)."""
    job = env.get("SLURM_JOB_ID", "").strip() or env.get("SLURM_JOBID", "").strip()
    if not job:
        return None
    if env.get("SLURM_ARRAY_JOB_ID") and env.get("SLURM_ARRAY_TASK_ID"):
        job = f"{env['SLURM_ARRAY_JOB_ID']}_{env['SLURM_ARRAY_TASK_ID']}"
    step = env.get("SLURM_STEP_ID", "").strip() or env.get("SLURM_STEPID", "").strip() or None
    in_step = step is not None and env.get("SLURM_STEP_NODELIST")
    listed = (env.get("SLURM_STEP_NODELIST") if in_step else None) or env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST") or ""
    nodes = expand(listed) if listed.strip() else []
    nnodes = (_int(env, "SLURM_STEP_NUM_NODES") if in_step else None) or _int(env, "SLURM_JOB_NUM_NODES", "SLURM_NNODES") or len(nodes) or 1
    node = env.get("SLURMD_NODENAME", "").strip() or None
    if not nodes:
        nodes = [node or "localhost"]
    return SlurmJob(job, step, nodes, nnodes, node, _int(env, "SLURM_RESTART_COUNT") or 0)


def _has_is_host(rdzv_conf: str) -> bool:
    return any(kv.split("=", 1)[0].strip() == "is_host" for kv in (rdzv_conf or "").split(",") if kv.strip())


def apply(args: argparse.Namespace, job: SlurmJob) -> list[str]:
    """Fill the flags the user left at their defaults from the allocation. Returns what was set
    (``["--nnodes 2", ...]``) for the launch's log line."""
    done: list[str] = []

    def put(name: str, value: str, flag: str) -> None:
        setattr(args, name, value)
        done.append(f"{flag} {value}")

    if args.node_name is None and job.node_name:
        put("node_name", job.node_name, "--node-name")
    if args.job_id is None and args.run_dir is None:
        put("job_id", job.run_name, "--job-id")
    if getattr(args, "standby_nodes", 0):  # consumed here: what the settings see is each node's --standby
        nnodes, args.standby = standby_role(args.standby_nodes, str(args.nnodes), job)
        args.standby_nodes = 0
        if nnodes != str(args.nnodes):
            put("nnodes", nnodes, "--nnodes")
        done += ["--standby"] if args.standby else []
    if args.standalone:
        return done  # the user asked for a single-node rendezvous of its own
    if str(args.nnodes) == "1:1":  # torchrun's default: not given
        put("nnodes", str(job.nnodes), "--nnodes")
    if args.rdzv_id == "none":
        put("rdzv_id", job.rdzv_id, "--rdzv-id")
    endpoint_given = bool(args.rdzv_endpoint) or args.rdzv_backend != "static" or args.master_port is not None
    if not endpoint_given and job.nnodes > 1:
        if problem := node_name_problem(job.first_host):  # torch would refuse it as the host, with a traceback
            raise SettingsError(f"cannot read the Slurm allocation's node list: {problem}")
        args.rdzv_backend = "c10d"
        put("rdzv_endpoint", f"{job.first_host}:{job.port}", "--rdzv-backend c10d --rdzv-endpoint")
        if job.node_name and not _has_is_host(args.rdzv_conf):
            # Slurm node names need not be hostnames: say who serves the store instead of letting
            # torch guess from the hostname (on loopback test clusters, every node guesses wrong).
            is_host = "true" if job.node_name == job.first_host else "false"
            conf = f"{args.rdzv_conf},is_host={is_host}" if args.rdzv_conf else f"is_host={is_host}"
            put("rdzv_conf", conf, "--rdzv-conf")
    return done


def standby_role(n: int, nnodes: str, job: SlurmJob) -> tuple[str, bool]:
    """--standby-nodes N: (--nnodes, whether this node is a standby). The last N nodes of the step
    are warm standbys (``--standby``, agent/standby.py), the others train; --nnodes left unset
    ("1:1") becomes the others' count. The first host (it serves the rendezvous store) trains."""
    active = job.nnodes - n
    if active < 1:
        raise SettingsError(f"--standby-nodes {n}: the step has {job.nnodes} node(s), none would be left to train")
    if job.node_name not in job.nodes:
        raise SettingsError(f"--standby-nodes: this node ({job.node_name}) is not in the step's node list; give --standby "
                            "on the standby nodes instead")
    return (str(active) if nnodes == "1:1" else nnodes), job.nodes.index(job.node_name) >= active


# ---------------------------------------------------------------------------------- scontrol


@dataclass(frozen=True)
class Outcome:
    ok: bool
    detail: str  # scontrol's own words (stderr/stdout), one line


def _scontrol(argv: list[str], run: Runner, timeout: float = 30.0) -> Outcome:
    exe = shutil.which("scontrol")
    if exe is None:
        return Outcome(False, "scontrol not found on PATH")
    try:
        res = run([exe, *argv], capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.SubprocessError) as exc:
        return Outcome(False, str(exc))
    text = " ".join((res.stderr or res.stdout or "").split())
    return Outcome(res.returncode == 0, text or f"exit {res.returncode}")


def drain_argv(node: str, reason: str) -> list[str]:
    reason = " ".join(f"trainguard: {reason}".split())
    if len(reason) > REASON_MAX:
        reason = reason[: REASON_MAX - 3] + "..."
    return ["update", f"NodeName={node}", "State=DRAIN", f"Reason={reason}"]


def drain(node: str, reason: str, run: Runner = subprocess.run) -> Outcome:
    return _scontrol(drain_argv(node, reason), run)


def requeue(job_id: str, exclude: list[str], run: Runner = subprocess.run) -> Outcome:
    """Requeue the job; with ``exclude``, held first so its excluded nodes can be set while it is
    pending (Slurm refuses ExcNodeList on a running job), then released."""
    if not exclude:
        return _scontrol(["requeue", job_id], run)
    steps = [
        ["requeuehold", job_id],
        ["update", f"JobId={job_id}", f"ExcNodeList={','.join(exclude)}"],
        ["release", job_id],
    ]
    for argv in steps:
        out = _scontrol(argv, run)
        if not out.ok:
            return Outcome(False, f"scontrol {argv[0]}: {out.detail}")
    return Outcome(True, f"requeued job {job_id} excluding {','.join(exclude)}")


def _show_job(job_id: str, name: str, run: Runner) -> str | None:
    """One field of ``scontrol show job -o``; None when Slurm cannot say (no scontrol, no answer)."""
    exe = shutil.which("scontrol")
    if exe is None:
        return None
    try:
        res = run([exe, "show", "job", "-o", job_id], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    m = re.search(rf"\b{name}=(\S+)", res.stdout or "")
    return m.group(1) if m and res.returncode == 0 else None


def job_state(job_id: str, run: Runner = subprocess.run) -> str | None:
    """The job's ``JobState`` (RUNNING, COMPLETING, PENDING after a requeue, ...); None when Slurm
    cannot say."""
    return _show_job(job_id, "JobState", run)


def batch_script(job_id: str, run: Runner = subprocess.run) -> str | None:
    """The job's batch script path (``Command=`` of ``scontrol show job``), for the resubmit line."""
    command = _show_job(job_id, "Command", run)
    return None if command == "(null)" else command
