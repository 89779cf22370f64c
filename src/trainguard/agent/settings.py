"""`trainguard run`'s options as ONE typed, validated object, built once from the parsed command
line (``RunSettings.from_args``, called by agent/cli.py right after argparse).

Every check that can refuse the command happens here, before anything starts: a problem is one
line (``SettingsError``), the command exits EXIT_USAGE. The rooms below get only their part:

- ``launch``: what agent/launch.py itself needs (run dir, node names, notifications, the target...);
- ``policy``: ``PolicySettings`` for policy.py;
- ``monitors``: each monitor's own settings object, by monitor name (monitors/plugins.py);
- ``scheduler``: ``SchedulerSettings`` (flags and the Slurm allocation found) for schedulers/;
- ``torchrun``: torchrun's own parsed flags, for torch's ``config_from_args`` only (see ``TorchRun``).

A new flag is: its argparse line, a field in its room's dataclass, one line in that dataclass's
builder (``from_options``, called from here only).
"""

from __future__ import annotations

import argparse
import itertools
import os
import secrets
import shutil
import socket
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

import torch
from torch.distributed.elastic.multiprocessing.api import Std
from torch.distributed.elastic.utils import macros
from torch.distributed.run import get_use_env, parse_min_max_nnodes

from trainguard.agent.node_names import default_names
from trainguard.cluster.node_history import HistorySettings
from trainguard.events import Severity
from trainguard.events.notify import bad_urls, urls_from_env
from trainguard.monitors import plugins
from trainguard.options import SettingsError, node_name_problem
from trainguard.policy import PolicySettings
from trainguard.probes import nvml
from trainguard.schedulers import adapter as scheduler
from trainguard.schedulers import environment as rendezvous_env
from trainguard.schedulers import kubernetes
from trainguard.spawn.pcontext import Target


@dataclass(frozen=True)
class LaunchSettings:
    """What the launch itself follows (agent/launch.py)."""

    run_dir: Path  # absolute; made and checked writable by the launch
    node_names: tuple[str, ...]  # the names this node may take, first free one wins
    notify: tuple[str, ...]  # --notify URLs, then TRAINGUARD_NOTIFY's
    notify_severity: Severity
    prestart: str  # --prestart-workers: on, spawn, off (off for --no-python)
    stop_timeout: float  # --worker-stop-timeout
    exit_barrier_timeout: float
    hold_on_failure: float | None  # minutes
    target: Target
    script_args: tuple[str, ...]  # the script's args (with --local-rank in torchrun's --no-use-env mode)
    tee_ranks: frozenset[int] | None  # local ranks echoed to the console; None: all
    node_history: HistorySettings = HistorySettings()  # the site's node history (cluster/node_history.py)
    standby: bool = False  # --standby: this agent waits beside the job and replaces a lost node (agent/standby.py)
    node_name_given: bool = True  # --node-name (or the scheduler's); False: a default the round may change (agent/node_names.py)


@dataclass(frozen=True)
class TorchRun:
    """torchrun's parsed flags, kept as torch's argparse.Namespace for ONE reason: torch's own
    ``config_from_args`` (which turns ~30 torchrun flags into its LaunchConfig, with torch's
    defaults and checks) reads them from that Namespace; copying them into fields here would fork
    torch's parser. Nothing else reads ``args``. Its defaults for a single-node job are set once,
    here (``_torchrun_defaults``)."""

    args: argparse.Namespace
    single: bool  # one node on loopback: its stores listen on 127.0.0.1 only
    torch_files: bool  # the user asked for torchrun's own per-rank files (--log-dir, --redirects, --tee)
    fresh_run_id: bool  # --rdzv-id left at torchrun's "none" (without --standalone): a new uuid


