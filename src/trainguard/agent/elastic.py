"""trainguard's agent: torch elastic's LocalElasticAgent plus monitors, policy and events.

What it changes, each through the agent's documented extension points:
- ``_rendezvous``: a fresh TCPStore for the workers of every round. torch's agent reuses one store
  across restarts, so restarted gloo ranks read the dead ranks' old addresses (pytorch#135712).
  The round's agents also agree on distinct node names there (agent/node_names.py).
- ``_start_workers``/``_restart_workers``: the workers' TORCHELASTIC_RESTART_COUNT is counted as
  torchrun counts it, apart from trainguard's restart budget (``counts_as_torchrun_restart``).
- ``_initialize_workers``: before workers start, the monitors' pre-start outcome goes to the policy.
- ``_start_workers``: workers come from pre-started processes with torch already imported, and
  their output is logged per rank with timestamps.
- ``_monitor_workers``: monitors' evidence (hang, straggler, hardware) and worker failures go to
  the policy (``trainguard.policy``); ``carry_out`` does what it decided: continue, restart,
  exclude this node, or stop the job everywhere.

Failure collection and ordering live in spawn/failures.py, messages to the other agents in
cluster/peers.py, private torch internals in trainguard/torch_compat.py. Everything the agent and
its monitors read from the rendezvous store goes through ``Peers.signed`` (cluster/stores.py
``SignedStore``): a value no agent of this job wrote is reported (``store_write_rejected``) and
never acted on.
"""

from __future__ import annotations

import logging
import os
import secrets
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch.distributed.elastic.agent.server.api import RunResult, WorkerGroup, WorkerSpec, WorkerState
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.multiprocessing.api import LogsSpecs
from torch.distributed.elastic.utils import macros

from trainguard import policy, stopsignal, torch_compat
from trainguard.agent import file_timer
from trainguard.agent import node_names as names
from trainguard.agent import standby as standby_node
from trainguard.agent.nantriage import NanTriage, last_steps
from trainguard.cluster import exchange, runs
from trainguard.cluster.node_history import (
    NAN_TRANSIENT,
    HistorySettings,
    HistoryUnavailable,
    NodeHistory,
    path_for,
)
from trainguard.cluster.peers import Peers
from trainguard.cluster.stores import ForgedValue, JobKey, Rejections, bound_store, can_connect
from trainguard.diagnose.steplog import parse_step
from trainguard.events import EventBus, Severity
from trainguard.evidence import AttemptRecord, NodeLost, PeerStop, RankFailure
from trainguard.monitors.api import Monitor, MonitorContext, MonitorSet, StepTracker, WorkerInfo
from trainguard.policy import Action, Decision, PolicySettings
from trainguard.probes import identity
from trainguard.spawn import daemons, failures
from trainguard.spawn.pcontext import RunDirLogsSpecs, Target, TrainguardPContext
from trainguard.spawn.pool import WorkerPool

log = logging.getLogger(__name__)
STOP_SIGNAL_GRACE_S = 3.0  # how long workers' stop-signal deaths wait for the agent's own signal

WORKER_STORE_KEY = "trainguard/worker_store"
ROUND_ATTEMPT_KEY = "trainguard/round-attempt"  # the attempt node rank 0 starts in this round (a promoted standby takes it)
LAST_CALL_AFTER_CHANGE_S = 1.0  # the round after a node left or was lost waits this long for more nodes
WORKER_STORE_WAIT_S = 60.0  # how long a node waits for node rank 0 to publish the workers' store (then the store's own wait)
REACH_TIMEOUT_S = 10.0  # a node that cannot open a connection to the workers' store in this long cannot train


class NodesUnreachable(Exception):
    """This node cannot reach the address another node gave its workers: the job cannot train."""


class DuplicateNodeName(NodesUnreachable):
    """Another agent of this job goes by this node's name: their events, locks, exclusions and
    Slurm drains would be mixed up, so the job does not start."""


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


