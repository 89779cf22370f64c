"""Assemble and run one node's agent: config, run dir, events, monitors, pool."""

from __future__ import annotations

import argparse
import ipaddress
import logging
import os
import secrets
import signal
import socket
import sqlite3
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from torch.distributed.elastic.agent.server.api import WorkerSpec, WorkerState
from torch.distributed.elastic.multiprocessing.api import SignalException, Std
from torch.distributed.elastic.rendezvous import RendezvousConnectionError, RendezvousParameters
from torch.distributed.elastic.rendezvous import registry as rdzv_registry
from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint
from torch.distributed.elastic.utils import macros
from torch.distributed.launcher.api import LaunchConfig
from torch.distributed.run import config_from_args, get_use_env, parse_min_max_nnodes

from trainguard import stopsignal
from trainguard.agent import console, hold, runlock
from trainguard.agent.elastic import JobStopped, NodeExcluded, NodesUnreachable, TrainguardAgent
from trainguard.cluster import keeper
from trainguard.cluster.stores import JobKey, address_toward, bound_store, is_loopback, reaches_loopback
from trainguard.events import EventBus, EventStore, Severity
from trainguard.events.notify import Notifier, bad_urls, urls_from_env
from trainguard.events.store import node_db_path
from trainguard.exitcodes import EXIT_EXCLUDED, EXIT_FAILED, EXIT_NODE_FAULT, EXIT_OK, EXIT_USAGE, signal_exit
from trainguard.monitors import plugins
from trainguard.options import node_name_problem
from trainguard.policy import Decision, PolicySettings
from trainguard.schedulers import adapter as scheduler
from trainguard.schedulers import slurm
from trainguard.spawn import logs
from trainguard.spawn.pcontext import Target
from trainguard.spawn.pool import WorkerPool

log = logging.getLogger("trainguard")


class UsageError(Exception):
    pass


def _job_id(args: argparse.Namespace) -> str:
    if args.job_id:
        return args.job_id
    if args.rdzv_id and args.rdzv_id != "none":
        return args.rdzv_id
    return time.strftime("%Y%m%d-%H%M%S") + "-" + secrets.token_hex(2)


def prepare_run_dir(args: argparse.Namespace) -> Path:
    run_dir = Path(args.run_dir or Path("trainguard-runs") / _job_id(args)).absolute()
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        probe = run_dir / f".write-test-{os.getpid()}"
        probe.write_text("")
        probe.unlink()
    except OSError as exc:
        raise UsageError(f"run dir {run_dir} is not writable: {exc.strerror or exc}") from None
    return run_dir


def _setup_logging(run_dir: Path, node: str) -> None:
    root = logging.getLogger()
    root.setLevel(logging.INFO)
    fh = logs.AgentLogHandler(run_dir / f"agent-{node}.log")
    fh.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root.addHandler(fh)
    stream = logging.StreamHandler(sys.stderr)
    stream.setFormatter(logging.Formatter("[trainguard %(asctime)s] %(message)s", "%H:%M:%S"))
    stream.addFilter(console.ConsoleFilter())  # trainguard's lines; torch's go to the agent log
    root.addHandler(stream)
    console.route_torch_logging()


def _target(args: argparse.Namespace) -> Target:
    if args.no_python:
        return Target(binary=args.training_script)
    if args.module:
        return Target(module=args.training_script)
    return Target(script=os.path.abspath(args.training_script))


def _standalone(args: argparse.Namespace) -> bool:
    """Same defaults as torchrun's run(); True for a single-node job on loopback (its stores then
    listen on 127.0.0.1 only, see ``_loopback_rendezvous``)."""
    single = False
    if args.standalone:
        args.rdzv_backend = "c10d"
        args.rdzv_endpoint = "localhost:0"
        args.rdzv_id = str(uuid.uuid4())
        single = True
    elif args.rdzv_backend == "static" and not args.rdzv_endpoint and args.master_port is None:
        if parse_min_max_nnodes(args.nnodes)[1] == 1:
            args.rdzv_backend, args.rdzv_endpoint, args.rdzv_id = "c10d", "localhost:0", str(uuid.uuid4())
            single = True
    if args.master_port is None:
        args.master_port = 29500
    return single


