"""Background persistence: shared-memory snapshots -> checkpoints on disk, in the agent's process.

A ``Persister`` scans the node's shm directory, finds each rank's newest complete snapshot that is
not on disk yet, and writes it (``disk.write_checkpoint``), keeping the newest K per rank. It also
relays the reports workers drop into ``<shm>/reports/`` (a failed save, a fallback on load) as
events, so they reach the agent's event bus, metrics and notifiers. It runs on its own thread;
``run_pass()`` does the same work synchronously (save at breakpoint, on a worker failure).

The background thread runs at idle CPU priority (SCHED_IDLE) and the lowest best-effort I/O
priority: on a machine whose cores the training keeps busy it only uses the cycles training leaves
idle, so persisting does not stall training. If it cannot finish a checkpoint for ``max_lag_s``
(training never idles), ``boost_if_starved`` (called from the agent's loop) lifts it to a normal
nice-10 thread, so the disk copy never falls behind for ever. Passes at a breakpoint run at normal
priority: then training is stopped and the checkpoint is what the restart waits for.

``rescue_orphan`` persists what a dead agent left in shared memory (the snapshots it had not yet
written) before its directory is removed.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil

from trainguard.checkpoint import disk
from trainguard.checkpoint.format import FormatError, decode_manifest
from trainguard.checkpoint.shm import (
    RescueRefused,
    Slot,
    SlotCache,
    SlotHeader,
    owner_pid,
    parse_slot_name,
    read_dir_info,
)

log = logging.getLogger(__name__)

Emit = Callable[..., Any]  # emit(kind, message, severity="info", rank=None, evidence=None)
REPORTS = "reports"
_REPORT_MAX = 64 << 10
_SEVERITIES = ("info", "warning", "error")


class Persister:
    def __init__(
        self,
        shm_dir: Path,
        ckpt_dir: Path,
        keep: int,
        emit: Emit,
        interval_s: float = 0.1,
        max_write_bytes_per_s: float = 0,
        idle_priority: bool = True,
    ) -> None:
        self.shm_dir = Path(shm_dir)
        self.ckpt_dir = Path(ckpt_dir)
        self.keep = keep
        self.emit = emit
        self.interval_s = interval_s
        self.max_write_bytes_per_s = max_write_bytes_per_s
        self.idle_priority = idle_priority
        self.boosted = False
        self._tid: int | None = None
        self._heartbeat: float | None = None  # the background thread last made progress then
        self._verified = disk.VerifiedCache()
        self._slots = SlotCache(self.shm_dir)
        self._done_seqs: dict[int, set[int]] = defaultdict(set)  # rank -> snapshot seqs on disk
        self._failed_seqs: dict[int, set[int]] = defaultdict(set)  # not retried until a breakpoint
        self._lock = threading.Lock()
        self._dir_gone = False  # said; said again after the directory came back and went again
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # --- lifecycle -------------------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="trainguard-ckpt-persist", daemon=True)
            self._thread.start()

    def stop(self, flush: bool = True) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if flush:
            self.run_pass(retry_failed=True, trigger="shutdown")
        with self._lock:
            self._slots.close()

    def _loop(self) -> None:
        self._tid = threading.get_native_id()
        _set_background_priority(self._tid, idle=self.idle_priority)
        while not self._stop.wait(self.interval_s):
            self._heartbeat = time.monotonic()
            try:
                self.run_pass(background=True)
            except Exception as exc:  # never let the thread die: the next pass may succeed
                log.exception("checkpoint persist pass failed: %s", exc)

    def boost_if_starved(self, max_lag_s: float = 30.0) -> bool:
        """Called from another thread (the agent's loop): when the idle-priority persist thread has
        made no progress (no pass started, no checkpoint finished) for ``max_lag_s``, give it a
        normal (nice 10) share of the CPU until its pass is done. True when it boosted it now."""
        beat, tid = self._heartbeat, self._tid
        if beat is None or tid is None or self.boosted or not self.idle_priority:
            return False
        if time.monotonic() - beat < max_lag_s:
            return False
        self.boosted = _set_background_priority(tid, idle=False)
        if self.boosted:
            log.warning("checkpoint: background persist got no idle CPU for %.0f s; running it at nice 10", max_lag_s)
        return self.boosted

    # --- one pass --------------------------------------------------------------------------------
    def run_pass(self, retry_failed: bool = False, every_slot: bool = False,
                 trigger: str = "background", background: bool = False,
                 skip_on_disk: bool = False) -> list[disk.Persisted]:
        """Persist every rank's newest complete snapshot not yet on disk; relay worker reports.
        ``every_slot`` (at a breakpoint): also the older complete snapshot of each rank, so that the
        step all ranks agree on after a failure is on disk even if one rank got a step further.
        ``skip_on_disk`` (a rescue): leave out snapshots whose exact copy is already committed on
        disk, and those older than a step of their rank on disk (disk.newer_on_disk says why)."""
        with self._lock:
            self._relay_reports()
            done = []
            for rank, slot, hdr in self._pending(retry_failed, every_slot):
                if skip_on_disk and (self._on_disk(rank, slot, hdr) or disk.newer_on_disk(self.ckpt_dir, rank, hdr.step)):
                    continue
                result = self._persist_one(rank, slot, hdr)
                if background:
                    self._heartbeat = time.monotonic()
                if result is not None:
                    done.append(result)
            if background and self.boosted and self._tid is not None:  # caught up: back to idle
                self.boosted = not _set_background_priority(self._tid, idle=True)
            self._announce(done, trigger)
            return done

    def drop_stale_slots(self, live: set[int], world: int) -> list[int]:
        """After a world-size change: once every rank now on this node has a snapshot at the new
        world size (so it has loaded whatever it needed), remove the snapshots of ranks this node
        no longer hosts, to free their memory. Returns the ranks whose slots went."""
        if not live:
            return []
        with self._lock:
            try:
                names = sorted(os.listdir(self.shm_dir))
            except FileNotFoundError:
                return []
            slots = [(n, parsed[0]) for n in names if (parsed := parse_slot_name(n)) is not None]
            stale = [(n, r) for n, r in slots if r not in live]
            if not stale:
                return []
            current = {r for n, r in slots if r in live and self._complete_at(n, world)}
            if current != live:
                return []  # a rank may still be loading from an old snapshot
            for name, _ in stale:
                self._slots.drop(name)
                (self.shm_dir / name).unlink(missing_ok=True)
            return sorted({r for _, r in stale})

    def _complete_at(self, name: str, world: int) -> bool:
        slot = self._slots.get(name)
        hdr = slot.header() if slot is not None else None
        return hdr is not None and hdr.complete and hdr.world == world

    def _on_disk(self, rank: int, slot: Slot, hdr: SlotHeader) -> bool:
        """True when this very snapshot (same rank, step and save time) is committed on disk."""
        try:
            mine = decode_manifest(bytes(slot.mm[hdr.manifest_off : hdr.manifest_off + hdr.manifest_len]))
            theirs = disk.read_manifest(self.ckpt_dir, rank, hdr.step)
        except (FormatError, disk.CorruptCheckpoint):
            return False
        return mine.get("time") == theirs.get("time")

    def _pending(self, retry_failed: bool, every_slot: bool) -> list[tuple[int, Slot, SlotHeader]]:
        complete: dict[int, list[tuple[Slot, SlotHeader]]] = defaultdict(list)
        try:
            names = sorted(os.listdir(self.shm_dir))
        except FileNotFoundError:
            self._note_dir_gone()
            return []
        self._dir_gone = False
        for name in names:
            parsed = parse_slot_name(name)
            if parsed is None:
                continue
            slot = self._slots.get(name)
            hdr = slot.header() if slot is not None else None
            if hdr is not None and hdr.complete:
                complete[parsed[0]].append((slot, hdr))
        out = []
        for rank, found in sorted(complete.items()):
            found.sort(key=lambda sh: sh[1].seq)  # oldest first: the newest ends up newest on disk
            done = self._done_seqs.get(rank, set())
            newest_done = max(done, default=0)
            for slot, hdr in found if every_slot else found[-1:]:
                if hdr.seq in done or (not every_slot and hdr.seq <= newest_done):
                    continue
                if not retry_failed and hdr.seq in self._failed_seqs.get(rank, set()):
                    continue
                out.append((rank, slot, hdr))
        return out

    def _note_dir_gone(self) -> None:
        """The slot directory was removed under the job (tmpwatch, systemd-logind's RemoveIPC): an
        error event once per removal; each rank says what it did about it at its next save."""
        if self._dir_gone:
            return
        self._dir_gone = True
        self.emit("checkpoint_shm_lost",
                  f"the snapshots' shared-memory directory {self.shm_dir} was removed under the running job "
                  "(tmpwatch? systemd-logind RemoveIPC?): snapshots not on disk yet are lost; each rank recreates "
                  "it, or writes straight to disk, at its next save",
                  severity="error", evidence={"shm_dir": str(self.shm_dir), "seen_by": "persister"})

    def _persist_one(self, rank: int, slot: Slot, hdr: SlotHeader) -> disk.Persisted | None:
        def unchanged() -> bool:
            now = slot.header()
            return now is not None and now.complete and now.seq == hdr.seq

        slot.set_pin(hdr.seq)  # the worker now writes its other slot
        try:
            if not unchanged():
                return None
            if hdr.data_off + hdr.data_len > slot.size:
                slot.refresh()  # the worker grew the file since we mapped it
                if hdr.data_off + hdr.data_len > slot.size:
                    raise ValueError(f"snapshot claims {hdr.data_off + hdr.data_len} bytes, slot has {slot.size}")
            with memoryview(slot.mm) as mv:
                meta = decode_manifest(bytes(mv[hdr.manifest_off : hdr.manifest_off + hdr.manifest_len]))
                with mv[hdr.data_off : hdr.data_off + hdr.data_len] as data:
                    result = disk.write_checkpoint(
                        self.ckpt_dir, meta, data, unchanged, self.max_write_bytes_per_s
                    )
            _remember(self._done_seqs[rank], hdr.seq)
            self._failed_seqs[rank].discard(hdr.seq)
            self._verified.add(self.ckpt_dir, rank, hdr.step, disk.taken_at(meta))  # checked while written
            self._prune(rank, hdr)
            return result
        except disk.SnapshotChanged:
            return None  # a newer snapshot replaced it: the next pass persists that one
        except Exception as exc:
            _remember(self._failed_seqs[rank], hdr.seq)
            self.emit(
                "checkpoint_failed",
                f"could not persist rank {rank} step {hdr.step} to {self.ckpt_dir}: {exc}; "
                "the previous checkpoint stays valid and training continues",
                severity="error",
                rank=rank,
                evidence={"step": hdr.step, "dir": str(self.ckpt_dir), "error": f"{type(exc).__name__}: {exc}"},
            )
            return None
        finally:
            slot.set_pin(0)

    def _prune(self, rank: int, hdr: SlotHeader) -> None:
        pruned = disk.prune(self.ckpt_dir, rank, self.keep, self._verified, newest=hdr.step, world=hdr.world)
        if pruned.quarantined:
            steps = sorted(pruned.quarantined)
            self.emit(
                "checkpoint_quarantined",
                f"rank {rank}: checkpoint step(s) {steps} in {self.ckpt_dir} do not verify; moved to "
                f"{pruned.quarantine_dir} (not deleted, not counted among the {self.keep} kept)",
                severity="warning",
                rank=rank,
                evidence={"steps": steps, "errors": {str(k): v for k, v in pruned.quarantined.items()},
                          "moved_to": str(pruned.quarantine_dir), "dir": str(self.ckpt_dir)},
            )

    def _announce(self, done: list[disk.Persisted], trigger: str) -> None:
        by_step: dict[int, list[disk.Persisted]] = defaultdict(list)
        for p in done:
            by_step[p.step].append(p)
        for step, items in sorted(by_step.items()):
            ranks = sorted(p.rank for p in items)
            nbytes = sum(p.nbytes for p in items)
            seconds = max(p.seconds for p in items)
            self.emit(
                "checkpoint_persisted",
                f"checkpoint step {step} persisted for ranks {ranks}: {nbytes / 1e6:.1f} MB in {seconds:.2f} s",
                severity="info",
                rank=ranks[0] if len(ranks) == 1 else None,
                evidence={"step": step, "ranks": ranks, "bytes": nbytes, "seconds": round(seconds, 4),
                          "dir": str(items[0].path), "trigger": trigger,
                          "direct_io": all(p.direct for p in items)},
            )

    # --- worker reports --------------------------------------------------------------------------
    def _relay_reports(self) -> None:
        # Through a directory fd opened O_NOFOLLOW, each report too: a ``reports`` link (planted in
        # a directory being rescued) must not make this process read or delete files elsewhere.
        try:
            dfd = os.open(self.shm_dir / REPORTS, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError:
            return
        except OSError as exc:
            log.warning("ignoring checkpoint reports in %s: %s", self.shm_dir / REPORTS, exc.strerror or exc)
            return
        try:
            self._relay_reports_in(dfd)
        finally:
            os.close(dfd)

    def _relay_reports_in(self, dfd: int) -> None:
        names = sorted(n for n in os.listdir(dfd) if n.endswith(".json"))
        for name in names:
            try:
                with open(os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dfd), "rb") as f:
                    raw = f.read(_REPORT_MAX)
                report = json.loads(raw)
                kind = str(report["kind"])
                severity = str(report.get("severity", "info"))
                if not kind.startswith("checkpoint_") or severity not in _SEVERITIES:
                    raise ValueError(f"unexpected report kind/severity {kind!r}/{severity!r}")
                rank = report.get("rank")
                self.emit(kind, str(report.get("message", ""))[:2000], severity=severity,
                          rank=rank if isinstance(rank, int) else None,
                          evidence=report.get("evidence") if isinstance(report.get("evidence"), dict) else {})
            except (OSError, ValueError, KeyError, TypeError) as exc:
                log.warning("ignoring bad checkpoint report %s: %s", name, exc)
            try:
                os.unlink(name, dir_fd=dfd)
            except FileNotFoundError:
                pass


def rescue_orphan(shm_dir: Path, emit: Emit, ckpt_dir: Path, keep: int) -> list[disk.Persisted]:
    """Persist the snapshots a dead owner left in ``shm_dir`` that are not on disk yet, before the
    directory is removed. Only into ``ckpt_dir``, the caller's own checkpoint dir, with the caller's
    ``keep``: what ``owner.json`` says is only compared, never followed (whoever wrote the file
    would otherwise choose where this process writes and how much of that dir it prunes). Raises
    RescueRefused when the owner recorded another checkpoint dir: its own job rescues it."""
    info = read_dir_info(shm_dir)
    theirs = info.get("ckpt_dir")
    pid = owner_pid(shm_dir)
    if not isinstance(theirs, str) or not theirs:
        log.warning("checkpoint: %s (owner pid %s gone) records no checkpoint dir; its snapshots are dropped", shm_dir, pid)
        return []
    if not _same_dir(Path(theirs), ckpt_dir):
        raise RescueRefused(f"its snapshots belong to checkpoint dir {theirs}, not ours ({ckpt_dir})")
    if not ckpt_dir.is_dir():  # never recreate a checkpoint dir someone removed
        log.warning("checkpoint: %s (owner pid %s gone): its checkpoint dir %s is gone; its snapshots are dropped",
                    shm_dir, pid, ckpt_dir)
        return []
    persister = Persister(shm_dir, ckpt_dir, keep, emit, idle_priority=False)
    try:
        done = persister.run_pass(retry_failed=True, every_slot=True, trigger="orphaned_snapshot", skip_on_disk=True)
    finally:
        persister.stop(flush=False)
    if done:
        steps = sorted({p.step for p in done})
        ranks = sorted({p.rank for p in done})
        emit("checkpoint_rescued",
             f"the checkpoint owner (pid {pid}) died holding snapshots in shared memory that were not on disk: "
             f"persisted step(s) {steps} of rank(s) {ranks} to {ckpt_dir} before removing {shm_dir.name}",
             severity="warning",
             evidence={"steps": steps, "ranks": ranks, "dir": str(ckpt_dir), "shm_dir": str(shm_dir), "owner_pid": pid})
    return done


def _same_dir(a: Path, b: Path) -> bool:
    """The same directory (the same inode when both exist, else the same resolved path)."""
    try:
        sa, sb = os.stat(a), os.stat(b)
    except OSError:
        return Path(os.path.abspath(a)) == Path(os.path.abspath(b))
    return (sa.st_dev, sa.st_ino) == (sb.st_dev, sb.st_ino)


def _set_background_priority(tid: int, idle: bool) -> bool:
    """Idle CPU class (or nice 10) and the lowest best-effort I/O priority for one thread (Linux
    scheduling attributes are per thread). False when the system does not allow it."""
    try:
        if idle:
            os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
        else:
            os.sched_setscheduler(tid, os.SCHED_OTHER, os.sched_param(0))
            os.setpriority(os.PRIO_PROCESS, tid, 10)
    except (AttributeError, OSError) as exc:
        log.debug("checkpoint: cannot set the persist thread's CPU priority: %s", exc)
        return False
    try:
        psutil.Process(tid).ionice(psutil.IOPRIO_CLASS_BE, 7)
    except (AttributeError, OSError, psutil.Error) as exc:
        log.debug("checkpoint: cannot set the persist thread's I/O priority: %s", exc)
    return True


def _remember(seqs: set[int], seq: int, keep: int = 8) -> None:
    seqs.add(seq)
    while len(seqs) > keep:
        seqs.discard(min(seqs))


def write_report(shm_dir: Path, kind: str, message: str, severity: str, rank: int, evidence: dict[str, Any]) -> None:
    """Worker side: leave an event for the agent to emit (atomic: temp file + rename)."""
    rdir = Path(shm_dir) / REPORTS
    rdir.mkdir(mode=disk.DIR_MODE, exist_ok=True)
    name = f"{time.time_ns():020d}-{os.getpid()}-{os.urandom(4).hex()}"  # sorts by time
    tmp = rdir / f".{name}.tmp"
    raw = json.dumps({"kind": kind, "message": message, "severity": severity, "rank": rank,
                      "evidence": evidence}, default=str).encode()
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, disk.FILE_MODE)
    with open(fd, "wb") as f:
        f.write(raw)
    os.replace(tmp, rdir / f"{name}.json")