@dataclass(frozen=True)
class RunSettings:
    launch: LaunchSettings
    policy: PolicySettings
    monitors: Mapping[str, Any]  # monitor name -> its settings object (plugins.read_settings)
    scheduler: scheduler.SchedulerSettings
    torchrun: TorchRun

    @classmethod
    def from_args(cls, args: argparse.Namespace, env: Mapping[str, str] = os.environ) -> RunSettings:
        """Check and type everything; raises SettingsError (one line). ``args`` is torchrun's and
        trainguard's parsed flags: the Slurm allocation fills the flags left unset first, then each
        room reads its part, then torchrun's own defaults are set for torch."""
        problem = _flag_problem(args)
        if problem:
            raise SettingsError(problem)
        job = scheduler.autodetect(args, env)  # fills --nnodes, --node-name... before anything reads them
        sources = _from_environment(args, env)  # the rendezvous and restart budget the job's environment gives
        if problem := _nodes_problem(args):  # the allocation's or the environment's count, as torch will read it
            raise SettingsError(problem)
        sched = scheduler.SchedulerSettings.from_options(args, job, sources)
        monitors = MappingProxyType(plugins.read_settings(args))  # read-only, like the rest
        launch = _launch_settings(args)
        policy = PolicySettings.from_options(args)
        checks = monitors.get("checks")
        torch_args = _gpu_placeholder(args, bool(getattr(checks, "refuses_gpu_less_node", False)))
        return cls(launch, policy, monitors, sched, _torchrun_defaults(torch_args))


def _gpu_placeholder(args: argparse.Namespace, refused_by_precheck: bool) -> argparse.Namespace:
    """torchrun's flags, with ``--nproc-per-node gpu`` taken as 1 on a node where neither CUDA nor
    NVML sees a GPU and the pre-check's gpu-check will refuse the node before any worker starts:
    the job then gets the seed's "The node is down." with the item line (and the others go on
    without this node), not torch's usage error "Cuda is not available."."""
    if not refused_by_precheck or str(args.nproc_per_node).strip() != "gpu":
        return args
    if torch.cuda.is_available() or nvml.health():
        return args
    return argparse.Namespace(**{**vars(args), "nproc_per_node": "1"})


def _from_environment(args: argparse.Namespace, env: Mapping[str, str]) -> tuple[str, ...]:
    """Fill the rendezvous flags (none given) and --max-restarts (not given) from the job's
    environment; the lines that say so on the console."""
    lines = [rendezvous_env.apply(args, env)]
    if args.max_restarts is None:
        args.max_restarts, where = kubernetes.restart_budget(env)
        lines.append(f"restart budget {args.max_restarts} from the pod annotation {where}" if where else None)
    return tuple(line for line in lines if line)


# Bounds on numbers torch's parser takes as they come: past them a launch hangs making names or
# processes, or fails with a traceback deep in torch (an OverflowError in a sleep, a timedelta).
MAX_NODES = 100_000
MAX_NPROC_PER_NODE = 4096
MAX_MONITOR_INTERVAL_S = 86_400.0
MAX_RDZV_INT = 2**31 - 1
# torch's rendezvous options read as integers (RendezvousParameters.get_as_int), and as a boolean
RDZV_INT_OPTIONS = ("join_timeout", "last_call_timeout", "close_timeout", "heartbeat_timeout", "timeout",
                    "read_timeout", "keep_alive_interval", "keep_alive_max_attempt")
RDZV_BOOLS = ("1", "0", "true", "false", "yes", "no", "y", "n", "on", "off")


def _flag_problem(args: argparse.Namespace) -> str | None:
    """A clear message for input torch's parser lets through."""
    problem = _target_problem(args) or _nodes_problem(args)
    if problem:
        return problem
    nproc = str(args.nproc_per_node).strip()
    if nproc.lstrip("-").isdigit() and not 1 <= int(nproc) <= MAX_NPROC_PER_NODE:
        return f"--nproc-per-node must be at least 1 and at most {MAX_NPROC_PER_NODE} (or auto, gpu, cpu), got {nproc}"
    if not (0 < args.monitor_interval <= MAX_MONITOR_INTERVAL_S):  # NaN fails both comparisons
        return f"--monitor-interval must be a number of seconds > 0 and <= {MAX_MONITOR_INTERVAL_S:g}, got {args.monitor_interval}"
    if args.master_port is not None and not 0 <= args.master_port <= 65535:
        return f"--master-port must be a port number 0 to 65535, got {args.master_port}"
    if args.run_dir is not None and not str(args.run_dir).strip():
        return "--run-dir must name a directory, got an empty string"
    try:
        Severity.parse(args.notify_severity)
    except ValueError as exc:
        return f"--notify-severity: {exc}"
    return _rdzv_conf_problem(args.rdzv_conf) or _std_problem(args)