def _torch_files_wanted(args: argparse.Namespace) -> bool:
    """Whether the user asked for torchrun's own per-rank files (--log-dir, --redirects, --tee):
    the workers' output is then also written where torchrun writes it (its specs' directories)."""
    return bool(args.log_dir) or Std.from_str(args.redirects) != Std.NONE or Std.from_str(args.tee) != Std.NONE


def _loopback_rendezvous(config) -> object:
    """Host a single-node job's rendezvous store on 127.0.0.1 (torch's would listen on every
    interface). torch's c10d backend opens its store multi-tenant on the endpoint's port, and so
    uses this server."""
    server = bound_store("127.0.0.1", multi_tenant=True)
    config.rdzv_endpoint = f"127.0.0.1:{server.port}"
    config.rdzv_configs["is_host"] = True
    return server


def _host_rendezvous(config) -> object | None:
    """Host a multi-node c10d rendezvous store bound to the endpoint's address, when that address
    is this machine's and nobody listens there yet (torch's store would listen on every interface,
    and torch finds out that it is the host by host-name lookups, which fail in network namespaces
    and on hosts without DNS: then nobody hosts the store). torch's backend then uses this server
    (multi-tenant, same port). None: another process hosts it, or the endpoint is not here."""
    if config.rdzv_backend != "c10d" or str(config.rdzv_configs.get("is_host", "")).lower() in ("0", "false", "no"):
        return None
    endpoint = (config.rdzv_endpoint or "").split(",")[0].strip()
    if not endpoint:
        return None
    host, port = parse_rendezvous_endpoint(endpoint, default_port=29400)
    try:  # a host name may resolve here to another address than the one the others reach
        ipaddress.ip_address(host)  # (127.0.1.1 in Debian's /etc/hosts): left to torch's store
    except ValueError:
        return None
    if not port:
        return None
    try:
        return bound_store(host, port, multi_tenant=True)
    except (OSError, RuntimeError, ValueError):  # not this machine's address, or already hosted
        return None


def _missing_rendezvous_client(backend: str) -> str | None:
    """Why torch's etcd rendezvous cannot run here (its client library is missing), else None.
    torch falls back to a stub that fails with a traceback deep inside the first round."""
    if backend not in ("etcd", "etcd-v2"):
        return None
    import importlib.util

    if importlib.util.find_spec("etcd") is None:
        return f"--rdzv-backend {backend} needs the python-etcd package: pip install 'trainguard[etcd]'"
    return None


def _root_cause(exc: BaseException) -> str:
    """The innermost exception's message: what a connection failure comes down to."""
    while exc.__cause__ is not None or (exc.__context__ is not None and not exc.__suppress_context__):
        exc = exc.__cause__ or exc.__context__  # type: ignore[assignment]
    return str(exc) or type(exc).__name__


def _endpoint_host(config) -> str | None:
    endpoint = (config.rdzv_endpoint or "").split(",")[0].strip()
    return parse_rendezvous_endpoint(endpoint, default_port=0)[0] if endpoint else None


def advertise_address(config, single: bool) -> str:
    """The address other nodes reach this one through: --local-addr, else the local end of the
    route to the rendezvous endpoint (or master), else this host's name."""
    if config.local_addr:
        return config.local_addr
    if single:
        return "127.0.0.1"
    return address_toward(_endpoint_host(config))


def _raise_signal(signum: int, frame: object) -> None:
    sigval = signal.Signals(signum)
    # The first signal decides how the run ends (SIGUSR1: preempted, requeue): a second one (Slurm's
    # SIGTERM when another node requeues the job) must not interrupt the stopping it started.
    for sig in scheduler.STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    exc = SignalException(f"Process {os.getpid()} got signal: {sigval}", sigval=sigval)
    stopsignal.record(exc)  # raised again by the agent's loop should a broad except swallow it
    raise exc


def _install_signal_handlers() -> None:
    # From the first moment (rendezvous included) a SIGTERM/SIGINT becomes an exception that
    # unwinds through our cleanup, instead of killing the agent and orphaning its workers. torch
    # elastic's agent catches the same SignalException to stop its workers.
    # SIGUSR1: Slurm's warning before the time limit or preemption (sbatch --signal=USR1@N).
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1):
        signal.signal(sig, _raise_signal)


