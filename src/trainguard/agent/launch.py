"""Assemble and run one node's agent: config, run dir, events, monitors, pool."""

from __future__ import annotations

import ipaddress
import logging
import os
import shlex
import signal
import sqlite3
import sys
import uuid
from dataclasses import dataclass
from pathlib import Path

from torch.distributed.elastic.agent.server.api import WorkerSpec, WorkerState
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.rendezvous import (
    RendezvousConnectionError,
    RendezvousParameters,
    RendezvousTimeoutError,
)
from torch.distributed.elastic.rendezvous import registry as rdzv_registry
from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint
from torch.distributed.launcher.api import LaunchConfig
from torch.distributed.run import config_from_args

from trainguard import runfiles, stopsignal
from trainguard.agent import console, hold, runlock, standby
from trainguard.agent.elastic import (
    DuplicateNodeName,
    JobStopped,
    NodeExcluded,
    NodesUnreachable,
    TrainguardAgent,
)
from trainguard.agent.settings import LaunchSettings, RunSettings, TorchRun
from trainguard.cluster import keeper
from trainguard.cluster.stores import JobKey, address_toward, bound_store, is_loopback, reaches_loopback
from trainguard.events import EventBus, EventStore, Severity
from trainguard.events.notify import Notifier
from trainguard.events.store import node_db_path
from trainguard.exitcodes import EXIT_EXCLUDED, EXIT_FAILED, EXIT_NODE_FAULT, EXIT_OK, EXIT_USAGE, signal_exit
from trainguard.monitors import plugins
from trainguard.policy import Decision
from trainguard.schedulers import adapter as scheduler
from trainguard.spawn import logs
from trainguard.spawn.pool import WorkerPool

log = logging.getLogger("trainguard")

# The words ModelArts' users search the log for: the job ended for good, restarts spent or none
# left to try ("error,exiting"), and the command started ("Command running...").
FINAL_FAILURE = "error,exiting"
COMMAND_RUNNING = "Command running..."


class UsageError(Exception):
    pass


def prepare_run_dir(run_dir: Path) -> Path:
    try:
        runfiles.private_dirs(run_dir)  # private: its logs hold the job's output
        probe = run_dir / f".write-test-{os.getpid()}"
        os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600))
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
    # A SIGHUP ignored at start is nohup's promise that the job outlives its terminal: keep it.
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1):
        if not (sig == signal.SIGHUP and _under_nohup()):
            signal.signal(sig, _raise_signal)
    stopsignal.set_handler(_raise_signal)  # taken back from torch's each time workers start


def _under_nohup() -> bool:
    return signal.getsignal(signal.SIGHUP) == signal.SIG_IGN


def _torch_signals(configured: str) -> str:
    """torchrun's --signals-to-handle for torch's PContext.start, less SIGHUP under nohup (torch
    would register it over nohup's SIG_IGN and stop the job when its terminal closes)."""
    if not _under_nohup():
        return configured
    return ",".join(n for n in configured.split(",") if n.strip() != "SIGHUP")


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