_SEVERITY = {Action.CONTINUE: Severity.INFO, Action.RERENDEZVOUS: Severity.INFO, Action.RESTART: Severity.WARNING}


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
        policy_settings: PolicySettings,
        rdzv_backend: str = "",
        advertise_addr: str = "127.0.0.1",
        job_key: JobKey | None = None,
        tee_ranks: set[int] | None = None,
        exit_barrier_timeout: float = 300,
        stop_timeout: int = 15,
        torch_logs: LogsSpecs | None = None,
        node_history: HistorySettings | None = None,
        standby: bool = False,
        node_name_given: bool = True,
    ) -> None:
        self.logs = RunDirLogsSpecs(run_dir, torch_logs)
        super().__init__(spec, self.logs, exit_barrier_timeout=exit_barrier_timeout)
        self.run_dir = run_dir
        self.bus = bus
        self.monitors = MonitorSet(monitors, bus)
        self.pool = pool
        self.target = target
        self.policy_settings = policy_settings
        # the site's node history (cluster/node_history.py): None once it failed (said once)
        self.history: NodeHistory | None = NodeHistory(path_for(node_history.path, run_dir)) if node_history else None
        self.rdzv_backend = rdzv_backend
        self.tee_ranks = tee_ranks
        self.stop_timeout = stop_timeout
        self.advertise_addr = advertise_addr
        self.job_key = job_key or JobKey.for_job(spec.rdzv_handler.get_run_id(), single_node=True)
        self.peers = Peers(bus.node, self.job_key, on_rejected=Rejections(self._rejected_write))
        # torch's per-round shared store (unused by our workers) would listen on every interface
        torch_compat.bind_rendezvous_shared_store(spec.rdzv_handler, lambda addr, port: bound_store(self.advertise_addr, port))
        torch_compat.cheap_rendezvous_records()  # a restart's rendezvous round in ms, not tens of ms
        torch_compat.no_restart_for_a_full_round(spec.rdzv_handler)  # standbys: no restart loop
        self.steps = StepTracker()
        self.attempt = -1  # every (re)start, membership changes included; numbered across the run dir's runs
        self.run_info: runs.RunInfo | None = None  # this run of the run dir (see cluster/runs.py)
        self.ctx: MonitorContext | None = None
        self.procs: TrainguardPContext | None = None
        self.restart_reason = "worker failure"
        self.new_round = False  # the policy decided RERENDEZVOUS: the coming restart uses no budget
        self.workers_failed = False  # this attempt's workers failed (not stopped running by a decision)
        # the workers' TORCHELASTIC_RESTART_COUNT: torchrun's count, kept apart from the budget
        # (see counts_as_torchrun_restart)
        self.torchelastic_restarts = 0
        self.final_failures: dict[int, RankFailure] = {}
        self.attempts: list[AttemptRecord] = []  # this node's failed attempts, for the restart-loop guard
        self.stop_decision: Decision | None = None
        self._worker_store: Any = None
        self._last_call_s: float | None = None  # the user's last call while a shorter one is set
        self._warmed = False
        self._agent_id = secrets.token_hex(4)  # tells two agents under one --node-name apart
        self.node_name_given = node_name_given  # --node-name (or the scheduler's): never changed
        self.node_name_decided = False  # a default name is decided at the first multi-node round, then kept
        self.nan = NanTriage(run_dir, bus.node, policy_settings.nan_replays)
        self.standby = standby  # --standby: waits beside the job until a node is lost (agent/standby.py)
        self.standby_waiting = standby  # not yet promoted into a round

    # ---- carrying out decisions ---------------------------------------------------------------
    def carry_out(self, d: Decision, *, before_start: bool = False, made_here: bool = True) -> None:
        """Do what the policy decided, after recording it (``policy_decision``) when this node
        decided it (a peer's decision was recorded where it was made).

        CONTINUE: nothing. RESTART: the caller reports the group failed and torch elastic restarts
        it (using the budget). RERENDEZVOUS: before start, the caller rendezvouses again; while
        running (a peer left), the restart that follows does not use the budget. EXCLUDE_NODE: tell
        the other agents, leave the rendezvous, raise NodeExcluded. STOP_JOB: before start, raise
        JobStopped; while running, no restarts are left, and the other agents are told to stop."""
        if made_here:
            self.record(d)
        if made_here and d.source == "restart_loop":
            self._record_loop(d)
        if made_here:
            self._remember(d)
        if d.action == Action.CONTINUE:
            return
        if d.action == Action.EXCLUDE_NODE:
            # Tell the others first: their workers fail as soon as ours are stopped, and that
            # failure must read as a membership change, not spend their restart budget.
            wg = self.get_worker_group()
            self.peers.announce_leaving(wg.store)
            self.peers.leave_rendezvous(wg.spec.rdzv_handler)
            raise NodeExcluded(d)
        if before_start:
            if d.action == Action.STOP_JOB:
                raise JobStopped(d)
            return
        self.restart_reason = d.reason
        if d.action == Action.STOP_JOB:
            self.stop_decision = d
            torch_compat.set_remaining_restarts(self, 0)
            if made_here:
                wg = self.get_worker_group()
                self.peers.stop_everywhere(wg.store, wg.group_world_size or 1, d.reason)
        elif d.action == Action.RESTART and d.source == "nan_triage":  # the replay is a check, not a retry
            torch_compat.set_remaining_restarts(self, torch_compat.remaining_restarts(self) + 1)
        elif d.action == Action.RERENDEZVOUS:  # a membership change does not use the restart budget
            torch_compat.set_remaining_restarts(self, torch_compat.remaining_restarts(self) + 1)
            self.new_round = True
            if made_here and d.source == "node_lost":  # the other survivors go along without a restart
                for node in d.evidence.get("nodes", {}):
                    self.peers.announce_leaving(self.get_worker_group().store, node)
            self._reform_without(d.evidence.get("rdzv_nodes", []), frees_place=not d.evidence.get("membership_change"))

    def _reform_without(self, lost: list[str], frees_place: bool = True) -> None:
        """Make the next round form at once: drop vanished nodes from the rendezvous now (torch
        would wait for their keep-alive to expire) and wait only LAST_CALL_AFTER_CHANGE_S for nodes
        beyond --nnodes MIN (torch's default last call is 30 s) in that round. A node gone for good
        (lost, left, excluded; not a peer that only moved on to a new round) frees its place: the
        standbys are told, so one joins that round (agent/standby.py)."""
        handler = self.get_worker_group().spec.rdzv_handler
        if frees_place:
            self._say_freed(handler, lost)
        for node in lost:
            try:
                torch_compat.expire_rendezvous_node(handler, node)
            except Exception as exc:  # torch's keep-alive timeout drops it later
                log.warning("could not drop node %s from the rendezvous: %s", node, exc)
        before = torch_compat.set_last_call(handler, LAST_CALL_AFTER_CHANGE_S)
        if self._last_call_s is None:
            self._last_call_s = before

    def _say_freed(self, handler: Any, lost: list[str]) -> None:
        try:
            round_number = torch_compat.rendezvous_round_number(handler)
            base = torch_compat.rendezvous_base_store(handler, None)
            if round_number is not None and base is not None:
                standby_node.say_freed(self.peers.signed(base), round_number, lost)
        except Exception as exc:  # the store host may be what was lost: a standby's grace lets it in
            log.warning("could not tell the standbys a place is free: %s", exc)

    def _remember(self, d: Decision) -> None:
        """Put a hardware-class fault, an exclusion or a restart loop of this host in the site's
        node history; a history that cannot be written is said once and left alone."""
        kind = policy.history_kind(d)
        if kind is not None:
            self._history_record(kind, d.reason)

    def _history_record(self, kind: str, detail: str) -> None:
        if self.history is None:
            return
        try:
            self.history.record(self.bus.node, kind, detail, str(self.run_dir))
        except HistoryUnavailable as exc:
            print(f"trainguard: {exc}", file=sys.stderr, flush=True)
            log.warning("%s", exc)
            self.history = None

    def _record_loop(self, d: Decision) -> None:
        loop = d.evidence.get("restart_loop", {})
        self.bus.emit("restart_loop", d.reason, severity=Severity.CRITICAL, rank=d.rank,
                      evidence={"action": d.action.value, **loop, "tried": d.evidence.get("tried"),
                                "remaining_restarts": d.evidence.get("remaining_restarts")})

    def record(self, d: Decision) -> None:
        self.bus.emit(
            "policy_decision",
            f"{d.action.value}: {d.reason}",
            severity=_SEVERITY.get(d.action, Severity.ERROR),
            rank=d.rank,
            evidence={"action": d.action.value, "reason": d.reason, "source": d.source, **d.evidence},
        )

    # ---- rendezvous -------------------------------------------------------------------------
    def _rendezvous(self, worker_group: WorkerGroup) -> None:
        handler = worker_group.spec.rdzv_handler
        torch_compat.forget_rendezvous_bootstrap(handler)  # late joiners (see there)
        if self.standby_waiting:
            standby_node.await_formed_round(handler, self.bus.emit, self.bus.node)
        release = self._take_only_a_free_place(handler)
        try:
            # the first join keeps torch's skew between nodes joining at once
            with torch_compat.rendezvous_delays(handler, skip_first_round_delay=self.run_info is not None):
                super()._rendezvous(worker_group)
        finally:
            release()
        self._join_run(worker_group)
        self._claim_node_name(worker_group)
        promoted, self.standby_waiting = self.standby_waiting, False
        if promoted:
            world = worker_group.workers[0].world_size if worker_group.workers else 0
            standby_node.promoted(self.bus.emit, self.bus.node, worker_group.group_rank or 0,
                                  worker_group.group_world_size or 1, world)
        if self._last_call_s is not None:  # a round after a membership change has formed: back to the user's wait
            torch_compat.set_last_call(worker_group.spec.rdzv_handler, self._last_call_s)
            self._last_call_s = None
        if worker_group.spec.rdzv_handler.use_agent_store:
            self._fresh_worker_store(worker_group)
            if promoted:
                self._take_round_attempt(worker_group)

    def _take_only_a_free_place(self, handler: Any) -> Callable[[], None]:
        """A node waiting beside a full round (a standby; a node lost that came back) takes a place
        only when one is free for good, not a participant's for the moment of a whole-job restart
        (agent/standby.py). A participant rejoining its own round is never on that list: no-op."""
        base = torch_compat.rendezvous_base_store(handler, None)
        signed = self.peers.signed(base) if base is not None else None
        vacancy = standby_node.Vacancy(lambda r: signed is not None and standby_node.freed(signed, r))
        return torch_compat.hold_on_redundancy_list(handler, vacancy)

    def _join_run(self, wg: WorkerGroup) -> None:
        """The first round makes this node part of a run: its attempts continue the run dir's numbering."""
        first = self.run_info is None
        base = torch_compat.rendezvous_base_store(wg.spec.rdzv_handler, wg.store)
        signed = self.peers.signed(base) if base is not None else None
        self.run_info = runs.agree(signed, self.run_dir, self.run_info, wg.spec.rdzv_handler.get_run_id())
        if first:
            self.attempt = self.run_info.first_attempt - 1  # _before_start counts the first attempt
            log.info("run %s: attempts from %d (logs/attempt-%d)", self.run_info.run_id, self.run_info.first_attempt,
                     self.run_info.first_attempt)

    def _claim_node_name(self, wg: WorkerGroup) -> None:
        """Agree with the round's other agents on distinct node names (agent/node_names.py): a
        default name taken by another agent becomes ``<host>-2``, ``<host>-3``...; one given name
        on two agents stops the job on every agent, each saying which agents collide."""
        nnodes = wg.group_world_size or 1
        if wg.store is None or nnodes <= 1:  # nobody to collide with: the name stands
            self.node_name_decided = True
            return
        scope = exchange.scope(_Round(self.attempt + 1, self.rdzv_backend))  # static: one store for every round
        mine = names.Claim(wg.group_rank or 0, self.bus.node, socket.gethostname(), self.node_name_given,
                           self.node_name_decided, f"host {socket.gethostname()}, pid {os.getpid()}, agent {self._agent_id}")
        try:
            claims = names.exchange_claims(self.peers.signed(wg.store), wg.store, mine, nnodes, scope, WORKER_STORE_WAIT_S,
                                           lambda: self._raise_if_stopped(wg.store, nnodes))  # fmt: skip
        except NodesUnreachable:
            raise
        except Exception as exc:  # the store is failing: the rendezvous' own error handling takes over
            log.debug("could not claim the node name: %s", exc)
            return
        assigned, collisions = names.assign([*[c for c in claims if c.rank != mine.rank], mine])
        if collisions:
            names.await_readers(wg.store, nnodes, scope)
            raise DuplicateNodeName(collisions[0].message())
        self.node_name_decided = True
        if assigned[mine.rank] != self.bus.node:
            self._rename(assigned[mine.rank])

    def _raise_if_stopped(self, store: Any, nnodes: int) -> None:
        """Another agent stopped the job before the workers started: said at once, not after a wait."""
        news = self.peers.news(store, nnodes, force=True)
        if isinstance(news, PeerStop):
            raise NodesUnreachable(f"stopped by another node before the workers started: {news.reason}")

    def _rename(self, name: str) -> None:
        """Go by ``name`` from now on: its events, its peers' messages, the NaN triage. The run
        dir's lock and event database keep the name they were opened under: the run dir is this
        agent's alone (agents sharing one already got distinct names from its locks)."""
        log.info("node %s: another agent of this job goes by %s; this one is %s (give --node-name to choose)",
                 self.bus.node, self.bus.node, name)
        self.bus.node = name
        self.peers.node = name
        self.nan.node = name

    @property
    def restarts_this_run(self) -> int:
        """Attempts of this run before the current one (what a fresh run dir numbers its attempts)."""
        return self.attempt - (self.run_info.first_attempt if self.run_info else 0)

    def _fresh_worker_store(self, wg: WorkerGroup) -> None:
        """Give this round's workers a store no earlier round has written to, listening on the
        address the other nodes reach this one through (never every interface), and check that
        this node reaches it: nodes that cannot reach each other fail now, with their addresses
        named, instead of waiting in init_process_group."""
        store = wg.store
        assert store is not None
        signed = self.peers.signed(store)
        if wg.group_rank == 0:
            old, self._worker_store = self._worker_store, None
            del old  # stops the previous round's server
            self._worker_store = bound_store(self.advertise_addr)
            where = f"{self.advertise_addr}:{self._worker_store.port}"
            signed.set(ROUND_ATTEMPT_KEY, str(self.attempt + 1))  # before the address the others wait for
            signed.set(WORKER_STORE_KEY, where)
        self._await_worker_store(store, wg.group_world_size or 1)
        try:
            where = signed.get(WORKER_STORE_KEY).decode()
        except ForgedValue:
            raise NodesUnreachable("the workers' store address in the rendezvous store is not signed by this job") from None
        addr, _, port = where.rpartition(":")
        wg.master_addr, wg.master_port = addr, int(port)
        if wg.group_rank != 0:
            why = can_connect(addr, int(port), REACH_TIMEOUT_S)
            if why is not None:
                msg = (
                    f"node {self.bus.node} cannot reach the workers' store at {where} on node rank 0 ({why}): "
                    f"the nodes cannot reach each other at these addresses; give each node "
                    f"--local-addr with an address the others reach"
                )
                self.peers.stop_everywhere(store, wg.group_world_size or 1, msg)
                raise NodesUnreachable(msg)

    def _take_round_attempt(self, wg: WorkerGroup) -> None:
        """A promoted standby numbers its first attempt as the round's (node rank 0's), not as the
        run's first: in a shared run dir its logs then go to the round's ``logs/attempt-<n>``,
        never into the lost node's files of an earlier attempt under the same rank."""
        try:
            theirs = int(self.peers.signed(wg.store).get(ROUND_ATTEMPT_KEY))
        except Exception as exc:  # an older agent at rank 0, or a forged value: keep the run's numbering
            log.warning("standby %s: the round's attempt number is not known (%s)", self.bus.node, exc)
            return
        self.attempt = max(self.attempt, theirs - 1)  # _before_start counts it

    def _await_worker_store(self, store: Any, nnodes: int) -> None:
        """Wait for node rank 0 to publish the workers' store, unless another agent stops the job
        first (it found two agents under one name, or cannot reach us): said at once, not after
        the store's timeout."""
        deadline = time.monotonic() + WORKER_STORE_WAIT_S
        while not store.check([WORKER_STORE_KEY]) and time.monotonic() < deadline:
            self._raise_if_stopped(store, nnodes)
            time.sleep(0.1)

    def _timer_expired(self, pid: int, scope: str, sig: int) -> None:
        """A worker overran its own ``torch.distributed.elastic.timer`` (it said how long it may take)."""
        rank = next((w.global_rank for w in (self.ctx.workers if self.ctx else []) if w.pid == pid), None)
        self.bus.emit(
            "worker_timer_expired",
            f"rank {rank} (pid {pid}) overran its elastic timer {scope!r}: killed with signal {sig}",
            severity=Severity.ERROR,
            rank=rank,
            evidence={"pid": pid, "scope": scope, "signal": sig},
        )

    def _rejected_write(self, key: str, value: str) -> None:
        self.bus.emit(
            "store_write_rejected",
            f"ignored {key} in the rendezvous store: not signed by an agent of this job",
            severity=Severity.WARNING,
            evidence={"key": key, "value": value},
        )

    def _initialize_workers(self, worker_group: WorkerGroup) -> None:
        while True:
            self._rendezvous(worker_group)
            decision = self._before_start(worker_group)
            if decision is None:
                break
            self.carry_out(decision, before_start=True)
            if decision.action != Action.RERENDEZVOUS:
                break
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
            store=self.peers.signed(wg.store) if wg.store is not None else None,  # every value signed (cluster/stores.py)
            rdzv_backend=self.rdzv_backend,
            addr=self.advertise_addr,
            rdzv_node=torch_compat.rendezvous_node(wg.spec.rdzv_handler) or "",
            ranks=tuple(w.global_rank for w in wg.workers),
        )

    def _before_start(self, wg: WorkerGroup) -> Decision | None:
        """The first pre-start outcome the policy acts on (None: start the workers)."""
        self.attempt += 1
        ctx = self._context(wg, [])
        nnodes = wg.group_world_size or 1
        for outcome in self.monitors.each("on_before_start", ctx):
            decision = policy.decide_before_start(
                outcome,
                ctx.node_rank,
                nnodes,
                self.policy_settings.min_nodes(nnodes),
                exclude_stragglers=self.policy_settings.node_check_exclude_straggler,
            )
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
            "TRAINGUARD_RUN_ID": self.run_info.run_id if self.run_info else "",
            "TRAINGUARD_ATTEMPT": str(self.attempt),  # logs/attempt-<n>: numbered across the run dir's runs
            "TRAINGUARD_RESTART_COUNT": str(self.restarts_this_run),  # 0 on every run's first attempt
            "TRAINGUARD_NODE": self.bus.node,
        }
        torch_compat.set_local_rank_env(self, env, worker.local_rank, spec)
        if "OMP_NUM_THREADS" in os.environ:
            env["OMP_NUM_THREADS"] = os.environ["OMP_NUM_THREADS"]
        env.update(self.monitors.worker_env(self.run_dir))
        env.update(self.nan.worker_env(self.attempt))
        return env

    def _start_workers(self, worker_group: WorkerGroup) -> dict[int, Any]:
        spec = worker_group.spec
        restart_count = spec.max_restarts - torch_compat.remaining_restarts(self)  # the budget spent
        self.workers_failed = False
        envs, args = {}, {}
        for worker in worker_group.workers:
            envs[worker.local_rank] = self._worker_env(worker_group, worker, self.torchelastic_restarts)
            args[worker.local_rank] = tuple(macros.substitute(list(spec.args), str(worker.local_rank)))
        timers = file_timer.start(envs, lambda: set(self.procs.pids().values()), self._timer_expired)
        torch_compat.start_worker_watchdogs(self, timers)  # torchrun's file timer and health check
        self.procs = TrainguardPContext(
            name=spec.role,
            target=self.target,
            args=args,
            envs=envs,
            logs_specs=self.logs,
            pool=self.pool,
            tee_ranks=self.tee_ranks,
        )
        torch_compat.set_process_context(self, self.procs)  # torch's monitor and shutdown use it
        self.nan.on_start(self.attempt)
        self.procs.start()
        pids = self.procs.pids()
        workers = [WorkerInfo(w.local_rank, w.global_rank, pids[w.local_rank]) for w in worker_group.workers]
        self.ctx = self._context(worker_group, workers)
        self.steps.clear()
        self.bus.emit(
            "job_started",
            f"attempt {self.attempt}: {len(workers)} worker(s) started on {self.bus.node} "
            f"(node {worker_group.group_rank}/{worker_group.group_world_size}, world size {worker_group.workers[0].world_size})",
            evidence={
                "attempt": self.attempt,
                "run_id": self.run_info.run_id if self.run_info else None,
                "first_attempt_of_run": self.run_info.first_attempt if self.run_info else 0,
                "restart_count": restart_count,
                "torchelastic_restart_count": self.torchelastic_restarts,
                "max_restarts": spec.max_restarts,
                "pids": {str(w.global_rank): w.pid for w in workers},
                "identity": identity.record({w.global_rank: w.pid for w in workers}),  # chaos/stacks verify pids
                "group_rank": worker_group.group_rank,
                "group_world_size": worker_group.group_world_size,
                "master": f"{worker_group.master_addr}:{worker_group.master_port}",
                "logs": str(self.run_dir / "logs" / f"attempt-{self.attempt}"),
            },
        )
        self.monitors.notify("on_workers_started", self.ctx)
        if not self._warmed:  # while the workers start, not on the first failure's way to a restart
            self._warmed = True
            threading.Thread(target=failures.warm, name="tg-warm", daemon=True).start()
        return pids

    def _stop_workers(self, worker_group: WorkerGroup) -> None:
        if self.ctx is not None:
            self.monitors.notify("on_workers_stopped", self.ctx)
        self._shutdown(timeout=self.stop_timeout)

    def _shutdown(self, death_sig: signal.Signals = signal.SIGTERM, timeout: int = 30) -> None:
        super()._shutdown(death_sig, timeout)
        self._report_daemons()

    def _report_daemons(self) -> None:
        """Processes the workers left running holding their output (spawn/daemons.py), once."""
        procs = self.procs
        if procs is not None and procs.daemons and not procs.daemons_reported:
            procs.daemons_reported = True
            daemons.report(self.bus, procs.daemons, self.attempt)

    def _restart_workers(self, worker_group: WorkerGroup) -> None:
        restart_count = worker_group.spec.max_restarts - torch_compat.remaining_restarts(self)
        # elastic restarts healthy groups for new rounds; the policy's RERENDEZVOUS (a node lost, a
        # peer that moved on) comes as a failed group whose restart it gave back
        membership = worker_group.state == WorkerState.HEALTHY or self.new_round
        reason = ("another node restarted or joined: new rendezvous round"
                  if worker_group.state == WorkerState.HEALTHY else self.restart_reason)
        what = "new round, no restart used" if membership else f"restart {restart_count}/{worker_group.spec.max_restarts}"
        if self.nan.armed and not membership:
            what = "NaN replay, no restart used"
        if counts_as_torchrun_restart(membership=membership, workers_failed=self.workers_failed):
            self.torchelastic_restarts += 1
        self.bus.emit(
            "restart",
            f"restarting workers ({what}): {reason}",
            severity=Severity.WARNING,
            evidence={
                "restart_count": restart_count,
                "torchelastic_restart_count": self.torchelastic_restarts,  # what the restarted workers get
                "max_restarts": worker_group.spec.max_restarts,
                "reason": reason,
                "membership_change": membership,
            },
        )
        self.restart_reason = "worker failure"
        self.new_round = False
        super()._restart_workers(worker_group)

    # ---- monitoring -------------------------------------------------------------------------
    def _monitor_workers(self, worker_group: WorkerGroup) -> RunResult:
        stopsignal.raise_pending()  # a stop signal swallowed since the last poll (see stopsignal)
        result = super()._monitor_workers(worker_group)
        if result.state == WorkerState.HEALTHY:
            return self._poll_monitors(worker_group, result)
        self._report_daemons()  # the group ended: its pumps were drained, before the job's end is recorded
        if result.state == WorkerState.FAILED:
            return self._on_failure(worker_group, result)
        if result.state == WorkerState.SUCCEEDED and self.procs is not None and self.procs.exit_crashes:
            failures.report_exit_crashes(self.bus, self.procs, self.attempt)
        if result.state == WorkerState.SUCCEEDED and self.nan.replaying(self.attempt):
            self._nan_transient(worker_group)
        return result

    def _follow_peers(self, wg: WorkerGroup, force: bool = False) -> Decision | None:
        """Another agent stopped the job or left it: carry out what that means here."""
        news = self.peers.news(wg.store, wg.group_world_size or 1, force=force)
        if news is None:
            return None
        decision = policy.decide_on_peer_news(news)
        self.carry_out(decision, made_here=False)
        return decision

    def _poll_monitors(self, wg: WorkerGroup, result: RunResult) -> RunResult:
        if self.ctx is None:
            return result
        if self.nan.replaying(self.attempt) and self.nan.past_the_nan(self.steps):
            self._nan_transient(wg)
        peer = self._follow_peers(wg)
        if peer is not None:
            return RunResult(state=WorkerState.UNHEALTHY if peer.action == Action.RERENDEZVOUS else WorkerState.FAILED)
        nnodes = wg.group_world_size or 1
        for evidence in self.monitors.each("poll", self.ctx):
            try:
                standbys = _standbys(wg) if isinstance(evidence, NodeLost) else 0
                decision = policy.decide_while_running(evidence, self.policy_settings, nnodes, standbys)
            except Exception:  # no decision is the safe side while the job runs: keep watching
                log.exception("policy failed on %r", evidence)
                continue
            if decision is None:
                continue
            self.carry_out(decision)
            if decision.action != Action.CONTINUE:
                return RunResult(state=WorkerState.FAILED)
        return result

    def _on_failure(self, wg: WorkerGroup, result: RunResult) -> RunResult:
        self.workers_failed = True  # torchrun restarts this group spending a restart, whatever we decide
        fs = failures.order(failures.collect(result, self.procs), failures.early_exits(result, self.procs))
        failures.report(self.bus, fs, self.attempt)
        self.final_failures = fs.failures
        if failures.stopped_by_signal(fs.failures):
            self._await_own_stop_signal()
        if self._follow_peers(wg, force=True) is not None:
            return result
        found = self.monitors.on_workers_failed(self.ctx, fs.failures) if self.ctx is not None else None
        try:
            if found is not None and found.lost is not None:  # another node vanished: not this node's failure
                nnodes = wg.group_world_size or 1
                self.carry_out(policy.decide_on_node_lost(found.lost, nnodes, self.policy_settings.min_nodes(nnodes),
                                                          _standbys(wg)))
                return result
            decision = self._nan_decision(wg, found) or policy.decide_on_failure(
                fs.failures,
                torch_compat.remaining_restarts(self),
                found.diagnosis if found else None,
                found.hardware if found else None,
                found.hang if found else None,
                new_round_pending=_nodes_waiting(wg) > 0,
                restart_on_error=self.policy_settings.restart_on_error,
            )
        except Exception as exc:  # the policy failing must not take the job with it
            log.exception("policy failed")
            decision = policy.decide_without_policy(exc)
        else:
            decision = self._guard_restart_loop(wg, fs, found, decision)
        self.carry_out(decision)
        return result

    # ---- NaN triage ---------------------------------------------------------------------------
    def _local_ranks(self) -> set[int]:
        return {w.global_rank for w in self.ctx.workers} if self.ctx is not None else set()

    def _nan_decision(self, wg: WorkerGroup, found: Any) -> Decision | None:
        """A NaN failure is replayed once; the replay's failure is judged by the triage. None: the
        failure is not the triage's (decided as any other)."""
        diagnosis = found.diagnosis if found is not None else None
        hardware = found.hardware if found is not None else None
        if self.nan.replaying(self.attempt):
            replay = self.nan.replay_evidence(self.attempt, diagnosis, self._local_ranks())
            first = self.nan.done()
            if replay is None:  # the replay failed otherwise before reaching the NaN: not judged
                return None
            nnodes = wg.group_world_size or 1
            return policy.decide_after_nan_replay(first, replay, hardware, self.bus.node, nnodes,
                                                  self.policy_settings.min_nodes(nnodes))  # fmt: skip
        if found is None or found.hang is not None or not policy.is_nan_failure(diagnosis):
            return None
        if hardware is not None and not hardware.healthy:
            return None  # a located hardware fault: isolated as any other (scenario 3)
        assert diagnosis is not None
        first = self.nan.first_from(diagnosis, self.attempt, self._local_ranks())
        decision = policy.decide_nan_replay(first, self.nan.replays_left)
        if decision is not None:
            self.nan.arm(first, self.steps)
        return decision

    def _nan_transient(self, wg: WorkerGroup) -> None:
        """The replay went past the NaN without one: a transient fault, recorded; training goes on."""
        first = self.nan.done()
        nnodes = wg.group_world_size or 1
        self.carry_out(policy.decide_after_nan_replay(first, None, None, self.bus.node, nnodes,
                                                      self.policy_settings.min_nodes(nnodes)))  # fmt: skip
        evidence = self.nan.transient_evidence(first, self.attempt)
        where = f"rank {first.rank}" + (f" on node {first.node}" if first.node else "")
        self.bus.emit("nan_transient", f"NaN of attempt {first.attempt} did not reproduce in its replay: "
                      f"a transient fault at {where}", severity=Severity.WARNING, rank=first.rank, evidence=evidence)
        if evidence["node"] == self.bus.node:  # the NaN came from this host: the site's history keeps it
            self._history_record(NAN_TRANSIENT, f"a NaN at rank {first.rank} (attempt {first.attempt}) did not come "
                                 f"back in its replay (attempt {self.attempt})")

    def _guard_restart_loop(self, wg: WorkerGroup, fs: failures.FailureSet, found: Any, decision: Decision) -> Decision:
        """Record the failed attempt; a restart that would repeat a restart loop becomes the
        policy's loop decision. The guard failing leaves the failure policy's decision standing."""
        try:
            self.attempts.append(self._attempt_record(wg, fs, found.diagnosis if found else None))
            return policy.guard_restart_loop(decision, self.attempts, self.policy_settings, wg.group_world_size or 1)
        except Exception:
            log.exception("restart-loop guard failed")
            return decision

    def _attempt_record(self, wg: WorkerGroup, fs: failures.FailureSet, diagnosis: Any) -> AttemptRecord:
        """How far the failed attempt got and how it failed, for the restart-loop guard. The step:
        the highest step number the ranks' last log lines print (the job's own numbering, which
        goes on across restarts from a snapshot), else the steps the spans counted this attempt."""
        step, source = steps_in_logs(fs.failures), "log"
        if step is None:
            step = last_steps(self.steps)
            source = "spans"
        own = fs.own  # order() already told which failures only lost a peer
        return AttemptRecord(self.attempt, self.bus.node, policy.failure_kind(fs.failures, diagnosis), step,
                             source if step is not None else "", bool(own), wg.group_world_size or 1, tuple(own))

    def _await_own_stop_signal(self) -> None:
        """The workers died of SIGTERM (or another stop signal): a scheduler stopping the job
        signals every process of it in no order, and this agent's copy may come a moment after
        the workers'. Wait for it (the handler raises SignalException here, and the job is recorded
        as preempted, its snapshots persisted) before treating the deaths as a failure."""
        _wait_for_stop_signal(STOP_SIGNAL_GRACE_S)
        if _scheduler_stops_the_job():
            # Slurm stopping a step does not always reach every process (srun forcing the step's
            # end on another node signalled the workers here, never their agent): the scheduler's
            # own word is the signal, taken the way a delivered one is.
            log.warning("the workers died of a stop signal and the scheduler is ending the job: stopping as signalled")
            os.kill(os.getpid(), signal.SIGTERM)
            _wait_for_stop_signal(STOP_SIGNAL_GRACE_S)

    def close(self) -> None:
        self.monitors.notify("close")
        self._worker_store = None