def _static_master(params: RendezvousParameters) -> tuple[str | None, int | None]:
    """MASTER_ADDR/PORT of a static rendezvous (the endpoint); other backends choose their own."""
    if params.backend != "static":
        return None, None
    endpoint = (params.endpoint or "").strip()
    if not endpoint:
        raise ValueError("the static rendezvous needs an endpoint: add --master-addr and --master-port")
    host, port = parse_rendezvous_endpoint(endpoint, default_port=-1)
    if port == -1:
        raise ValueError(f"port is missing in endpoint {endpoint}: add --master-port")
    return host, port


def _keep_rendezvous_store(agent: TrainguardAgent, params: RendezvousParameters, bus: EventBus) -> None:
    """An excluded node that hosts the c10d store keeps serving it for the nodes that go on."""
    if params.backend != "c10d" or not params.endpoint:
        return
    _, port = parse_rendezvous_endpoint(params.endpoint, default_port=29400)
    if not keeper.listening_port(port):
        return
    handler = agent.get_worker_group().spec.rdzv_handler
    log.info("this node hosts the rendezvous store (port %d): keeping it up for the other nodes", port)
    try:
        why = keeper.keep_store(handler.is_closed, port)
    except SignalException:
        return
    bus.emit("store_keeper_done", f"stopped serving the rendezvous store: {why}", evidence={"port": port})


def _nodes_left(agent: TrainguardAgent | None, d: Decision) -> tuple[int | None, int | None]:
    """(nodes that go on, the job's minimum) after this node's exclusion, for --requeue."""
    nnodes = d.evidence.get("nnodes")
    if not isinstance(nnodes, int) and agent is not None and agent.ctx is not None:
        nnodes = agent.ctx.nnodes
    if not isinstance(nnodes, int) or agent is None:
        return None, None
    leaving = len(d.evidence.get("faulty") or {}) or 1
    return nnodes - leaving, agent.policy_settings.min_nodes(nnodes)


