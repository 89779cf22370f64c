"""Assemble and run one node's agent: config, run dir, events, monitors, pool."""

from __future__ import annotations

import argparse
import logging
import os
import secrets
import signal
import socket
import sys
import time
import uuid
from pathlib import Path

from torch.distributed.elastic.agent.server.api import WorkerSpec, WorkerState
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.rendezvous import RendezvousParameters
from torch.distributed.elastic.rendezvous import registry as rdzv_registry
from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint
from torch.distributed.elastic.utils import macros
from torch.distributed.run import config_from_args, get_use_env, parse_min_max_nnodes

from trainguard.events import EventBus, EventStore, Severity
from trainguard.events.notify import Notifier, urls_from_env
from trainguard.exitcodes import EXIT_EXCLUDED, EXIT_FAILED, EXIT_NODE_FAULT, EXIT_OK, EXIT_USAGE, signal_exit
from trainguard.launch import console, hold, keeper, plugins
from trainguard.launch.agent import JobStopped, NodeExcluded, TrainguardAgent
from trainguard.launch.pcontext import Target
from trainguard.launch.pool import WorkerPool
from trainguard.policy import Decision, PolicySettings
from trainguard.schedulers import adapter as scheduler

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
    fh = logging.FileHandler(run_dir / f"agent-{node}.log")
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


def _standalone(args: argparse.Namespace) -> None:
    # Same defaults as torchrun's run().
    if args.standalone:
        args.rdzv_backend = "c10d"
        args.rdzv_endpoint = "localhost:0"
        args.rdzv_id = str(uuid.uuid4())
    elif args.rdzv_backend == "static" and not args.rdzv_endpoint and args.master_port is None:
        if parse_min_max_nnodes(args.nnodes)[1] == 1:
            args.rdzv_backend, args.rdzv_endpoint, args.rdzv_id = "c10d", "localhost:0", str(uuid.uuid4())
    if args.master_port is None:
        args.master_port = 29500


