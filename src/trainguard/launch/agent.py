"""trainguard's agent: torch elastic's LocalElasticAgent plus monitors, policy and events.

What it changes, each through the agent's documented extension points:
- ``_rendezvous``: a fresh TCPStore for the workers of every round. torch's agent reuses one store
  across restarts, so restarted gloo ranks read the dead ranks' old addresses (pytorch#135712).
- ``_start_workers``: workers come from pre-started processes with torch already imported, and
  their output is logged per rank with timestamps.
- ``_monitor_workers``: monitors (hang, straggler, checks...) are polled; worker failures go through
  the policy module, which may restart, exclude this node, or stop the job at once.
"""

from __future__ import annotations

import logging
import os
import re
import signal
import time
from pathlib import Path
from typing import Any

from torch.distributed import TCPStore
from torch.distributed.elastic.agent.server.api import RunResult, WorkerGroup, WorkerSpec, WorkerState
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.utils import macros

from trainguard import policy
from trainguard.events import EventBus, Severity
from trainguard.launch.logs import tail
from trainguard.launch.monitor import Monitor, MonitorContext, StepTracker, WorkerInfo
from trainguard.launch.pcontext import RunDirLogsSpecs, Target, TrainguardPContext
from trainguard.launch.pool import WorkerPool
from trainguard.policy import Action, Decision

log = logging.getLogger(__name__)

# What a rank prints when it fails only because a peer died first (gloo, NCCL, c10d store).
PEER_LOSS = re.compile(
    r"Connection closed by peer|Connection reset by peer|Broken pipe|remote process exited"
    r"|communicator was aborted|NCCL communicator.*abort|Socket Timeout|failed to recv, got 0 bytes",
    re.IGNORECASE,
)

WORKER_STORE_KEY = "trainguard/worker_store"
LEAVING_KEY = "trainguard/leaving"
STOP_KEY = "trainguard/stop"


class NodeExcluded(Exception):
    """This node leaves the job (faulty or straggler); an elastic job goes on without it."""

    def __init__(self, decision: Decision) -> None:
        super().__init__(decision.exit_message or decision.reason)
        self.decision = decision


class JobStopped(Exception):
    """The policy stopped the job before workers could start."""

    def __init__(self, decision: Decision) -> None:
        super().__init__(decision.reason)
        self.decision = decision


def _signal_name(exitcode: int) -> str | None:
    if exitcode >= 0:
        return None
    try:
        return signal.Signals(-exitcode).name
    except ValueError:
        return f"signal {-exitcode}"


