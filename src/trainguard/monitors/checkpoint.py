"""Agent side of fast checkpoints: owns the node's shared memory and persists snapshots.

Before the first worker start it creates a private directory under ``--ckpt-shm-dir`` (tmpfs,
``/dev/shm``) and hands it to workers (``TRAINGUARD_CKPT_SHM_DIR``). Each worker creates its
rank's two slot files there on its first ``trainguard.checkpoint.save``; the files outlive worker
deaths (SIGKILL included) and the directory is removed when the agent closes. A background thread
persists each new snapshot to ``--ckpt-dir`` (temp file, fsync, atomic rename, manifest with
CRC32, newest ``--ckpt-keep`` kept). When workers fail, the newest complete snapshots are
persisted before the restart (save at breakpoint). A directory left by an agent that died (SIGKILL)
is found when the next agent starts on the node: the snapshots it held that are not on disk yet
are persisted to its checkpoint dir before it is removed (``checkpoint_rescued``).

Events: ``checkpoint_persisted`` (info), ``checkpoint_failed`` (error: disk full, unwritable
directory...), ``checkpoint_quarantined`` (warning: checkpoints that do not verify moved aside by
pruning), ``checkpoint_rescued`` (warning), and, relayed from workers, ``checkpoint_fallback``
(warning: newest checkpoint partial, corrupt or not loadable at this world size, an older one
loaded), ``checkpoint_incompatible`` (error), ``checkpoint_loaded`` and ``checkpoint_skipped``.
"""

from __future__ import annotations

import argparse
import logging
import os
import socket
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainguard.checkpoint import disk
from trainguard.checkpoint.client import ENV_CKPT_DIR, ENV_KEEP, ENV_OVERLAP, ENV_SHM_DIR, ENV_SHM_ROOT
from trainguard.checkpoint.persist import Persister, rescue_orphan
from trainguard.checkpoint.shm import make_shm_dir, read_dir_info, release_shm_dir
from trainguard.events import EventBus, EventStore
from trainguard.events.store import node_db_path
from trainguard.evidence import RankFailure
from trainguard.monitors.api import Monitor, MonitorContext
from trainguard.options import given, non_negative, positive_int

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CheckpointSettings:
    ckpt_dir: str | Path | None = None  # None: RUN_DIR/checkpoints
    keep: int = 3  # newest checkpoints kept per rank
    # tmpfs where in-memory snapshots live: TRAINGUARD_CKPT_SHM_ROOT (as for a job without an agent), else /dev/shm
    shm_root: str | Path = field(default_factory=lambda: os.environ.get(ENV_SHM_ROOT) or "/dev/shm")
    write_limit_mb_s: float = 0.0  # background persist rate cap (0: none)
    breakpoint_timeout_s: float = 600.0  # longest persist at a failure before the restart goes on
    overlap: bool = False  # copy CPU tensors during the next forward/backward

    @classmethod
    def from_options(cls, options: argparse.Namespace) -> CheckpointSettings:
        return cls(overlap=bool(options.ckpt_overlap), **given(options, {
            "ckpt_dir": "ckpt_dir",
            "keep": "ckpt_keep",
            "shm_root": "ckpt_shm_dir",
            "write_limit_mb_s": "ckpt_write_limit",
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


def create(options: argparse.Namespace) -> Monitor | None:
    return CheckpointMonitor(CheckpointSettings.from_options(options))


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
                ENV_OVERLAP: "1" if self.overlap else "0"}

    def on_before_start(self, ctx: MonitorContext) -> None:
        self._ctx = ctx
        self._flush_early()
        return None

    def on_workers_started(self, ctx: MonitorContext) -> None:
        self._ctx = ctx
        self._flush_early()

    def poll(self, ctx: MonitorContext) -> None:
        self._ctx = ctx  # the persist thread emits through the current context's bus
        self._flush_early()
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
        if self._persister is not None:
            self._run_pass_bounded(trigger="workers_stopped")

    def close(self) -> None:
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
                self.ckpt_dir.mkdir(parents=True, exist_ok=True)
                removed = disk.clean_temp_files(self.ckpt_dir)
                if removed:
                    log.info("checkpoint: removed %d temp file(s) of interrupted persists", removed)
            except OSError as exc:  # reported on the first persist; snapshots still work in memory
                log.warning("checkpoint: checkpoint dir %s not usable: %s", self.ckpt_dir, exc)
            info = {"ckpt_dir": str(self.ckpt_dir.resolve()), "keep": self.keep, "run_dir": str(run_dir.resolve())}
            self.shm_dir = make_shm_dir(self.shm_root, info=info, on_orphan=lambda d: self._rescue(d, run_dir))
            self._persister = Persister(self.shm_dir, self.ckpt_dir, self.keep, self._emit,
                                        max_write_bytes_per_s=self.write_limit)
            self._persister.start()

    def _rescue(self, shm_dir: Path, run_dir: Path) -> None:
        """Persist what a dead agent left in shared memory to its own checkpoint dir, and report it
        to its own run: a job that merely starts on the same node must not record another job's
        rescue as its own."""
        owner_run = read_dir_info(shm_dir).get("run_dir")
        if not isinstance(owner_run, str) or Path(owner_run) == run_dir.resolve():
            rescue_orphan(shm_dir, self._emit, keep=self.keep)
            return
        if not Path(owner_run).is_dir():  # never recreate a run dir someone removed
            rescue_orphan(shm_dir, lambda kind, message, **_: log.warning("checkpoint: %s", message), keep=self.keep)
            return
        store = EventStore(node_db_path(owner_run, f"rescue@{socket.gethostname()}"))
        try:
            bus = EventBus(store, node=socket.gethostname())
            rescue_orphan(shm_dir, bus.emit, keep=self.keep)
        finally:
            store.close()
        log.info("checkpoint: persisted the snapshots another job's dead agent left in %s (reported in %s)", shm_dir, owner_run)

    def _run_pass_bounded(self, every_slot: bool = False, trigger: str = "background") -> list | None:
        """A synchronous persist pass, on a helper thread so a stuck disk cannot wedge the agent."""
        persister = self._persister
        if persister is None:
            return None
        result: list = []

        def work() -> None:
            try:
                result.extend(persister.run_pass(retry_failed=True, every_slot=every_slot, trigger=trigger))
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