def _raise_signal(signum: int, frame: object) -> None:
    sigval = signal.Signals(signum)
    # The first signal decides how the run ends (SIGUSR1: preempted, requeue): a second one (Slurm's
    # SIGTERM when another node requeues the job) must not interrupt the stopping it started.
    for sig in scheduler.STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    raise SignalException(f"Process {os.getpid()} got signal: {sigval}", sigval=sigval)


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
        run_dir = prepare_run_dir(args)
    except (plugins.MonitorStartError, UsageError) as exc:
        print(f"trainguard run: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    node = args.node_name or socket.gethostname()
    _setup_logging(run_dir, node)
    scheduler.describe(slurm_job, args)
    _install_signal_handlers()
    user_rdzv_id = args.rdzv_id
    _standalone(args)
    try:
        config, cmd, _ = config_from_args(args)
    except (AssertionError, ValueError) as exc:
        print(f"trainguard run: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    if user_rdzv_id == "none" and not args.standalone:
        config.run_id = str(uuid.uuid4())

    store = EventStore(run_dir)
    bus = EventBus(store, node=node)
    notifier = Notifier((args.notify or []) + urls_from_env(), Severity.parse(args.notify_severity), job=run_dir.name)
    bus.subscribe(notifier)
    sched = scheduler.Scheduler.from_options(args, run_dir, bus.emit, slurm_job)
    pool = WorkerPool(config.nproc_per_node, python=os.getenv("PYTHON_EXEC", sys.executable), enabled=args.prestart_workers == "on")

    # torchrun passes the script's own args, plus --local-rank only in its legacy --no-use-env mode.
    script_args = list(args.training_script_args)
    if not get_use_env(args):
        script_args.insert(0, f"--local-rank={macros.local_rank}")
    rdzv_parameters = RendezvousParameters(
        backend=config.rdzv_backend,
        endpoint=config.rdzv_endpoint,
        run_id=config.run_id,
        min_nodes=config.min_nodes,
        max_nodes=config.max_nodes,
        local_addr=config.local_addr,
        **config.rdzv_configs,
    )
    agent: TrainguardAgent | None = None
    shutdown_rdzv = True
    code = EXIT_FAILED
    verdict = "the job failed"
    try:
        master_addr, master_port = _static_master(rdzv_parameters)
        spec = WorkerSpec(
            role=config.role,
            local_world_size=config.nproc_per_node,
            entrypoint=cmd,
            args=tuple(script_args),
            rdzv_handler=rdzv_registry.get_rendezvous_handler(rdzv_parameters),
            max_restarts=config.max_restarts,
            monitor_interval=config.monitor_interval,
            master_addr=master_addr,
            master_port=master_port,
            local_addr=config.local_addr,
        )
        tee = None if not args.quiet else set()
        if args.local_ranks_filter:
            tee = {int(r) for r in args.local_ranks_filter.split(",")}
        agent = TrainguardAgent(
            spec,
            run_dir=run_dir,
            bus=bus,
            monitors=monitors,
            pool=pool,
            target=_target(args),
            policy_settings=PolicySettings.from_options(args),
            rdzv_backend=config.rdzv_backend,
            tee_ranks=tee,
            exit_barrier_timeout=args.exit_barrier_timeout,
            stop_timeout=args.worker_stop_timeout,
        )
        log.info("run dir %s; node %s; %d worker(s) per node", run_dir, node, config.nproc_per_node)
        result = agent.run()
        if result is not None and result.state == WorkerState.SUCCEEDED:
            bus.emit("job_succeeded", f"workers on {node} finished successfully", evidence={"attempts": agent.attempt + 1})
            code, verdict = EXIT_OK, "the job succeeded"
        else:
            reason = agent.stop_decision.reason if agent.stop_decision else agent.restart_reason
            verdict = reason
            if agent.stop_decision is not None and agent.stop_decision.evidence.get("faulty"):
                code = EXIT_NODE_FAULT  # too few healthy nodes left: retry elsewhere
            bus.emit(
                "job_failed",
                f"job failed: {reason}" + ("" if agent.stop_decision else f" (restarts exhausted: {config.max_restarts})"),
                severity=Severity.CRITICAL,
                rank=next(iter(agent.final_failures), None),  # ordered by exit time: first failure first
                evidence={
                    "reason": reason,
                    "failures": {str(r): f.to_dict() for r, f in agent.final_failures.items()},
                    "max_restarts": config.max_restarts,
                },
            )
    except NodeExcluded as exc:
        shutdown_rdzv = False  # closing the rendezvous would end it for the nodes that go on
        d = exc.decision
        bus.emit("node_excluded", d.exit_message or d.reason, severity=Severity.ERROR, rank=d.rank, evidence={"reason": d.reason, "source": d.source, **d.evidence})
        print(d.exit_message or d.reason, flush=True)
        code, verdict = EXIT_EXCLUDED, f"{d.exit_message} {d.reason}".strip()
        nodes_left, min_nodes = _nodes_left(agent, d)
        sched.on_excluded(node, d.reason, nodes_left, min_nodes)
        if agent is not None:
            _keep_rendezvous_store(agent, rdzv_parameters, bus)
    except JobStopped as exc:
        verdict = exc.decision.reason
        if exc.decision.evidence.get("faulty"):
            code = EXIT_NODE_FAULT  # too few healthy nodes left: retry elsewhere
        bus.emit("job_failed", f"job stopped: {exc.decision.reason}", severity=Severity.CRITICAL, evidence=exc.decision.evidence)
    except SignalException as exc:
        shutdown_rdzv = False
        if exc.sigval in (signal.SIGTERM, signal.SIGUSR1):
            sched.on_preempted(exc.sigval, node)
        bus.emit("job_failed", f"stopped by {exc.sigval.name}", severity=Severity.WARNING, evidence={"signal": exc.sigval.name})
        code, verdict = signal_exit(exc.sigval), f"stopped by {exc.sigval.name} (preempted or cancelled)"
    except Exception as exc:
        log.exception("agent failed")
        bus.emit("job_failed", f"agent error: {exc!r}", severity=Severity.CRITICAL, evidence={"error": repr(exc)})
    finally:
        if shutdown_rdzv and agent is not None:
            try:
                agent.get_worker_group().spec.rdzv_handler.shutdown()
            except Exception:
                pass
        # After the rendezvous is closed (the other nodes are not kept waiting), before the
        # monitors close (the metrics endpoint and status stay up while held).
        if code in (EXIT_FAILED, EXIT_EXCLUDED, EXIT_NODE_FAULT) and args.hold_on_failure:
            hold.hold(args.hold_on_failure, bus, run_dir, "excluded" if code == EXIT_EXCLUDED else "failed")
        # Stopping: a signal now (Slurm's requeue by another node, a time limit) must not cut short
        # persisting the snapshots and stopping the workers.
        for sig in scheduler.STOP_SIGNALS:
            signal.signal(sig, signal.SIG_IGN)
        if agent is not None:
            agent.close()
        pool.close()
        sched.finish(code, verdict)  # after close: the snapshots are on disk before a requeue
        notifier.close()
        store.close()
    return code