def _target_problem(args: argparse.Namespace) -> str | None:
    """What the workers would run does not exist, or is not what its flag says."""
    target = args.training_script
    if args.module:
        if not all(part.isidentifier() for part in target.split(".")):
            return f"-m {target!r}: expected a module name (dotted Python identifiers)"
    elif args.no_python:
        found = target if os.sep in target else shutil.which(target)
        if not found or not os.path.isfile(found) or not os.access(found, os.X_OK):
            return f"--no-python: {target!r} is not an executable file" + ("" if os.sep in target else " on PATH")
    elif not os.path.isfile(target):
        return f"training script not found: {target}"
    return None


def _nodes_problem(args: argparse.Namespace) -> str | None:
    """--nnodes (or the Slurm allocation's count, once applied) as torch reads it, within bounds."""
    try:
        max_nodes = parse_min_max_nnodes(args.nnodes)[1]
    except (RuntimeError, ValueError):
        return f"--nnodes {args.nnodes!r}: expected a number of nodes N or MIN:MAX"
    if max_nodes > MAX_NODES:
        return f"--nnodes {args.nnodes!r}: at most {MAX_NODES} nodes"
    return None


def _rdzv_conf_problem(conf: str) -> str | None:
    """torch reads --rdzv-conf (``KEY=VALUE,...``) only when it builds the rendezvous, and then
    fails with a traceback on a malformed item or a number that is not one."""
    for item in conf.split(",") if (conf or "").strip() else []:
        key, sep, value = (x.strip() for x in item.partition("="))
        if not sep or not key or not value:
            return f"--rdzv-conf {conf!r}: expected KEY=VALUE items separated by commas, got {item!r}"
        if key in RDZV_INT_OPTIONS and not (value.isdigit() and 0 < int(value) <= MAX_RDZV_INT):
            return f"--rdzv-conf {key}={value!r}: expected a whole number > 0 and <= {MAX_RDZV_INT}"
        if key == "is_host" and value.lower() not in RDZV_BOOLS:
            return f"--rdzv-conf is_host={value!r}: expected true or false"
    return None


def _std_problem(args: argparse.Namespace) -> str | None:
    """torch reads --redirects/--tee only when it builds its config, and then fails with a traceback."""
    for flag, value in (("--redirects", args.redirects), ("--tee", args.tee)):
        try:
            Std.from_str(str(value))
        except ValueError:
            return (f"{flag} {value!r}: expected 0-3 (0 none, 1 stdout, 2 stderr, 3 both) or per local rank "
                    "as 0:1,1:3")
    return None


def _launch_settings(args: argparse.Namespace) -> LaunchSettings:
    notify = tuple((args.notify or []) + urls_from_env())
    bad = bad_urls(list(notify))
    if bad:  # said now, not at the first failure a job has hours later
        raise SettingsError(f"notification URL not understood: {bad[0]} (see https://github.com/caronc/apprise)")
    names = _node_names(args)
    if problem := node_name_problem(names[0]):  # a name from the scheduler or the hostname: checked like --node-name
        raise SettingsError(f"node name {problem}; give --node-name")
    # torchrun passes the script's own args, plus --local-rank only in its legacy --no-use-env mode.
    script_args = list(args.training_script_args)
    if not get_use_env(args):
        script_args.insert(0, f"--local-rank={macros.local_rank}")
    tee = None if not args.quiet else frozenset()
    if args.local_ranks_filter:
        tee = frozenset(int(r) for r in args.local_ranks_filter.split(","))
    return LaunchSettings(
        run_dir=Path(args.run_dir or Path("trainguard-runs") / _job_id(args)).absolute(),
        node_names=tuple(names),
        node_name_given=bool(args.node_name),
        notify=notify,
        notify_severity=Severity.parse(args.notify_severity),
        # Spares only for Python workers (a --no-python binary starts its own interpreter, if any).
        prestart="off" if args.no_python else args.prestart_workers,
        stop_timeout=args.worker_stop_timeout,
        exit_barrier_timeout=args.exit_barrier_timeout,
        hold_on_failure=args.hold_on_failure,
        target=_target(args),
        script_args=tuple(script_args),
        tee_ranks=tee,
        node_history=HistorySettings.from_options(args),
        standby=_standby(args),
    )