def launch(settings: RunSettings) -> int:
    """Run this node's part of the job, from the settings built (and checked) once by the parser."""
    try:
        # Every monitor is made first: one that cannot start stops the launch here, before a run
        # dir, a process or a port exists.
        monitors = plugins.create_monitors(settings.monitors)
        run_dir, lock, store, node = _open_run_dir(settings.launch)
    except (plugins.MonitorStartError, UsageError, runlock.RunDirBusy) as exc:
        print(f"trainguard run: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    try:
        return _launch(settings, run_dir, node, monitors, store)
    finally:
        lock.release()  # last: the run dir is this job's until everything above is done


def _open_run_dir(launch: LaunchSettings) -> tuple[Path, runlock.RunDirLock, EventStore, str]:
    """The run dir, locked for this node (the first of its names not taken), this node's event
    database in it, and the node's name."""
    run_dir = prepare_run_dir(launch.run_dir)
    names = launch.node_names
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


def _resolve_job(torchrun: TorchRun) -> Job:
    """torchrun's config from its flags, the rendezvous store this node hosts, its address."""
    single, torch_files = torchrun.single, torchrun.torch_files
    try:
        config, cmd, _ = config_from_args(torchrun.args)  # torch's own function: torch's Namespace
    except (AssertionError, ValueError) as exc:
        raise UsageError(str(exc)) from None
    # What torchrun's launch_agent sets in its own environment, and so in its workers'.
    os.environ["TORCHELASTIC_SIGNALS_TO_HANDLE"] = _torch_signals(config.signals_to_handle)
    if torchrun.fresh_run_id:
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


def _event_bus(launch: LaunchSettings, store: EventStore, node: str, run_dir: Path) -> tuple[EventBus, Notifier]:
    if not store.reserve_ok:
        log.warning("the disk of %s is full: events are stored in what is left of the event store's reserve", store.path)
    bus = EventBus(store, node=node)
    notifier = Notifier(list(launch.notify), launch.notify_severity, job=run_dir.name)
    bus.subscribe(notifier)
    return bus, notifier


def _make_agent(settings: RunSettings, job: Job, run_dir: Path, monitors: list, bus: EventBus,
                pool: WorkerPool) -> TrainguardAgent:
    config, launch = job.config, settings.launch
    master_addr, master_port = _static_master(job.rdzv)
    spec = WorkerSpec(
        role=config.role,
        local_world_size=config.nproc_per_node,
        entrypoint=job.cmd,
        args=launch.script_args,
        rdzv_handler=rdzv_registry.get_rendezvous_handler(job.rdzv),
        max_restarts=config.max_restarts,
        monitor_interval=config.monitor_interval,
        master_addr=master_addr,
        master_port=master_port,
        local_addr=config.local_addr,
    )
    return TrainguardAgent(
        spec,
        run_dir=run_dir,
        bus=bus,
        monitors=monitors,
        pool=pool,
        target=launch.target,
        policy_settings=settings.policy,
        rdzv_backend=config.rdzv_backend,
        advertise_addr=job.advertise,
        job_key=JobKey.for_job(config.run_id, single_node=job.single),
        tee_ranks=None if launch.tee_ranks is None else set(launch.tee_ranks),
        exit_barrier_timeout=launch.exit_barrier_timeout,
        stop_timeout=launch.stop_timeout,
        torch_logs=job.torch_logs,
        node_history=launch.node_history,
        standby=launch.standby,
        node_name_given=launch.node_name_given,
    )


def _run_agent(agent: TrainguardAgent, bus: EventBus, max_restarts: int) -> Outcome:
    """Run the job to its end on this node; the event that says how it ended."""
    result = agent.run()
    node = bus.node  # after the run: the first round may have renamed the node (agent/node_names.py)
    if result is None and agent.standby_waiting:  # torch's graceful exit: the job closed its rendezvous
        return _standby_released(bus, node, "")
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
        f"job failed: {reason}" + ("" if agent.stop_decision else f" (restarts exhausted: {max_restarts})")
        + f"; {FINAL_FAILURE}",
        severity=Severity.CRITICAL,
        rank=next(iter(agent.final_failures), None),  # ordered by exit time: first failure first
        evidence={
            "reason": reason,
            "failures": {str(r): f.to_dict() for r, f in agent.final_failures.items()},
            "max_restarts": max_restarts,
        },
    )
    return out


def _standby_released(bus: EventBus, node: str, how: str) -> Outcome:
    """A standby that was never needed: the job ended (or its rendezvous went away) while it waited."""
    standby.released(bus.emit, node, how)
    return Outcome(EXIT_OK, "the job ended without needing this standby" + how, shutdown_rdzv=False)


