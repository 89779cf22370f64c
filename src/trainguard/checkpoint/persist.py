"""Background persistence: shared-memory snapshots -> checkpoints on disk, in the agent's process.

A ``Persister`` scans the node's shm directory, finds each rank's newest complete snapshot that is
not on disk yet, and writes it (``disk.write_checkpoint``), keeping the newest K per rank. It also
relays the reports workers drop into ``<shm>/reports/`` (a failed save, a fallback on load) as
events, so they reach the agent's event bus, metrics and notifiers. It runs on its own thread;
``run_pass()`` does the same work synchronously (save at breakpoint, on a worker failure).
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

from trainguard.checkpoint import disk
from trainguard.checkpoint.format import decode_manifest
from trainguard.checkpoint.shm import Slot, SlotHeader, parse_slot_name

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
    ) -> None:
        self.shm_dir = Path(shm_dir)
        self.ckpt_dir = Path(ckpt_dir)
        self.keep = keep
        self.emit = emit
        self.interval_s = interval_s
        self.max_write_bytes_per_s = max_write_bytes_per_s
        self._slots: dict[str, Slot] = {}
        self._done_seqs: dict[int, set[int]] = defaultdict(set)  # rank -> snapshot seqs on disk
        self._failed_seqs: dict[int, set[int]] = defaultdict(set)  # not retried until a breakpoint
        self._lock = threading.Lock()
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
            for slot in self._slots.values():
                slot.close()
            self._slots.clear()

    def _loop(self) -> None:
        try:
            # Linux nice is per thread: let training threads win the CPU when cores are scarce.
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
        except (AttributeError, OSError):
            pass
        while not self._stop.wait(self.interval_s):
            try:
                self.run_pass()
            except Exception as exc:  # never let the thread die: the next pass may succeed
                log.exception("checkpoint persist pass failed: %s", exc)

    # --- one pass --------------------------------------------------------------------------------
    def run_pass(self, retry_failed: bool = False, every_slot: bool = False,
                 trigger: str = "background") -> list[disk.Persisted]:
        """Persist every rank's newest complete snapshot not yet on disk; relay worker reports.
        ``every_slot`` (at a breakpoint): also the older complete snapshot of each rank, so that the
        step all ranks agree on after a failure is on disk even if one rank got a step further."""
        with self._lock:
            self._relay_reports()
            done = []
            for rank, slot, hdr in self._pending(retry_failed, every_slot):
                result = self._persist_one(rank, slot, hdr)
                if result is not None:
                    done.append(result)
            self._announce(done, trigger)
            return done

    def _pending(self, retry_failed: bool, every_slot: bool) -> list[tuple[int, Slot, SlotHeader]]:
        complete: dict[int, list[tuple[Slot, SlotHeader]]] = defaultdict(list)
        try:
            names = sorted(os.listdir(self.shm_dir))
        except FileNotFoundError:
            return []
        for name in names:
            parsed = parse_slot_name(name)
            if parsed is None:
                continue
            slot = self._slot(name)
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

    def _slot(self, name: str) -> Slot | None:
        slot = self._slots.get(name)
        try:
            if slot is None:
                slot = Slot.open(self.shm_dir / name)
                self._slots[name] = slot
            else:
                slot.refresh()
        except (OSError, ValueError) as exc:  # a worker is creating it right now: next pass
            log.debug("slot %s not readable yet: %s", name, exc)
            return None
        return slot

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
            disk.prune(self.ckpt_dir, rank, self.keep)
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
                          "dir": str(items[0].path), "trigger": trigger},
            )

    # --- worker reports --------------------------------------------------------------------------
    def _relay_reports(self) -> None:
        rdir = self.shm_dir / REPORTS
        try:
            names = sorted(n for n in os.listdir(rdir) if n.endswith(".json"))
        except FileNotFoundError:
            return
        for name in names:
            path = rdir / name
            try:
                raw = path.read_bytes()[:_REPORT_MAX]
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
            path.unlink(missing_ok=True)


def _remember(seqs: set[int], seq: int, keep: int = 8) -> None:
    seqs.add(seq)
    while len(seqs) > keep:
        seqs.discard(min(seqs))


def write_report(shm_dir: Path, kind: str, message: str, severity: str, rank: int, evidence: dict[str, Any]) -> None:
    """Worker side: leave an event for the agent to emit (atomic: temp file + rename)."""
    rdir = Path(shm_dir) / REPORTS
    rdir.mkdir(exist_ok=True)
    name = f"{time.time_ns():020d}-{os.getpid()}-{os.urandom(4).hex()}"  # sorts by time
    tmp = rdir / f".{name}.tmp"
    tmp.write_text(json.dumps({"kind": kind, "message": message, "severity": severity, "rank": rank,
                               "evidence": evidence}, default=str))
    os.replace(tmp, rdir / f"{name}.json")