def launch(args: argparse.Namespace) -> int:
    slurm_job = scheduler.autodetect(args)  # before the run dir: it is keyed by the job id
    try:
        # Every monitor's settings are read first: one that cannot start stops the launch here,
        # before a run dir, a process or a port exists.
        monitors = plugins.create_monitors(args)
        bad = bad_urls((args.notify or []) + urls_from_env())
        if bad:  # said now, not at the first failure a job has hours later
            raise UsageError(f"notification URL not understood: {bad[0]} (see https://github.com/caronc/apprise)")
        names = _node_names(args)
        if problem := node_name_problem(names[0]):  # a name from the scheduler or the hostname: checked like --node-name
            raise UsageError(f"node name {problem}; give --node-name")
        run_dir, lock, store, node = _open_run_dir(args, names)
    except (plugins.MonitorStartError, UsageError, runlock.RunDirBusy) as exc:
        print(f"trainguard run: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    try:
        return _launch(args, run_dir, node, monitors, store, slurm_job)
    finally:
        lock.release()  # last: the run dir is this job's until everything above is done


def _node_names(args: argparse.Namespace) -> list[str]:
    """The names this node may take, first free one wins: --node-name, else the host name; for a
    multi-node job without --node-name also ``<host>-1``, ``<host>-2``... so that several agents of
    one job on one host (torchrun allows it: each is a node) get distinct names and locks. A
    single-node job keeps one name: a second one on its run dir is a mistake, refused."""
    if args.node_name:
        return [args.node_name]
    host = socket.gethostname()
    try:
        max_nodes = parse_min_max_nnodes(args.nnodes)[1]
    except (RuntimeError, ValueError):  # said by config_from_args, in one line
        max_nodes = 1
    return [host, *(f"{host}-{i}" for i in range(1, max_nodes))]


def _open_run_dir(args: argparse.Namespace, names: list[str]) -> tuple[Path, runlock.RunDirLock, EventStore, str]:
    """The run dir, locked for this node (the first of ``names`` not taken), this node's event
    database in it, and the node's name."""
    run_dir = prepare_run_dir(args)
    for node in names:
        try:
            lock = runlock.acquire(run_dir, node)
            break
        except runlock.RunDirBusy:
            if node == names[-1]:
                raise
        except OSError as exc:
            raise UsageError(f"cannot lock run dir {run_dir}: {exc.strerror or exc}") from None
    db = node_db_path(run_dir, node)  # one database per node: safe on NFS / Lustre (events/store.py)
    try:
        store = EventStore(db)
    except (sqlite3.Error, OSError) as exc:  # OSError: a symlink or special file where the database goes
        lock.release()
        raise UsageError(f"cannot store events in {db}: {exc}") from None
    return run_dir, lock, store, node


@dataclass
class Job:
    """torchrun's launch config for this node, resolved: what the agent is built from."""

    config: LaunchConfig
    cmd: str
    single: bool  # one node on loopback: its stores listen on 127.0.0.1 only
    advertise: str  # the address the other nodes reach this one through
    rdzv: RendezvousParameters
    rdzv_server: object | None  # the store this node hosts, kept alive as long as the job runs
    torch_logs: object | None  # torch's own per-rank files (--log-dir/--redirects/--tee), None when not asked for


@dataclass
class Outcome:
    """How this node's part of the job ended: the exit code, one line why, and whether the
    rendezvous may be closed (not when the others go on without this node)."""

    code: int = EXIT_FAILED
    verdict: str = "the job failed"
    shutdown_rdzv: bool = True


def _resolve_job(args: argparse.Namespace) -> Job:
    """torchrun's config from the flags, the rendezvous store this node hosts, its address."""
    user_rdzv_id = args.rdzv_id
    single = _standalone(args)
    torch_files = _torch_files_wanted(args)
    if not torch_files:
        args.log_dir = os.devnull  # torch's specs then make no torchelastic_* directory in $TMPDIR
    try:
        config, cmd, _ = config_from_args(args)
    except (AssertionError, ValueError) as exc:
        raise UsageError(str(exc)) from None
    # What torchrun's launch_agent sets in its own environment, and so in its workers'.
    os.environ["TORCHELASTIC_SIGNALS_TO_HANDLE"] = config.signals_to_handle
    if user_rdzv_id == "none" and not args.standalone:
        config.run_id = str(uuid.uuid4())
    missing = _missing_rendezvous_client(config.rdzv_backend)
    if missing:
        raise UsageError(missing)
    rdzv_server = _loopback_rendezvous(config) if single else _host_rendezvous(config)
    advertise = advertise_address(config, single)
    if config.max_nodes > 1 and is_loopback(advertise) and not reaches_loopback(_endpoint_host(config) or "localhost"):
        raise UsageError(
            f"this node's address for the other nodes would be {advertise} (loopback) "
            f"while the rendezvous endpoint {config.rdzv_endpoint} is not: give --local-addr"
        )
    rdzv = RendezvousParameters(
        backend=config.rdzv_backend,
        endpoint=config.rdzv_endpoint,
        run_id=config.run_id,
        min_nodes=config.min_nodes,
        max_nodes=config.max_nodes,
        local_addr=config.local_addr,
        **config.rdzv_configs,
    )
    return Job(config, cmd, single, advertise, rdzv, rdzv_server, config.logs_specs if torch_files else None)


def _event_bus(args: argparse.Namespace, store: EventStore, node: str, run_dir: Path) -> tuple[EventBus, Notifier]:
    if not store.reserve_ok:
        log.warning("the disk of %s is full: events are stored in what is left of the event store's reserve", store.path)
    bus = EventBus(store, node=node)
    notifier = Notifier((args.notify or []) + urls_from_env(), Severity.parse(args.notify_severity), job=run_dir.name)
    bus.subscribe(notifier)
    return bus, notifier


def _make_agent(args: argparse.Namespace, job: Job, run_dir: Path, monitors: list, bus: EventBus,
                pool: WorkerPool) -> TrainguardAgent:
    config = job.config
    # torchrun passes the script's own args, plus --local-rank only in its legacy --no-use-env mode.
    script_args = list(args.training_script_args)
    if not get_use_env(args):
        script_args.insert(0, f"--local-rank={macros.local_rank}")
    master_addr, master_port = _static_master(job.rdzv)
    spec = WorkerSpec(
        role=config.role,
        local_world_size=config.nproc_per_node,
        entrypoint=job.cmd,
        args=tuple(script_args),
        rdzv_handler=rdzv_registry.get_rendezvous_handler(job.rdzv),
        max_restarts=config.max_restarts,
        monitor_interval=config.monitor_interval,
        master_addr=master_addr,
        master_port=master_port,
        local_addr=config.local_addr,
    )
    tee = None if not args.quiet else set()
    if args.local_ranks_filter:
        tee = {int(r) for r in args.local_ranks_filter.split(",")}
    return TrainguardAgent(
        spec,
        run_dir=run_dir,
        bus=bus,
        monitors=monitors,
        pool=pool,
        target=_target(args),
        policy_settings=PolicySettings.from_options(args),
        rdzv_backend=config.rdzv_backend,
        advertise_addr=job.advertise,
        job_key=JobKey.for_job(config.run_id, single_node=job.single),
        tee_ranks=tee,
        exit_barrier_timeout=args.exit_barrier_timeout,
        stop_timeout=args.worker_stop_timeout,
        torch_logs=job.torch_logs,
    )


def _run_agent(agent: TrainguardAgent, bus: EventBus, node: str, max_restarts: int) -> Outcome:
    """Run the job to its end on this node; the event that says how it ended."""
    result = agent.run()
    if result is not None and result.state == WorkerState.SUCCEEDED:
        bus.emit("job_succeeded", f"workers on {node} finished successfully", evidence={"attempts": agent.restarts_this_run + 1})
        return Outcome(EXIT_OK, "the job succeeded")
    out = Outcome()
    reason = agent.stop_decision.reason if agent.stop_decision else agent.restart_reason
    out.verdict = reason
    if agent.stop_decision is not None and agent.stop_decision.evidence.get("faulty"):
        out.code = EXIT_NODE_FAULT  # too few healthy nodes left: retry elsewhere
    bus.emit(
        "job_failed",
        f"job failed: {reason}" + ("" if agent.stop_decision else f" (restarts exhausted: {max_restarts})"),
        severity=Severity.CRITICAL,
        rank=next(iter(agent.final_failures), None),  # ordered by exit time: first failure first
        evidence={
            "reason": reason,
            "failures": {str(r): f.to_dict() for r, f in agent.final_failures.items()},
            "max_restarts": max_restarts,
        },
    )
    return out


def _excluded(exc: NodeExcluded, agent: TrainguardAgent | None, job: Job, node: str, bus: EventBus,
              sched: scheduler.Scheduler) -> Outcome:
    d = exc.decision
    bus.emit("node_excluded", d.exit_message or d.reason, severity=Severity.ERROR, rank=d.rank, evidence={"reason": d.reason, "source": d.source, **d.evidence})
    print(d.exit_message or d.reason, flush=True)
    # shutdown_rdzv False: closing the rendezvous would end it for the nodes that go on
    out = Outcome(EXIT_EXCLUDED, f"{d.exit_message} {d.reason}".strip(), shutdown_rdzv=False)
    nodes_left, min_nodes = _nodes_left(agent, d)
    sched.on_excluded(node, d.reason, nodes_left, min_nodes)
    if agent is not None:
        _keep_rendezvous_store(agent, job.rdzv, bus)
    return out


def _ended_by(exc: Exception, agent: TrainguardAgent | None, job: Job, node: str, bus: EventBus,
              sched: scheduler.Scheduler) -> Outcome:
    """How an exception out of the agent's run ends this node's part of the job. Called inside the
    ``except`` block, so the last branch's log.exception still has the traceback."""
    if isinstance(exc, NodeExcluded):
        return _excluded(exc, agent, job, node, bus, sched)
    if isinstance(exc, NodesUnreachable):
        bus.emit("job_failed", f"job failed: {exc}", severity=Severity.CRITICAL, evidence={"reason": str(exc)})
        print(f"trainguard run: error: {exc}", file=sys.stderr)
        return Outcome(verdict=str(exc))
    if isinstance(exc, JobStopped):
        bus.emit("job_failed", f"job stopped: {exc.decision.reason}", severity=Severity.CRITICAL, evidence=exc.decision.evidence)
        # too few healthy nodes left: retry elsewhere
        return Outcome(EXIT_NODE_FAULT if exc.decision.evidence.get("faulty") else EXIT_FAILED, exc.decision.reason)
    if isinstance(exc, SignalException):
        stopsignal.handled()
        if exc.sigval in (signal.SIGTERM, signal.SIGUSR1):
            sched.on_preempted(exc.sigval, node)
        bus.emit("job_failed", f"stopped by {exc.sigval.name}", severity=Severity.WARNING, evidence={"signal": exc.sigval.name})
        return Outcome(signal_exit(exc.sigval), f"stopped by {exc.sigval.name} (preempted or cancelled)", shutdown_rdzv=False)
    if isinstance(exc, RendezvousConnectionError):
        cfg = job.config
        verdict = f"cannot reach the {cfg.rdzv_backend} rendezvous at {cfg.rdzv_endpoint}: {_root_cause(exc)}"
        bus.emit("job_failed", f"job failed: {verdict}", severity=Severity.CRITICAL, evidence={"reason": verdict})
        print(f"trainguard run: error: {verdict}", file=sys.stderr)
        return Outcome(verdict=verdict)
    log.exception("agent failed")
    bus.emit("job_failed", f"agent error: {exc!r}", severity=Severity.CRITICAL, evidence={"error": repr(exc)})
    return Outcome()


def _stop(args: argparse.Namespace, out: Outcome, agent: TrainguardAgent | None, pool: WorkerPool,
          sched: scheduler.Scheduler, bus: EventBus, run_dir: Path) -> None:
    """Close down this node's part of the job, in the order that loses nothing."""
    if out.shutdown_rdzv and agent is not None:
        try:
            agent.get_worker_group().spec.rdzv_handler.shutdown()
        except Exception:
            pass
    # After the rendezvous is closed (the other nodes are not kept waiting), before the
    # monitors close (the metrics endpoint and status stay up while held).
    if out.code in (EXIT_FAILED, EXIT_EXCLUDED, EXIT_NODE_FAULT) and args.hold_on_failure:
        hold.hold(args.hold_on_failure, bus, run_dir, "excluded" if out.code == EXIT_EXCLUDED else "failed")
    # Stopping: a signal now (Slurm's requeue by another node, a time limit) must not cut short
    # persisting the snapshots and stopping the workers.
    for sig in scheduler.STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    if agent is not None:
        agent.close()
    pool.close()
    sched.finish(out.code, out.verdict)  # after close: the snapshots are on disk before a requeue


def _launch(args: argparse.Namespace, run_dir: Path, node: str, monitors: list, store: EventStore,
            slurm_job: slurm.SlurmJob | None) -> int:
    _setup_logging(run_dir, node)
    scheduler.describe(slurm_job, args)
    _install_signal_handlers()
    try:
        job = _resolve_job(args)
    except UsageError as exc:
        print(f"trainguard run: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    bus, notifier = _event_bus(args, store, node, run_dir)
    sched = scheduler.Scheduler.from_options(args, run_dir, bus.emit, slurm_job)
    # Spares only for Python workers (a --no-python binary starts its own interpreter, if any).
    prestart = "off" if args.no_python else args.prestart_workers
    pool = WorkerPool(job.config.nproc_per_node, python=os.getenv("PYTHON_EXEC", sys.executable), mode=prestart)
    agent: TrainguardAgent | None = None
    out = Outcome()
    try:
        agent = _make_agent(args, job, run_dir, monitors, bus, pool)
        log.info("run dir %s; node %s; %d worker(s) per node", run_dir, node, job.config.nproc_per_node)
        out = _run_agent(agent, bus, node, job.config.max_restarts)
    except Exception as exc:
        out = _ended_by(exc, agent, job, node, bus, sched)
    finally:
        _stop(args, out, agent, pool, sched, bus, run_dir)
        job.rdzv_server = None
        notifier.close()
        store.close()
    return out.code