class TrainguardAgent(LocalElasticAgent):
    def __init__(
        self,
        spec: WorkerSpec,
        *,
        run_dir: Path,
        bus: EventBus,
        monitors: list[Monitor],
        pool: WorkerPool,
        target: Target,
        options: Any,
        tee_ranks: set[int] | None = None,
        exit_barrier_timeout: float = 300,
        stop_timeout: int = 15,
    ) -> None:
        super().__init__(spec, RunDirLogsSpecs(run_dir), exit_barrier_timeout=exit_barrier_timeout)
        self.run_dir = run_dir
        self.bus = bus
        self.monitors = monitors
        self.pool = pool
        self.target = target
        self.options = options
        self.tee_ranks = tee_ranks
        self.stop_timeout = stop_timeout
        self.steps = StepTracker()
        self.attempt = -1  # every (re)start, membership changes included
        self.ctx: MonitorContext | None = None
        self.restart_reason = "worker failure"
        self.final_failures: dict[int, dict[str, Any]] = {}
        self.stop_decision: Decision | None = None
        self._worker_store: TCPStore | None = None
        self._monitor_errors: set[tuple[str, str]] = set()
        self._last_leave_check = 0.0

    # ---- rendezvous -------------------------------------------------------------------------
    def _rendezvous(self, worker_group: WorkerGroup) -> None:
        super()._rendezvous(worker_group)
        if worker_group.spec.rdzv_handler.use_agent_store:
            self._fresh_worker_store(worker_group)

    def _fresh_worker_store(self, wg: WorkerGroup) -> None:
        """Give this round's workers a store no earlier round has written to."""
        store = wg.store
        assert store is not None
        if wg.group_rank == 0:
            old, self._worker_store = self._worker_store, None
            del old  # stops the previous round's server
            self._worker_store = TCPStore(
                host_name=wg.master_addr, port=0, is_master=True, wait_for_workers=False, use_libuv=True
            )
            store.set(WORKER_STORE_KEY, str(self._worker_store.port))
        wg.master_port = int(store.get(WORKER_STORE_KEY).decode())

    def _initialize_workers(self, worker_group: WorkerGroup) -> None:
        while True:
            self._rendezvous(worker_group)
            decision = self._before_start(worker_group)
            if decision is None:
                break
            self._record_decision(decision)
            if decision.action == Action.RERENDEZVOUS:
                continue
            if decision.action == Action.EXCLUDE_NODE:
                self._leave(decision)
            if decision.action == Action.STOP_JOB:
                raise JobStopped(decision)
        worker_ids = self._start_workers(worker_group)
        for local_rank, w_id in worker_ids.items():
            worker_group.workers[local_rank].id = w_id
        worker_group.state = WorkerState.HEALTHY

    # ---- starting workers -------------------------------------------------------------------
    def _context(self, wg: WorkerGroup, workers: list[WorkerInfo]) -> MonitorContext:
        return MonitorContext(
            run_dir=self.run_dir,
            node=self.bus.node,
            node_rank=wg.group_rank or 0,
            nnodes=wg.group_world_size or 1,
            nproc_per_node=wg.spec.local_world_size,
            world_size=wg.workers[0].world_size if wg.workers else 0,
            restart_count=self.attempt,
            workers=workers,
            events=self.bus,
            steps=self.steps,
            store=wg.store,
            options=self.options,
        )

    def _before_start(self, wg: WorkerGroup) -> Decision | None:
        self.attempt += 1
        ctx = self._context(wg, [])
        for m in self.monitors:
            decision = self._call(m, "on_before_start", ctx)
            if decision is not None:
                return decision
        return None

    def _worker_env(self, wg: WorkerGroup, worker, restart_count: int) -> dict[str, str]:
        spec = wg.spec
        env = {
            "RANK": str(worker.global_rank),
            "GROUP_RANK": str(wg.group_rank),
            "ROLE_RANK": str(worker.role_rank),
            "ROLE_NAME": spec.role,
            "LOCAL_WORLD_SIZE": str(spec.local_world_size),
            "WORLD_SIZE": str(worker.world_size),
            "GROUP_WORLD_SIZE": str(wg.group_world_size),
            "ROLE_WORLD_SIZE": str(worker.role_world_size),
            "MASTER_ADDR": wg.master_addr,
            "MASTER_PORT": str(wg.master_port),
            "TORCHELASTIC_RESTART_COUNT": str(restart_count),
            "TORCHELASTIC_MAX_RESTARTS": str(spec.max_restarts),
            "TORCHELASTIC_RUN_ID": spec.rdzv_handler.get_run_id(),
            "TORCHELASTIC_USE_AGENT_STORE": str(spec.rdzv_handler.use_agent_store),
            "TORCH_NCCL_ASYNC_ERROR_HANDLING": os.getenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"),
            "TRAINGUARD_RUN_DIR": str(self.run_dir),
            "TRAINGUARD_RESTART_COUNT": str(self.attempt),
            "TRAINGUARD_NODE": self.bus.node,
        }
        self._set_local_rank_env(env, worker.local_rank, spec)
        if "OMP_NUM_THREADS" in os.environ:
            env["OMP_NUM_THREADS"] = os.environ["OMP_NUM_THREADS"]
        for m in self.monitors:
            env.update(self._call(m, "worker_env", self.run_dir) or {})
        return env

    def _start_workers(self, worker_group: WorkerGroup) -> dict[int, Any]:
        spec = worker_group.spec
        restart_count = spec.max_restarts - self._remaining_restarts
        envs, args = {}, {}
        for worker in worker_group.workers:
            envs[worker.local_rank] = self._worker_env(worker_group, worker, restart_count)
            args[worker.local_rank] = tuple(macros.substitute(list(spec.args), str(worker.local_rank)))
        self._pcontext = TrainguardPContext(
            name=spec.role,
            target=self.target,
            args=args,
            envs=envs,
            logs_specs=self._logs_specs,  # type: ignore[arg-type]
            pool=self.pool,
            tee_ranks=self.tee_ranks,
        )
        self._pcontext.start()
        pids = self._pcontext.pids()
        workers = [WorkerInfo(w.local_rank, w.global_rank, pids[w.local_rank]) for w in worker_group.workers]
        self.ctx = self._context(worker_group, workers)
        self.steps.clear()
        self.bus.emit(
            "job_started",
            f"attempt {self.attempt}: {len(workers)} worker(s) started on {self.bus.node} "
            f"(node {worker_group.group_rank}/{worker_group.group_world_size}, world size {worker_group.workers[0].world_size})",
            evidence={
                "attempt": self.attempt,
                "restart_count": restart_count,
                "max_restarts": spec.max_restarts,
                "pids": {str(w.global_rank): w.pid for w in workers},
                "group_rank": worker_group.group_rank,
                "group_world_size": worker_group.group_world_size,
                "master": f"{worker_group.master_addr}:{worker_group.master_port}",
                "logs": str(self.run_dir / "logs" / f"attempt-{self.attempt}"),
            },
        )
        for m in self.monitors:
            self._call(m, "on_workers_started", self.ctx)
        return pids

    def _stop_workers(self, worker_group: WorkerGroup) -> None:
        if self.ctx is not None:
            for m in self.monitors:
                self._call(m, "on_workers_stopped", self.ctx)
        self._shutdown(timeout=self.stop_timeout)

    def _restart_workers(self, worker_group: WorkerGroup) -> None:
        restart_count = worker_group.spec.max_restarts - self._remaining_restarts
        membership = worker_group.state == WorkerState.HEALTHY  # elastic restarts healthy groups for new rounds
        reason = "another node restarted or joined: new rendezvous round" if membership else self.restart_reason
        what = "new round, no restart used" if membership else f"restart {restart_count}/{worker_group.spec.max_restarts}"
        self.bus.emit(
            "restart",
            f"restarting workers ({what}): {reason}",
            severity=Severity.WARNING,
            evidence={
                "restart_count": restart_count,
                "max_restarts": worker_group.spec.max_restarts,
                "reason": reason,
                "membership_change": membership,
            },
        )
        self.restart_reason = "worker failure"
        super()._restart_workers(worker_group)

    # ---- monitoring -------------------------------------------------------------------------
    def _monitor_workers(self, worker_group: WorkerGroup) -> RunResult:
        result = super()._monitor_workers(worker_group)
        if result.state == WorkerState.HEALTHY:
            return self._poll_monitors(worker_group, result)
        if result.state == WorkerState.FAILED:
            return self._on_failure(worker_group, result)
        return result

    def _poll_monitors(self, wg: WorkerGroup, result: RunResult) -> RunResult:
        if self.ctx is None:
            return result
        peer = self._peer_news(wg)
        if peer is not None:
            return peer
        for m in self.monitors:
            decision = self._call(m, "poll", self.ctx)
            if decision is None or decision.action == Action.CONTINUE:
                continue
            if decision.action == Action.EXCLUDE_NODE:
                min_nodes = policy.min_nodes_of(getattr(self.options, "nnodes", None), wg.group_world_size or 1)
                decision = policy.confirm_exclusion(decision, wg.group_world_size or 1, min_nodes)
            self._record_decision(decision)
            if decision.action == Action.CONTINUE:
                continue
            if decision.action == Action.EXCLUDE_NODE:
                self._leave(decision)
            if decision.action == Action.STOP_JOB:
                self._stop_everywhere(decision)
            self.restart_reason = decision.reason
            return RunResult(state=WorkerState.FAILED)
        return result

    def _peer_news(self, wg: WorkerGroup, force: bool = False) -> RunResult | None:
        """Another agent stopped the job or left it: act on it (checked about once a second)."""
        now = time.monotonic()
        if wg.store is None or (wg.group_world_size or 1) == 1:
            return None
        if not force and now - self._last_leave_check < 1.0:
            return None
        self._last_leave_check = now
        try:
            if wg.store.check([STOP_KEY]):
                reason = wg.store.get(STOP_KEY).decode(errors="replace")
                self.stop_decision = Decision(Action.STOP_JOB, reason, source="peer")
                self._remaining_restarts = 0
                return RunResult(state=WorkerState.FAILED)
            if wg.store.check([LEAVING_KEY]):
                self.restart_reason = f"node {wg.store.get(LEAVING_KEY).decode(errors='replace')} left the job"
                self._remaining_restarts += 1  # a membership change does not use the restart budget
                return RunResult(state=WorkerState.UNHEALTHY)
        except Exception:  # the store host may be gone; elastic's own failure handling takes over
            return None
        return None

    def _stop_everywhere(self, decision: Decision) -> None:
        """The policy stopped the job: stop here, and tell the other agents so they stop too."""
        self.stop_decision = decision
        self._remaining_restarts = 0
        store = self._worker_group.store
        if store is not None and (self._worker_group.group_world_size or 1) > 1:
            try:
                store.set(STOP_KEY, f"{decision.reason} (decided on {self.bus.node})")
            except Exception as exc:
                log.warning("could not tell the other agents to stop: %s", exc)

    def _leave(self, decision: Decision) -> None:
        # Tell the others first: their workers fail as soon as ours are stopped, and that
        # failure must read as a membership change, not spend their restart budget.
        self.announce_leaving()
        self._leave_rendezvous()
        raise NodeExcluded(decision)

    def _leave_rendezvous(self) -> None:
        """Leave the c10d rendezvous without closing it for the others: stop this node's heartbeat
        and drop it from the participants (what ``next_rendezvous`` does first), so the next round
        forms without waiting for it. torch has no public "leave" call; without these internals the
        others only drop this node once its heartbeat times out."""
        handler = self._worker_group.spec.rdzv_handler
        stop = getattr(handler, "_stop_heartbeats", None)
        run = getattr(getattr(handler, "_op_executor", None), "run", None)
        if stop is None or run is None:
            return
        try:
            from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _RendezvousExitOp

            stop()
            run(_RendezvousExitOp(), time.monotonic() + 30)
        except Exception as exc:
            log.warning("could not leave the rendezvous cleanly: %s", exc)

    def announce_leaving(self) -> None:
        """Tell the other agents this node leaves, so they re-form without using a restart."""
        store = self._worker_group.store
        if store is None:
            return
        try:
            store.set(LEAVING_KEY, self.bus.node)
        except Exception as exc:
            log.warning("could not announce leaving: %s", exc)

    def _failure_info(self, wg: WorkerGroup, result: RunResult) -> dict[int, dict[str, Any]]:
        infos = {}
        logs = self._pcontext.rank_logs if isinstance(self._pcontext, TrainguardPContext) else {}
        primary = getattr(self._pcontext, "primary_failures", None)
        exit_times = getattr(self._pcontext, "exit_times", {})
        for rank, failure in result.failures.items():
            data = failure.error_file_data if isinstance(failure.error_file_data, dict) else None
            if not failure.error_file or not os.path.exists(failure.error_file):
                data = None  # torch fills in a placeholder ({"message": "<NONE>"}) when there is no file
            infos[rank] = {
                "local_rank": failure.local_rank,
                "pid": failure.pid,
                "exitcode": failure.exitcode,
                "signal": _signal_name(failure.exitcode),
                "error_file_data": data or None,
                "message": failure.message if data else None,
                "timestamp": failure.timestamp,
                "exit_time": exit_times.get(failure.local_rank),
                "log_tail": tail(logs.get(rank)),
                # stopped by the agent after another rank failed: a consequence, not a cause
                "collateral": primary is not None and failure.local_rank not in primary,
            }
        return infos

    @staticmethod
    def _cascade(info: dict[str, Any]) -> bool:
        """A failure that only reports losing a peer (which failed before it)."""
        text = "\n".join([str(info.get("message") or ""), *info.get("log_tail", [])[-15:]])
        return bool(PEER_LOSS.search(text))

    def _on_failure(self, wg: WorkerGroup, result: RunResult) -> RunResult:
        everything = self._failure_info(wg, result)
        failures = {r: i for r, i in everything.items() if not i["collateral"]} or everything
        order = sorted(failures, key=lambda r: failures[r]["exit_time"] or failures[r]["timestamp"])
        # After the first failure, ranks that died of losing their peer are its consequence.
        order = order[:1] + [r for r in order[1:] if not self._cascade(failures[r])]
        failures = {r: {**failures[r], "first_failure": i == 0} for i, r in enumerate(order)}  # first one first
        stopped = sorted(set(everything) - set(failures))
        # Even our first failure only lost its peer: the real failure is on another node.
        remote = bool(order) and self._cascade(failures[order[0]])
        for rank, info in failures.items():
            how = f"signal {info['signal']}" if info["signal"] else f"exit code {info['exitcode']}"
            tail = f"; stopped ranks {stopped}" if stopped else ""
            self.bus.emit(
                "worker_lost_peer" if remote else "worker_failed",
                f"rank {rank} (pid {info['pid']}) exited with {how} after losing a peer on another node{tail}"
                if remote
                else f"rank {rank} (pid {info['pid']}) failed with {how}{tail}",
                severity=Severity.WARNING if remote else Severity.ERROR,
                rank=rank,
                evidence={**info, "attempt": self.attempt, "stopped_ranks": stopped},
            )
        self.final_failures = failures
        if self._peer_news(wg, force=True) is not None:
            return result
        if self.ctx is not None:
            self.ctx.extra.clear()
            for m in self.monitors:
                self._call(m, "on_workers_failed", self.ctx, failures)
        extra = self.ctx.extra if self.ctx is not None else {}
        decision = self._decide(failures, extra)
        self._record_decision(decision)
        if decision.action == Action.EXCLUDE_NODE:
            self._leave(decision)
        if decision.action == Action.STOP_JOB:
            self._stop_everywhere(decision)
        self.restart_reason = decision.reason
        return result

    def _decide(self, failures: dict[int, dict[str, Any]], extra: dict[str, Any]) -> Decision:
        decide = getattr(policy, "decide_on_failure", None)
        try:
            if decide is not None:
                return decide(failures, self._remaining_restarts, extra.get("diagnosis"), extra.get("hardware"))
            return policy.on_worker_failure(failures, self._remaining_restarts, extra.get("diagnosis"))
        except Exception as exc:  # the policy failing must not take the job with it: default to restart
            log.exception("policy failed")
            return Decision(Action.RESTART, f"policy error ({exc}); default restart", source="agent")

    def _record_decision(self, d: Decision) -> None:
        sev = {Action.CONTINUE: Severity.INFO, Action.RERENDEZVOUS: Severity.INFO, Action.RESTART: Severity.WARNING}.get(
            d.action, Severity.ERROR
        )
        self.bus.emit(
            "policy_decision",
            f"{d.action.value}: {d.reason}",
            severity=sev,
            rank=d.rank,
            evidence={"action": d.action.value, "reason": d.reason, "source": d.source, **d.evidence},
        )

    def _call(self, monitor: Monitor, hook: str, *args: Any) -> Any:
        try:
            return getattr(monitor, hook)(*args)
        except Exception as exc:  # a monitor can never kill the job
            key = (monitor.name, hook)
            if key not in self._monitor_errors:
                self._monitor_errors.add(key)
                log.exception("monitor %s.%s failed", monitor.name, hook)
                self.bus.emit(
                    "monitor_error",
                    f"monitor {monitor.name} failed in {hook}: {exc!r}",
                    severity=Severity.WARNING,
                    evidence={"monitor": monitor.name, "hook": hook, "error": repr(exc)},
                )
            return None

    def close(self) -> None:
        for m in self.monitors:
            self._call(m, "close")
        self._worker_store = None
