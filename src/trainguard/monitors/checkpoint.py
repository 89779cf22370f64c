"""Agent side of fast checkpoints: owns the node's shared memory and persists snapshots.

Before the first worker start it creates a private directory under ``--ckpt-shm-dir`` (tmpfs,
``/dev/shm``) and hands it to workers (``TRAINGUARD_CKPT_SHM_DIR``). Each worker creates its
rank's three slot files there on its first ``trainguard.checkpoint.save``; the files outlive worker
deaths (SIGKILL included) and the directory is removed when the agent closes. A background thread
persists each new snapshot to ``--ckpt-dir`` (temp file, fsync, atomic rename, manifest with
CRC32, newest ``--ckpt-keep`` kept). When workers fail, the newest complete snapshots are
persisted before the restart (save at breakpoint). A directory left by an agent that died (SIGKILL)
is found when the next agent starts on the node: the snapshots it held that are not on disk yet
are persisted to this agent's checkpoint dir before it is removed (``checkpoint_rescued``), when
it is this user's, private, and recorded that same checkpoint dir (else ``checkpoint_rescue_refused``).

Events: ``checkpoint_persisted`` (info), ``checkpoint_failed`` (error: disk full, unwritable
directory...), ``checkpoint_quarantined`` (warning: checkpoints that do not verify moved aside by
pruning), ``checkpoint_rescued`` and ``checkpoint_rescue_refused`` (warnings), and, relayed from workers, ``checkpoint_fallback``
(warning: newest checkpoint partial, corrupt or not loadable at this world size, an older one
loaded), ``checkpoint_incompatible`` (error), ``checkpoint_loaded`` and ``checkpoint_skipped``, and
``checkpoint_shm_lost`` / ``checkpoint_shm_full`` (errors: the shm directory removed under the job,
or the tmpfs full; each names the rank's fallback, see ``trainguard.checkpoint.shmfault``).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainguard.checkpoint import disk
from trainguard.checkpoint.client import (
    ENV_CKPT_DIR,
    ENV_KEEP,
    ENV_OVERLAP,
    ENV_SHM_DIR,
    ENV_SHM_ROOT,
    ENV_SLOTS,
    NSLOTS,
)
from trainguard.checkpoint.persist import Persister, rescue_orphan
from trainguard.checkpoint.pull import held_here, needed, pull
from trainguard.checkpoint.replica import REPLICAS, Buddy, ReplicaServer, Replicator, persist_replicas
from trainguard.checkpoint.shm import make_shm_dir, read_dir_info, release_shm_dir
from trainguard.cluster.stores import ForgedValue
from trainguard.evidence import RankFailure
from trainguard.monitors.api import Monitor, MonitorContext
from trainguard.options import given, non_negative, non_negative_int, positive_int

log = logging.getLogger(__name__)


def _is_run(recorded: Any, run_dir: Path) -> bool:
    """Whether a dead agent's recorded run dir is this run's (none recorded: an agent of ours)."""
    return not isinstance(recorded, str) or Path(recorded) == run_dir.resolve()


def _log_only(kind: str, message: str, **_: Any) -> None:
    log.warning("checkpoint: %s", message)


REPLICA_KEY = "trainguard/ckpt-replica/"  # + node rank: where that node's agent takes snapshot replicas
PEERS_WAIT_S = 10.0  # before the workers start: how long to wait for the other nodes to say where they serve


@dataclass(frozen=True)
class CheckpointSettings:
    ckpt_dir: str | Path | None = None  # None: RUN_DIR/checkpoints
    keep: int = 3  # newest checkpoints kept per rank
    # tmpfs where in-memory snapshots live: TRAINGUARD_CKPT_SHM_ROOT (as for a job without an agent), else /dev/shm
    shm_root: str | Path = field(default_factory=lambda: os.environ.get(ENV_SHM_ROOT) or "/dev/shm")
    write_limit_mb_s: float = 0.0  # background persist rate cap (0: none)
    breakpoint_timeout_s: float = 600.0  # longest persist at a failure before the restart goes on
    overlap: bool = False  # copy CPU tensors during the next forward/backward
    replicas: int | None = None  # buddy nodes each snapshot is sent to (None: 1 when the job has more than one node)
    replica_limit_mb_s: float = 0.0  # replication send rate cap (0: none; the sender runs at nice 10 anyway)

    @classmethod
    def from_options(cls, options: argparse.Namespace) -> CheckpointSettings:
        return cls(overlap=bool(options.ckpt_overlap), **given(options, {
            "ckpt_dir": "ckpt_dir",
            "keep": "ckpt_keep",
            "shm_root": "ckpt_shm_dir",
            "write_limit_mb_s": "ckpt_write_limit",
            "replicas": "ckpt_replicas",
            "replica_limit_mb_s": "ckpt_replica_limit",
        }))  # fmt: skip


def add_run_arguments(group: argparse._ArgumentGroup) -> None:
    d = CheckpointSettings()
    group.add_argument("--ckpt-dir", default=None,
                       help="where trainguard.checkpoint snapshots are persisted (default: RUN_DIR/checkpoints)")
    group.add_argument("--ckpt-keep", type=positive_int, default=None, metavar="K",
                       help=f"keep the newest K checkpoints per rank (default: {d.keep})")
    group.add_argument("--ckpt-shm-dir", default=None,
                       help=f"tmpfs where in-memory snapshots live (default: {d.shm_root})")
    group.add_argument("--ckpt-overlap", action="store_true",
                       help="copy CPU tensors of trainguard.checkpoint.save on an idle-priority helper thread during "
                            "the next forward/backward (the optimizer step waits for it); default: copy inside save")
    group.add_argument("--ckpt-write-limit", type=non_negative, default=None, metavar="MB_S",
                       help="cap the background persist rate in MB/s so it does not starve the job's I/O (0: none)")
    group.add_argument("--ckpt-replicas", type=non_negative_int, default=None, metavar="K",
                       help="send each in-memory snapshot to K other nodes' agents (buddies), so a lost node's "
                            "state survives it (default: 1 when the job has more than one node; 0: off)")
    group.add_argument("--ckpt-replica-limit", type=non_negative, default=None, metavar="MB_S",
                       help="cap the replication send rate in MB/s (0: none; the sender runs at low priority)")


def settings(options: argparse.Namespace) -> CheckpointSettings:
    return CheckpointSettings.from_options(options)


def create(settings: CheckpointSettings) -> Monitor | None:
    return CheckpointMonitor(settings)


class CheckpointMonitor(Monitor):
    name = "checkpoint"

    def __init__(self, settings: CheckpointSettings | None = None, **fields: Any) -> None:
        """``CheckpointMonitor(settings)``, or ``CheckpointMonitor(keep=2, ...)`` with fields of
        CheckpointSettings."""
        s = settings or CheckpointSettings(**fields)
        self._ckpt_dir_opt = Path(s.ckpt_dir) if s.ckpt_dir else None
        self.keep = s.keep
        self.shm_root = Path(s.shm_root)
        self.write_limit = s.write_limit_mb_s * 1e6
        self.breakpoint_timeout_s = s.breakpoint_timeout_s
        self.overlap = s.overlap
        self.replicas = s.replicas
        self.replica_limit = s.replica_limit_mb_s * 1e6
        # Three slots per rank: a rank keeps its newest two steps while the persister pins a slot
        # (client.NSLOTS says why two slots lose the step every rank holds). With replication that
        # also keeps the step a lost node's replica may be behind the survivors' newest.
        self.slots = NSLOTS
        self._server: ReplicaServer | None = None
        self._replica_key = b""  # the job key's replica key, once the server listens
        self._replicator: Replicator | None = None
        self._wanted: list[int] = []  # node ranks of this round's buddies not looked up yet
        self._ranks: tuple[int, ...] = ()  # the global ranks this node ran in its last round
        self._buddies: list[Buddy] = []
        self.shm_dir: Path | None = None
        self.ckpt_dir: Path | None = None
        self._persister: Persister | None = None
        self._ctx: MonitorContext | None = None
        self._early: list[tuple[tuple[Any, ...], dict[str, Any]]] = []  # events before the first context
        self._lock = threading.Lock()

    # --- hooks -----------------------------------------------------------------------------------
    def worker_env(self, run_dir: Path) -> dict[str, str]:
        self._ensure_started(Path(run_dir))
        assert self.shm_dir is not None and self.ckpt_dir is not None
        return {ENV_SHM_DIR: str(self.shm_dir), ENV_CKPT_DIR: str(self.ckpt_dir), ENV_KEEP: str(self.keep),
                ENV_OVERLAP: "1" if self.overlap else "0", ENV_SLOTS: str(self.slots)}

    def on_before_start(self, ctx: MonitorContext) -> None:
        self._ctx = ctx
        self._flush_early()
        try:
            if self._serve_replicas(ctx):
                self._pull_missing(ctx)
        except Exception as exc:  # never in the way of the start: the workers load what there is
            log.exception("checkpoint: pulling snapshots before the start failed: %s", exc)
        self._ranks = ctx.ranks
        return None

    def on_workers_started(self, ctx: MonitorContext) -> None:
        self._ctx = ctx
        self._flush_early()
        self._start_replication(ctx)

    def poll(self, ctx: MonitorContext) -> None:
        self._ctx = ctx  # the persist thread emits through the current context's bus
        self._flush_early()
        self._find_buddies(ctx)
        if self._persister is not None:
            self._persister.boost_if_starved()
            if ctx.workers:  # after a world-size change: free the old ranks' snapshots once unneeded
                self._persister.drop_stale_slots({w.global_rank for w in ctx.workers}, ctx.world_size)
        return None

    def on_workers_failed(self, ctx: MonitorContext, failures: dict[int, RankFailure]) -> None:
        """Save at breakpoint: the newest complete snapshot of every rank goes to disk before the
        restart (the shm copy survives the restart too, but not the loss of this node)."""
        self._ctx = ctx
        if self._persister is None:
            return
        done = self._run_pass_bounded(every_slot=True, trigger="breakpoint")
        if done is not None and done:
            steps = sorted({p.step for p in done})
            log.info("checkpoint: persisted step(s) %s at breakpoint", steps)

    def on_workers_stopped(self, ctx: MonitorContext) -> None:
        self._ctx = ctx
        if self._persister is not None:  # with replicas: every slot, so the step a buddy holds is there too
            self._run_pass_bounded(every_slot=self._server is not None, trigger="workers_stopped")

    def close(self) -> None:
        self._stop_replication()
        with self._lock:
            persister, self._persister = self._persister, None
            shm_dir, self.shm_dir = self.shm_dir, None
        try:
            if persister is not None:
                persister.stop(flush=True)
        finally:
            if shm_dir is not None:
                release_shm_dir(shm_dir)

    # --- internals -------------------------------------------------------------------------------
    def _ensure_started(self, run_dir: Path) -> None:
        with self._lock:
            if self._persister is not None:
                return
            self.ckpt_dir = self._ckpt_dir_opt or run_dir / "checkpoints"
            try:
                disk.make_private_dir(self.ckpt_dir)
                removed = disk.clean_temp_files(self.ckpt_dir)
                if removed:
                    log.info("checkpoint: removed %d temp file(s) of interrupted persists", removed)
            except OSError as exc:  # reported on the first persist; snapshots still work in memory
                log.warning("checkpoint: checkpoint dir %s not usable: %s", self.ckpt_dir, exc)
            info = {"ckpt_dir": str(self.ckpt_dir.resolve()), "keep": self.keep, "run_dir": str(run_dir.resolve())}
            self.shm_dir = make_shm_dir(self.shm_root, info=info, on_orphan=lambda d: self._rescue(d, run_dir),
                                        on_refused=self._refused)
            self._persister = Persister(self.shm_dir, self.ckpt_dir, self.keep, self._emit,
                                        max_write_bytes_per_s=self.write_limit)
            self._persister.start()

    def _rescue(self, shm_dir: Path, run_dir: Path) -> None:
        """Persist what a dead agent of ours left in shared memory, into this agent's own checkpoint
        dir with its own keep (persist.rescue_orphan refuses another dir: RescueRefused, reported by
        ``_refused``). The rescue is reported in this run only when the dead agent was this run's;
        for another run's agent it is one log line: no event DB is ever created at a path read from
        the directory."""
        assert self.ckpt_dir is not None
        emit = self._emit if _is_run(read_dir_info(shm_dir).get("run_dir"), run_dir) else _log_only
        rescue_orphan(shm_dir, emit, self.ckpt_dir, self.keep)

    def _refused(self, shm_dir: Path, why: str) -> None:
        self._emit("checkpoint_rescue_refused", f"refused to rescue {shm_dir}: {why}; left as it is",
                   severity="warning", evidence={"shm_dir": str(shm_dir), "reason": why})

    def _run_pass_bounded(self, every_slot: bool = False, trigger: str = "background") -> list | None:
        """A synchronous persist pass, on a helper thread so a stuck disk cannot wedge the agent."""
        persister = self._persister
        if persister is None:
            return None
        result: list = []

        def work() -> None:
            try:
                result.extend(persister.run_pass(retry_failed=True, every_slot=every_slot, trigger=trigger))
                if self._server is not None:  # a lost buddy's state: on disk beside the survivors'
                    result.extend(p for _, p in persist_replicas(self._server.root, persister.ckpt_dir, self._emit, trigger))
            except Exception as exc:
                log.exception("checkpoint: breakpoint persist failed: %s", exc)

        t = threading.Thread(target=work, name="trainguard-ckpt-breakpoint", daemon=True)
        t.start()
        t.join(self.breakpoint_timeout_s)
        if t.is_alive():
            self._emit("checkpoint_failed", f"persisting at breakpoint did not finish in {self.breakpoint_timeout_s:.0f} s; "
                       "restarting anyway (the in-memory snapshot is still used on this node)", severity="error")
            return None
        return result

    # --- buddy replication -----------------------------------------------------------------------
    def _replica_count(self, ctx: MonitorContext) -> int:
        if ctx.nnodes <= 1:
            return 0
        return min(1 if self.replicas is None else self.replicas, ctx.nnodes - 1)

    def _start_replication(self, ctx: MonitorContext) -> None:
        """Each round: listen for replicas (once), say where in the round's store, and look up this
        round's buddies (the next K nodes in the rendezvous order) as they publish theirs."""
        self._wanted, self._buddies = [], []
        if self._replicator is not None:
            self._replicator.set_buddies([])
        if not self._serve_replicas(ctx):
            return
        k = self._replica_count(ctx)
        self._wanted = [(ctx.node_rank + i) % ctx.nnodes for i in range(1, k + 1)]
        self._find_buddies(ctx)

    def _serve_replicas(self, ctx: MonitorContext) -> bool:
        """With replication on: take replicas and fetches (the server, once) and say where in this
        round's store (before the workers start, so that a node pulling snapshots finds it, and
        again after). False when replication is off or cannot run."""
        job_key = getattr(ctx.store, "job_key", None)  # a SignedStore: replicas are signed like its values
        if self._replica_count(ctx) == 0 or job_key is None:
            return False
        self._ensure_started(ctx.run_dir)
        if self.shm_dir is None:
            return False
        if self._server is None and not self._listen(ctx, job_key.derive("checkpoint-replica")):
            return False
        assert self._server is not None
        where = json.dumps({"node": ctx.node, "addr": self._server.addr, "port": self._server.port})
        try:
            ctx.store.set(f"{REPLICA_KEY}{ctx.node_rank}", where)
        except Exception as exc:  # the store is failing: the rendezvous' own error handling takes over
            log.warning("checkpoint: could not publish where this node takes snapshot replicas: %s", exc)
        return True

    def _pull_missing(self, ctx: MonitorContext) -> None:
        """Ranks this node is to run and holds nothing recent of (a standby taking a lost node's
        place, a survivor whose ranks moved): their newest snapshots from the other nodes' agents
        into this node's memory, before its workers start (checkpoint/pull.py)."""
        assert self.shm_dir is not None and self._server is not None
        here = held_here(self.shm_dir, ctx.world_size)
        ranks = needed(ctx.ranks, self._ranks, here)
        if not ranks:
            return
        # This node's own server first: the lost node's buddy may be the survivor that now runs
        # its ranks (their replicas are here, in files the server reuses: copied, not linked).
        own = Buddy(ctx.node, self._server.addr, self._server.port)
        pull(self.shm_dir, ranks, ctx.world_size, here, [own, *self._peers(ctx)], self._replica_key, self.slots,
             self._emit)

    def _peers(self, ctx: MonitorContext) -> list[Buddy]:
        """Where every other node of this round serves, as they publish it (up to PEERS_WAIT_S: a
        node not there by then is not asked)."""
        wanted = [r for r in range(ctx.nnodes) if r != ctx.node_rank]
        found: list[Buddy] = []
        deadline = time.monotonic() + PEERS_WAIT_S
        while wanted:
            for r in list(wanted):
                buddy = self._published(ctx, r)
                if buddy is not None:
                    wanted.remove(r)
                    found.append(buddy)
            if not wanted or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        if wanted:
            log.info("checkpoint: node rank(s) %s did not say where they serve in %.0f s; not asked", wanted, PEERS_WAIT_S)
        return found

    def _published(self, ctx: MonitorContext, node_rank: int) -> Buddy | None:
        key = f"{REPLICA_KEY}{node_rank}"
        try:
            if ctx.store is None or not ctx.store.check([key]):
                return None
            info = json.loads(ctx.store.get(key))
            return Buddy(str(info["node"]), str(info["addr"]), int(info["port"]))
        except ForgedValue:  # reported by the signed store, never sent to; the node's own value may follow
            return None
        except Exception as exc:  # not there yet, or the store is failing: the next look
            log.debug("checkpoint: node %d not known yet: %s", node_rank, exc)
            return None

    def _listen(self, ctx: MonitorContext, key: bytes) -> bool:
        assert self.shm_dir is not None
        try:
            self._server = ReplicaServer(self.shm_dir / REPLICAS, ctx.addr or "127.0.0.1", key, self._rejected,
                                         own_dir=self.shm_dir, node=ctx.node)
        except OSError as exc:
            self._emit("checkpoint_replica_failed", f"cannot take snapshot replicas on {ctx.addr}: {exc}; "
                       "this node's snapshots are not replicated", severity="warning")
            return False
        self._replica_key = key
        self._replicator = Replicator(self.shm_dir, ctx.node, key, self._emit, self.replica_limit)
        self._replicator.start()
        return True

    def _find_buddies(self, ctx: MonitorContext) -> None:
        if not self._wanted or ctx.store is None or self._replicator is None:
            return
        for r in list(self._wanted):
            buddy = self._published(ctx, r)
            if buddy is None:
                continue
            self._wanted.remove(r)
            self._buddies.append(buddy)
        self._replicator.set_buddies(self._buddies)
        if not self._wanted and self._buddies:
            names = ", ".join(f"{b.node} ({b.addr}:{b.port})" for b in self._buddies)
            self._emit("checkpoint_replication", f"{ctx.node}'s snapshots are replicated to {names}",
                       evidence={"buddies": [b.node for b in self._buddies], "node_rank": ctx.node_rank})

    def _rejected(self, message: str) -> None:
        self._emit("checkpoint_replica_rejected", message, severity="warning")

    def _stop_replication(self) -> None:
        replicator, self._replicator = self._replicator, None
        server, self._server = self._server, None
        if replicator is not None:
            replicator.stop()
            st = replicator.stats
            if st.snapshots:
                self._emit("checkpoint_replication", f"replicated {st.snapshots} snapshot(s), "
                           f"{st.bytes / 1e6:.1f} MB ({st.bytes / st.snapshots / 1e6:.2f} MB each) in {st.seconds:.2f} s",
                           evidence=st.to_json())
        if server is not None:
            server.close()

    def _emit(self, kind: str, message: str, severity: str = "info", rank: int | None = None,
              evidence: dict[str, Any] | None = None) -> None:
        ctx = self._ctx
        if ctx is None:  # before the agent's first context: logged now, recorded when it comes
            level = {"info": logging.INFO, "warning": logging.WARNING}.get(severity, logging.ERROR)
            log.log(level, "[%s] %s", kind, message)
            self._early.append(((kind, message), {"severity": severity, "rank": rank, "evidence": evidence}))
            return
        self._flush_early()
        ctx.events.emit(kind, message, severity=severity, rank=rank, evidence=evidence)

    def _flush_early(self) -> None:
        ctx = self._ctx
        while ctx is not None and self._early:
            args, kwargs = self._early.pop(0)
            ctx.events.emit(*args, **kwargs)