def _excluded(exc: NodeExcluded, agent: TrainguardAgent | None, job: Job, node: str, bus: EventBus,
              sched: scheduler.Scheduler) -> Outcome:
    d = exc.decision
    bus.emit("node_excluded", d.exit_message or d.reason, severity=Severity.ERROR, rank=d.rank, evidence={"reason": d.reason, "source": d.source, **d.evidence})
    print(d.exit_message or d.reason, flush=True)
    # shutdown_rdzv False: closing the rendezvous would end it for the nodes that go on
    out = Outcome(EXIT_EXCLUDED, f"{d.exit_message} {d.reason}".strip(), shutdown_rdzv=False)
    nodes_left, min_nodes = _nodes_left(agent, d)
    sched.on_excluded(node, d.reason, nodes_left, min_nodes)
    if agent is not None and not job.single:  # a single-node job has no other nodes to serve
        _keep_rendezvous_store(agent, job.rdzv, bus)
    return out


def _ended_by(exc: Exception, agent: TrainguardAgent | None, job: Job, node: str, bus: EventBus,
              sched: scheduler.Scheduler) -> Outcome:
    """How an exception out of the agent's run ends this node's part of the job. Called inside the
    ``except`` block, so the last branch's log.exception still has the traceback."""
    if isinstance(exc, NodeExcluded):
        return _excluded(exc, agent, job, node, bus, sched)
    if isinstance(exc, NodesUnreachable):
        bus.emit("job_failed", f"job failed: {exc}; {FINAL_FAILURE}", severity=Severity.CRITICAL, evidence={"reason": str(exc)})
        print(f"trainguard run: error: {exc}", file=sys.stderr)
        # one --node-name on two agents is bad input, refused before any worker started
        return Outcome(EXIT_USAGE if isinstance(exc, DuplicateNodeName) else EXIT_FAILED, str(exc))
    if isinstance(exc, JobStopped):
        bus.emit("job_failed", f"job stopped: {exc.decision.reason}; {FINAL_FAILURE}", severity=Severity.CRITICAL, evidence=exc.decision.evidence)
        # too few healthy nodes left: retry elsewhere
        return Outcome(EXIT_NODE_FAULT if exc.decision.evidence.get("faulty") else EXIT_FAILED, exc.decision.reason)
    if isinstance(exc, SignalException):
        stopsignal.handled()
        if exc.sigval in (signal.SIGTERM, signal.SIGUSR1):
            sched.on_preempted(exc.sigval, node)
        bus.emit("job_failed", f"stopped by {exc.sigval.name}", severity=Severity.WARNING, evidence={"signal": exc.sigval.name})
        return Outcome(signal_exit(exc.sigval), f"stopped by {exc.sigval.name} (preempted or cancelled)", shutdown_rdzv=False)
    if isinstance(exc, RendezvousTimeoutError):
        return _peers_never_came(job, bus)
    if isinstance(exc, RendezvousConnectionError) and agent is not None and agent.standby_waiting:
        # c10d's store lives in node rank 0's agent, which exits when the job ends: a waiting
        # standby's next read may fail before it sees the rendezvous closed
        return _standby_released(bus, node, f" (its rendezvous store went away: {_root_cause(exc)})")
    if isinstance(exc, RendezvousConnectionError):
        cfg = job.config
        verdict = f"cannot reach the {cfg.rdzv_backend} rendezvous at {cfg.rdzv_endpoint}: {_root_cause(exc)}"
        bus.emit("job_failed", f"job failed: {verdict}; {FINAL_FAILURE}", severity=Severity.CRITICAL, evidence={"reason": verdict})
        print(f"trainguard run: error: {verdict}", file=sys.stderr)
        # shutdown_rdzv False: this node is the one cut off; once its link is back, closing the
        # rendezvous on the way out would end the job for the nodes that went on (bench/soak.py:
        # a net-cut node closed it 70 s later, and the others' next re-rendezvous failed).
        return Outcome(verdict=verdict, shutdown_rdzv=False)
    log.exception("agent failed")
    bus.emit("job_failed", f"agent error: {exc!r}; {FINAL_FAILURE}", severity=Severity.CRITICAL, evidence={"error": repr(exc)})
    return Outcome()