@dataclass(frozen=True)
class _Round:
    """What exchange.scope reads (a monitor's context has both)."""

    restart_count: int
    rdzv_backend: str


def counts_as_torchrun_restart(*, membership: bool, workers_failed: bool) -> bool:
    """Whether a restart of the worker group adds one to the workers' TORCHELASTIC_RESTART_COUNT.

    torchrun sets it to ``max_restarts - remaining_restarts`` (torch's local_elastic_agent
    ``_start_workers``), and its ``_invoke_run`` takes one from ``remaining_restarts`` only when it
    restarts a FAILED or UNHEALTHY group; a restart for nodes waiting in the rendezvous (a healthy
    group: "membership changes do not count as retries") takes none. trainguard's budget
    (``--max-restarts``) gives some failure restarts back (a NaN replay, a node lost or left) and
    stops healthy workers itself for a new round, so the count is kept apart from it, by torchrun's
    rule: a restart counts when this node's workers failed (whatever the policy then charged), or
    when it spends the budget (a monitor's restart of running workers: a hang); a restart for a new
    round while the workers were running (a node joined, a peer moved on, a node found lost before
    the workers here failed) does not. Counted per agent, from 0 at its first start, as torchrun
    does: a promoted standby's first workers see 0."""
    return workers_failed or not membership