def _standby(args: argparse.Namespace) -> bool:
    """--standby: only where torch's rendezvous can keep a node waiting beyond --nnodes MAX.
    (--standby-nodes is the Slurm adapter's: inside a step it became each node's --standby.)"""
    if getattr(args, "standby_nodes", 0):
        raise SettingsError("--standby-nodes picks the standby nodes of a Slurm step; outside one, start each "
                            "standby node's agent with --standby")
    if not args.standby:
        return False
    if args.standalone:
        raise SettingsError("--standby joins another agent's rendezvous: not with --standalone")
    if args.rdzv_backend != "c10d":
        raise SettingsError(f"--standby needs the c10d rendezvous (--rdzv-backend c10d), got {args.rdzv_backend}")
    return True


def _job_id(args: argparse.Namespace) -> str:
    if args.job_id:
        return args.job_id
    if args.rdzv_id and args.rdzv_id != "none":
        return args.rdzv_id
    return time.strftime("%Y%m%d-%H%M%S") + "-" + secrets.token_hex(2)


def _node_names(args: argparse.Namespace) -> list[str]:
    """The names this node may take on its run dir, first free one wins: --node-name, else the
    host name; for a multi-node job without --node-name also ``<host>-2``, ``<host>-3``... so that
    several agents of one job on one host (torchrun allows it: each is a node) sharing a run dir
    get distinct names and locks (with a run dir each, the first round tells them apart:
    agent/node_names.py). A single-node job keeps one name: a second one on its run dir is a
    mistake, refused."""
    if args.node_name:
        return [args.node_name]
    host = socket.gethostname()
    max_nodes = parse_min_max_nnodes(args.nnodes)[1]  # checked in _flag_problem; Slurm's is a number
    return [host, *itertools.islice(default_names(host), 1, max_nodes)]


def _target(args: argparse.Namespace) -> Target:
    if args.no_python:
        return Target(binary=args.training_script)
    if args.module:
        return Target(module=args.training_script)
    return Target(script=os.path.abspath(args.training_script))


def _with_join_timeout(rdzv_conf: str, minutes: float | None) -> str:
    """--rdzv-wait-minutes as torch's join_timeout (how long a node waits in the rendezvous for its
    peers), unless --rdzv-conf sets join_timeout itself."""
    keys = {kv.split("=", 1)[0].strip() for kv in (rdzv_conf or "").split(",") if kv.strip()}
    if minutes is None or "join_timeout" in keys:
        return rdzv_conf
    timeout = f"join_timeout={max(1, round(minutes * 60))}"
    return f"{rdzv_conf},{timeout}" if rdzv_conf else timeout


def _torchrun_defaults(args: argparse.Namespace) -> TorchRun:
    """The one place torchrun's flags are changed after parsing, as torchrun's run() does: a
    --standalone (or static single-node) job gets a c10d rendezvous on localhost:0, the master port
    its default, and --log-dir os.devnull when torchrun's own per-rank files are not wanted (torch's
    specs then make no torchelastic_* directory in $TMPDIR). Last: the rooms above read the flags
    as the user (or Slurm) gave them."""
    fresh_run_id = args.rdzv_id == "none" and not args.standalone
    single = False
    if args.standalone:
        args.rdzv_backend, args.rdzv_endpoint, args.rdzv_id = "c10d", "localhost:0", str(uuid.uuid4())
        single = True
    elif args.rdzv_backend == "static" and not args.rdzv_endpoint and args.master_port is None:
        if parse_min_max_nnodes(args.nnodes)[1] == 1:
            args.rdzv_backend, args.rdzv_endpoint, args.rdzv_id = "c10d", "localhost:0", str(uuid.uuid4())
            single = True
    if args.master_port is None:
        args.master_port = 29500
    if not single:
        args.rdzv_conf = _with_join_timeout(args.rdzv_conf, getattr(args, "rdzv_wait_minutes", None))
    torch_files = bool(args.log_dir) or Std.from_str(args.redirects) != Std.NONE or Std.from_str(args.tee) != Std.NONE
    if not torch_files:
        args.log_dir = os.devnull
    return TorchRun(args, single, torch_files, fresh_run_id)