def _peers_never_came(job: Job, bus: EventBus) -> Outcome:
    """The rendezvous did not fill within --rdzv-wait-minutes (a replacement node whose job never
    came back, or peers never started): too few nodes, retry elsewhere (201)."""
    cfg = job.config
    wait = job.rdzv.get_as_int("join_timeout", 600)
    verdict = (f"too few nodes: the {cfg.rdzv_backend} rendezvous at {cfg.rdzv_endpoint} did not get "
               f"{cfg.min_nodes} node(s) in {wait} s (--rdzv-wait-minutes)")
    bus.emit("job_failed", f"job failed: {verdict}; {FINAL_FAILURE}", severity=Severity.CRITICAL,
             evidence={"reason": verdict, "join_timeout": wait, "min_nodes": cfg.min_nodes})
    print(f"trainguard run: error: {verdict}", file=sys.stderr)
    return Outcome(EXIT_NODE_FAULT, verdict, shutdown_rdzv=False)


def _command_line(launch: LaunchSettings) -> str:
    target = launch.target
    first = [target.script] if target.script else (["-m", target.module] if target.module else [target.binary or ""])
    return shlex.join([*first, *launch.script_args])


def _stop(launch: LaunchSettings, out: Outcome, agent: TrainguardAgent | None, pool: WorkerPool,
          sched: scheduler.Scheduler, bus: EventBus, run_dir: Path) -> None:
    """Close down this node's part of the job, in the order that loses nothing."""
    if out.shutdown_rdzv and agent is not None:
        try:
            agent.get_worker_group().spec.rdzv_handler.shutdown()
        except Exception:
            pass
    # After the rendezvous is closed (the other nodes are not kept waiting), before the
    # monitors close (the metrics endpoint and status stay up while held).
    if out.code in (EXIT_FAILED, EXIT_EXCLUDED, EXIT_NODE_FAULT) and launch.hold_on_failure:
        hold.hold(launch.hold_on_failure, bus, run_dir, "excluded" if out.code == EXIT_EXCLUDED else "failed")
    # Stopping: a signal now (Slurm's requeue by another node, a time limit) must not cut short
    # persisting the snapshots and stopping the workers.
    for sig in scheduler.STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    if agent is not None:
        agent.close()
    pool.close()
    sched.finish(out.code, out.verdict)  # after close: the snapshots are on disk before a requeue


def _launch(settings: RunSettings, run_dir: Path, node: str, monitors: list, store: EventStore) -> int:
    _setup_logging(run_dir, node)
    _install_signal_handlers()
    try:
        job = _resolve_job(settings.torchrun)
    except UsageError as exc:  # one line, alone: the command never ran
        print(f"trainguard run: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    log.info("%s: %s", COMMAND_RUNNING, _command_line(settings.launch))
    scheduler.describe(settings.scheduler)
    bus, notifier = _event_bus(settings.launch, store, node, run_dir)
    sched = scheduler.Scheduler.from_settings(settings.scheduler, run_dir, bus.emit)
    pool = WorkerPool(job.config.nproc_per_node, python=os.getenv("PYTHON_EXEC", sys.executable), mode=settings.launch.prestart)
    agent: TrainguardAgent | None = None
    out = Outcome()
    try:
        agent = _make_agent(settings, job, run_dir, monitors, bus, pool)
        log.info("run dir %s; node %s; %d worker(s) per node", run_dir, node, job.config.nproc_per_node)
        out = _run_agent(agent, bus, job.config.max_restarts)
    except Exception as exc:
        out = _ended_by(exc, agent, job, bus.node, bus, sched)
    finally:
        _stop(settings.launch, out, agent, pool, sched, bus, run_dir)
        job.rdzv_server = None
        notifier.close()
        store.close()
    return out.code