def steps_in_logs(fs: dict[int, RankFailure]) -> int | None:
    """The highest step number in the failed ranks' last log lines (None: they print none)."""
    found = [o.iteration for f in fs.values() for line in f.log_tail if (o := parse_step(line, 0.0)) is not None]
    return max(found, default=None)


def _nodes_waiting(wg: WorkerGroup) -> int:
    """Nodes waiting in the rendezvous for a new round (0 when the store cannot say)."""
    try:
        return wg.spec.rdzv_handler.num_nodes_waiting()
    except Exception as exc:  # the store host may be what failed: no membership change known
        log.debug("num_nodes_waiting failed: %s", exc)
        return 0


def _standbys(wg: WorkerGroup) -> int:
    """Standby nodes waiting in the rendezvous (0 when the store cannot say)."""
    try:
        return torch_compat.rendezvous_standbys(wg.spec.rdzv_handler)
    except Exception as exc:  # the store host may be what was lost: no standby known
        log.debug("reading the rendezvous' standbys failed: %s", exc)
        return 0


def _wait_for_stop_signal(seconds: float) -> None:
    """Give a stop signal ``seconds`` to arrive: its handler raises SignalException in this
    loop, or the recorded one is raised again should a broad ``except`` have swallowed it."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        stopsignal.raise_pending()
        time.sleep(0.05)


def _scheduler_stops_the_job() -> bool:
    """Whether the scheduler running this agent is ending its job (Slurm: the job no longer
    RUNNING: completing, requeued, cancelled, timed out). False outside a scheduler, or when it
    cannot say."""
    from trainguard.schedulers import slurm

    job = slurm.detect(os.environ)
    if job is None:
        return False
    state = slurm.job_state(job.job_id)
    return state is not None and state != "RUNNING"
