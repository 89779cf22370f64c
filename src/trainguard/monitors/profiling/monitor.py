"""The profiling monitor: reads the workers' rings, persists spans, feeds step timing onwards.

- ``worker_env`` gives workers the ring name prefix (``/dev/shm/trainguard-<agent pid>-<random>``;
  each worker's ring is ``<prefix>-a<attempt>-r<rank>``) and the initial switch word.
- A background thread (never ``poll``) opens the rings (and unlinks their names at once, so
  nothing outlives the agent), applies the run's switch file (``trainguard profile``) to the rings'
  flag words, appends every new record to ``RUN_DIR/profiling/<rank>/<timestamp>`` with the seed's
  rotation and aging, and sums spans per step and per window for the straggler monitor
  (monitors/straggler.py, which gets every finished window of this node).
- It also carries out ``trainguard chaos hang`` (rundir/chaos_hold.py): a hold request for one of its
  ranks sets that rank's FLAG_HOLD bit, so the worker blocks before its next collective, until
  the request is withdrawn or the held worker is gone (one stat of the run's chaos dir per tick).
- ``poll`` feeds each rank's new steps (from the always-on step history in the ring header) into
  ``ctx.steps``, where the hang monitor reads them.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import secrets
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import psutil

from trainguard.detect import straggler as S
from trainguard.monitors.api import Monitor, MonitorContext, StepSample
from trainguard.monitors.straggler import StragglerMonitor, add_arguments, config_from
from trainguard.options import SettingsError, dir_path, given, number, positive
from trainguard.probes import flight_recorder
from trainguard.probes.ring_reader import RingNotReady, RingReader
from trainguard.rundir import chaos_hold as hold
from trainguard.rundir import profiling as pf
from trainguard.worker import ring as R
from trainguard.worker.bootstrap import ENV_FLAGS, ENV_RING_PREFIX
from trainguard.worker.flight import socket_path as flight_socket

log = logging.getLogger(__name__)

TICK_S = 0.2  # background thread period
AGING_EVERY_S = 2.0
HOLD_GRACE_S = 2.0  # a hold request waits this long for the rank's ring before it is refused
FRACTION = number("a fraction", maximum=1.0)  # 0 < F <= 1


@dataclass(frozen=True)
class ProfilingSettings:
    basic: bool = True  # Step, FP, DataLoader, SaveCheckpoint spans
    comm: bool = False  # Communication spans (only with basic on: seed rule)
    dir_cap_mb: float = 1024.0  # cap of RUN_DIR/profiling (or of the profiling root)
    aging_fraction: float = pf.AGING_FRACTION  # --profiling-aging-fraction: of the record files, deleted at the cap
    root: str = ""  # --profiling-root: the seed's layout, <root>/<task id>/<rank> ("" : see task_id)
    task_id: str = ""  # MINDX_TASK_ID: the seed's layout under the root (/user/cluster-info/profiling by default)

    @property
    def flags(self) -> int:
        return (R.FLAG_BASIC if self.basic else 0) | (R.FLAG_COMM if self.basic and self.comm else 0)

    @classmethod
    def from_options(cls, options: argparse.Namespace) -> ProfilingSettings:
        d = cls()
        basic = d.basic if options.profiling is None else options.profiling == "on"
        comm = d.comm if options.profiling_comm is None else options.profiling_comm == "on"
        if comm and not basic:
            log.warning("--profiling-comm on needs --profiling on (seed rule); Communication stays off")
        cap = d.dir_cap_mb if options.profiling_dir_cap_mb is None else options.profiling_dir_cap_mb
        task_id = os.environ.get(pf.TASK_ID_ENV, "").strip()
        if task_id and (problem := pf.task_id_problem(task_id)):
            raise SettingsError(problem)
        return cls(basic=basic, comm=comm and basic, dir_cap_mb=cap, task_id=task_id,
                   **given(options, {"aging_fraction": "profiling_aging_fraction", "root": "profiling_root"}))


def add_run_arguments(group: argparse._ArgumentGroup) -> None:
    d = ProfilingSettings()
    group.add_argument("--profiling", choices=["on", "off"], default=None,
                       help="lightweight profiling: Step/FP/DataLoader/SaveCheckpoint spans (switch at run time "
                       "with `trainguard profile RUN_DIR on|off`); step timing is kept either way (default on)")
    group.add_argument("--profiling-comm", choices=["on", "off"], default=None,
                       help="Communication spans (collectives, DDP all-reduce); needs --profiling on (default off)")
    group.add_argument("--profiling-dir-cap-mb", type=positive, default=None,
                       help=f"cap of RUN_DIR/profiling (or of --profiling-root); past it the oldest "
                       f"--profiling-aging-fraction of record files are deleted (default {d.dir_cap_mb:g})")
    group.add_argument("--profiling-aging-fraction", type=FRACTION, default=None,
                       help=f"the part of the record files deleted, oldest first, at the cap: 0 < F <= 1 "
                       f"(default {d.aging_fraction:g})")
    group.add_argument("--profiling-root", type=dir_path, default=None,
                       help=f"write records in the seed's layout DIR/$MINDX_TASK_ID/<rank> (DIR/default_task_id_"
                       f"<timestamp>/<rank> without the variable) instead of RUN_DIR/profiling/<rank>; with "
                       f"{pf.TASK_ID_ENV} set and no root, {pf.DEFAULT_ROOT} is the root")
    add_arguments(group)  # the straggler monitor's flags: it analyses what this monitor reads


@dataclass(frozen=True)
class ProfilingRunSettings:
    """The two monitors this module makes: profiling's settings and the straggler detector's."""

    profiling: ProfilingSettings
    straggler: S.StragglerConfig


def settings(options: argparse.Namespace) -> ProfilingRunSettings:
    return ProfilingRunSettings(ProfilingSettings.from_options(options), config_from(options))


def create(settings: ProfilingRunSettings) -> list[Monitor]:
    # The straggler monitor first: it starts each attempt afresh before the rings are read.
    straggler = StragglerMonitor(settings.straggler)
    return [straggler, ProfilingMonitor(settings.profiling, windows=straggler)]


class WindowSink(Protocol):
    """Where this node's finished step windows go (the straggler monitor)."""

    window_steps: int

    def add_window(self, w: S.RankWindow) -> None: ...


@dataclass
class _Rank:
    """One open ring and what the agent derived from it so far."""

    reader: RingReader
    files: pf.RankFileWriter
    acc: S.StepAccumulator
    windows: S.WindowBuilder
    seen_step: int = 0
    lost_records: int = 0  # not written (disk full): said once, counted after


class ProfilingMonitor(Monitor):
    name = "profiling"

    def __init__(self, settings: ProfilingSettings | None = None, windows: WindowSink | None = None,
                 tick_s: float = TICK_S) -> None:
        settings = settings or ProfilingSettings()
        self.flags = settings.flags
        self.cap_bytes = int(settings.dir_cap_mb * 1024 * 1024)
        self.settings = settings
        self.place: pf.ProfilingPlace | None = None  # where the records go, known once the run dir is
        self._aging: pf.AgingLock | None = None
        self.sink = windows
        self.prefix = os.path.join(R.shm_dir(), f"trainguard-{os.getpid()}-{secrets.token_hex(4)}")
        self.tick_s = tick_s
        self.run_dir: Path | None = None
        self._node = ""
        self._bus: Any = None
        self._lock = threading.RLock()  # guards _ranks, _expected
        self._tick_lock = threading.Lock()  # one tick at a time (thread, or agent on stop)
        self._ranks: dict[int, _Rank] = {}
        self._expected: dict[int, str] = {}
        self._switch_stat: tuple[int, int] | None = None
        self._chaos_stat: tuple[int, int] | None = None
        self._held: dict[int, hold.HoldRequest] = {}  # rank -> the chaos hang request applied to it
        self._seen: dict[str, float] = {}  # request id -> when first seen without an answer
        self._last_aging = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ---- agent hooks ------------------------------------------------------------------------------
    def worker_env(self, run_dir: Path) -> dict[str, str]:
        self._start(Path(run_dir))
        # torch's Flight Recorder on (gloo's is off by default): the hang monitor reads it (probes/flight_recorder.py).
        return {ENV_RING_PREFIX: self.prefix, ENV_FLAGS: str(self.flags), **flight_recorder.worker_env(dict(os.environ))}

    def on_workers_started(self, ctx: MonitorContext) -> None:
        self._start(ctx.run_dir)
        with self._lock:
            self._node, self._bus = ctx.node, ctx.events
            self._expected = expected = {w.global_rank: R.ring_path(self.prefix, ctx.restart_count, w.global_rank)
                                         for w in ctx.workers}  # fmt: skip
        ctx.steps.set_flight_sockets({r: flight_socket(p) for r, p in expected.items()})

    def on_workers_failed(self, ctx: MonitorContext, failures: dict) -> None:
        self._tick()  # rings the background thread has not opened yet (an attempt shorter than a tick)
        self.poll(ctx)  # the steps the failed attempt reached, for the restart-loop guard
        return None

    def on_workers_stopped(self, ctx: MonitorContext) -> None:
        self._retire_all()

    def _retire_all(self) -> None:
        """Drain every ring of the attempt, then close them. A ring the background thread has not
        opened yet is opened now: an attempt can end between two ticks (17 fast steps and a
        SIGKILL in 90 ms), and its records must still reach the files."""
        self._tick()  # open what is expected and drain it
        with self._lock:
            self._expected = {}
        self._tick()  # drain what the workers wrote last, then close their rings
        sweep_rings(self.prefix)  # rings never claimed (a worker that died before its first step)

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self._retire_all()
        if self._aging is not None:
            self._aging.release()  # another agent of the folder takes over its aging
        for rank, req in list(self._held.items()):
            self._end_hold(rank, req, "the job ended")

    def flush(self) -> None:
        """Write what the workers have recorded so far to the record files now (the background
        thread does it every ``tick_s``)."""
        self._tick()

    def poll(self, ctx: MonitorContext) -> None:
        with self._lock:
            for rank, st in self._ranks.items():
                for e in st.reader.steps_since(st.seen_step):
                    ctx.steps.record(StepSample(rank, e.step, e.end_unix_ns / 1e9, e.duration_ns / 1e9))
                    st.seen_step = e.step
                ctx.steps.set_collectives(rank, st.reader.collectives())
        return None

    # ---- background thread ------------------------------------------------------------------------
    def _start(self, run_dir: Path) -> None:
        if self._thread is not None:
            return
        self.run_dir = run_dir
        self.place = self._place(run_dir)
        sweep_rings()  # rings left by agents that were killed (SIGKILL leaves no chance to clean up)
        try:
            pf.write_switch(run_dir, self.flags)  # this agent's flags are the run's initial state
            self._switch_stat = self._stat_switch()
        except OSError as exc:
            log.warning("cannot write the profiling switch: %s", exc)
        self._thread = threading.Thread(target=self._loop, name="trainguard-profiling", daemon=True)
        self._thread.start()

    def _place(self, run_dir: Path) -> pf.ProfilingPlace:
        """The seed's layout when asked for; the run dir when its folder cannot be made (the job
        goes on, and says so)."""
        s = self.settings
        where = pf.place(run_dir, s.root, s.task_id)
        try:
            pf.prepare(run_dir, where)
            return where
        except OSError as exc:
            log.warning("cannot write profiling records to %s (%s): they go to %s", where.data, exc,
                        run_dir / pf.PROFILING_DIR)
            fallback = pf.place(run_dir)
            try:
                pf.prepare(run_dir, fallback)
            except OSError:
                pass
            return fallback

    def _loop(self) -> None:
        while not self._stop.wait(self.tick_s):
            try:
                self._tick()
            except Exception as exc:  # keep going: the job must not lose its monitor to one bad tick
                log.warning("profiling tick failed: %s", exc)

    def _tick(self) -> None:
        with self._tick_lock:
            self._check_switch()
            self._open_rings()
            self._check_holds()
            with self._lock:
                ranks = dict(self._ranks)
                retired = [r for r, st in ranks.items() if self._expected.get(r) != st.reader.path]
            for rank, st in ranks.items():
                self._drain(rank, st)
            if retired:
                with self._lock:
                    for r in retired:
                        self._close_ring(r, self._ranks.pop(r))
            now = time.monotonic()
            if self.place is not None and now - self._last_aging >= AGING_EVERY_S:
                self._last_aging = now
                self._age(self.place)

    def _age(self, where: pf.ProfilingPlace) -> None:
        """Age the records' folder when this agent holds its aging lock: agents sharing it (nodes of
        one run dir, jobs under one profiling root) age it one at a time, not each its 20 %."""
        if self._aging is None:
            self._aging = pf.AgingLock(where.aging_root)
        if self._aging.held():
            pf.age(where.aging_root, self.cap_bytes, self.settings.aging_fraction, where.nested)

    def _open_rings(self) -> None:
        with self._lock:
            missing = {r: p for r, p in self._expected.items() if r not in self._ranks or self._ranks[r].reader.path != p}
        for rank, path in missing.items():
            try:
                reader = RingReader(path, unlink=True)
            except RingNotReady:
                continue
            reader.set_flags(self.flags)
            assert self.run_dir is not None
            st = _Rank(
                reader=reader,
                files=pf.RankFileWriter(self.place.data if self.place else self.run_dir / pf.PROFILING_DIR, rank),
                acc=S.StepAccumulator(),
                windows=S.WindowBuilder(rank, self._node, self.sink.window_steps if self.sink else 1),
            )
            with self._lock:
                old = self._ranks.get(rank)
                if old is not None:  # the previous attempt's ring of this rank: drain it first
                    self._drain(rank, old)
                    self._close_ring(rank, old)
                self._ranks[rank] = st

    def _close_ring(self, rank: int, st: _Rank) -> None:
        lost, dropped = st.reader.lost, st.reader.dropped
        st.reader.close()
        if lost or dropped:
            self._emit("profiling_records_lost",
                       f"rank {rank}: {lost} span record(s) overwritten before the agent read them, "
                       f"{dropped} dropped in the worker", "warning", {"lost": lost, "dropped": dropped}, rank=rank)

    def _drain(self, rank: int, st: _Rank) -> None:
        for _ in range(8):  # bounded: at most 8 x 4096 records per tick
            records = st.reader.read_new(limit=4096)
            if not records:
                return
            lines = []
            for rec in records:
                lines.append(_line(rank, rec, st.reader))
                self._account(rank, st, rec)
            try:
                st.files.append(lines)
            except OSError as exc:
                if not st.lost_records:  # once, not every tick while the disk stays full
                    log.warning("cannot write profiling records of rank %d: %s (said once; the records are dropped "
                                "until it can)", rank, exc)
                st.lost_records += len(lines)
                continue
            if st.lost_records:
                log.warning("profiling records of rank %d written again; %d were dropped", rank, st.lost_records)
                st.lost_records = 0

    def _account(self, rank: int, st: _Rank, rec: R.Record) -> None:
        """Sum the rank's spans per step; a finished window goes to the straggler monitor."""
        if self.sink is None:
            return
        kind = R.KIND_NAMES.get(rec.kind, "")
        dur_ms = (rec.end_ns - rec.start_ns) / 1e6
        if rec.kind != R.STEP:
            st.acc.add_span(kind, rec.step, dur_ms)
            return
        b = st.acc.close_step(rec.step, dur_ms)
        w = st.windows.add(b) if b is not None else None
        if w is not None:
            self.sink.add_window(w)

    def _stat_switch(self) -> tuple[int, int] | None:
        try:
            st = (self.run_dir / pf.SWITCH_FILE).stat()  # type: ignore[operator]
        except (FileNotFoundError, TypeError):
            return None
        return (st.st_mtime_ns, st.st_size)

    def _check_switch(self) -> None:
        if self.run_dir is None:
            return
        stat = self._stat_switch()
        if stat is None or stat == self._switch_stat:
            return
        self._switch_stat = stat
        try:
            flags = pf.read_switch(self.run_dir)
        except (ValueError, OSError) as exc:
            self._emit("profiling_switch", f"ignored a bad profiling switch: {exc}", "warning", {})
            return
        if flags is None or flags == self.flags:
            return
        self.flags = flags
        with self._lock:
            for st in self._ranks.values():
                st.reader.set_flags(flags)
        self._emit("profiling_switch", f"lightweight profiling switched: {json.dumps(pf.switch_dict(flags))}",
                   "info", pf.switch_dict(flags))

    # ---- chaos hang ----------------------------------------------------------------------------
    def _flags_for(self, rank: int) -> int:
        return self.flags | (R.FLAG_HOLD if rank in self._held else 0)

    def _check_holds(self) -> None:
        """Apply, refuse or end the run's hold requests for this node's ranks."""
        if self.run_dir is None:
            return
        try:
            st = hold.chaos_dir(self.run_dir).stat()
            stat: tuple[int, int] | None = (st.st_mtime_ns, st.st_ino)
        except OSError:
            stat = None
        if stat == self._chaos_stat and not self._held and not self._seen:
            return  # nothing asked, nothing held: the common case costs one stat
        self._chaos_stat = stat
        with self._lock:
            rings = {r: st.reader for r, st in self._ranks.items() if self._expected.get(r) == st.reader.path}
            local = set(self._expected)
        asked = hold.pending(self.run_dir)
        for rank, req in list(self._held.items()):
            if asked.get(rank) != req:
                del self._held[rank]  # withdrawn (released) or replaced
        wanted = {r: q for r, q in asked.items() if r in local}
        for rank, req in wanted.items():
            reader = rings.get(rank)
            if reader is not None and _same_worker(reader.pid, req.pid):
                if self._held.get(rank) != req:
                    self._held[rank] = req
                    hold.answer(self.run_dir, req, True)
                    self._seen.pop(req.id, None)
            elif not psutil.pid_exists(req.pid):
                if self._held.get(rank) == req:
                    self._end_hold(rank, req, f"its worker (pid {req.pid}) is gone")
                else:  # answered, not withdrawn: whoever asked removes the request and the answer
                    hold.answer(self.run_dir, req, False, f"rank {rank}'s worker (pid {req.pid}) is gone")
            elif req.id in self._seen and time.monotonic() - self._seen[req.id] >= HOLD_GRACE_S:
                del self._seen[req.id]
                hold.answer(self.run_dir, req, False,
                            f"rank {rank}'s worker (pid {req.pid}) has no trainguard worker hooks to hold it (started "
                            "without instrumentation, e.g. --auto-instrument off with --no-python, or no step finished yet)")
            else:
                self._seen.setdefault(req.id, time.monotonic())
        self._seen = {i: t for i, t in self._seen.items() if any(q.id == i for q in wanted.values())}
        for rank, reader in rings.items():
            want = self._flags_for(rank)
            if reader.flags != want:
                reader.set_flags(want)

    def _end_hold(self, rank: int, req: hold.HoldRequest, why: str) -> None:
        """The held worker is gone (restarted, job over): the request goes, said once."""
        self._held.pop(rank, None)
        if hold.withdraw(self.run_dir, rank, req.id):  # type: ignore[arg-type]
            self._emit("chaos_reverted", f"chaos hang on rank {rank} ended: {why}", "info",
                       {"fault": "hang", "injection": req.id}, rank=rank)

    def _emit(self, kind: str, message: str, severity: str, evidence: dict, rank: int | None = None) -> None:
        if self._bus is not None:
            self._bus.emit(kind, message, severity=severity, rank=rank, evidence=evidence)
        else:
            log.info("%s: %s", kind, message)


def _same_worker(ring_pid: int, worker_pid: int) -> bool:
    """The ring's writer is the worker, or a process it started (a wrapper's Python)."""
    if ring_pid == worker_pid:
        return True
    try:
        return any(p.pid == worker_pid for p in psutil.Process(ring_pid).parents())
    except psutil.Error:
        return False


_RING_NAME = re.compile(r"trainguard-(\d+)-[0-9a-f]{8}-a\d+-r\d+(\.fr)?")  # a ring, or its flight recorder socket


def sweep_rings(prefix: str | None = None) -> list[str]:
    """Unlink ring files (and flight recorder sockets) of this agent (``prefix``), or, without one, of agents no longer alive."""
    removed = []
    d = R.shm_dir()
    try:
        names = os.listdir(d)
    except OSError:
        return removed
    for name in names:
        m = _RING_NAME.fullmatch(name)
        if m is None:
            continue
        path = os.path.join(d, name)
        if prefix is not None:
            if not path.startswith(prefix + "-"):
                continue
        elif psutil.pid_exists(int(m.group(1))):
            continue
        try:
            os.unlink(path)
            removed.append(path)
        except OSError:
            pass
    return removed


def _line(rank: int, rec: R.Record, reader: RingReader) -> str:
    kind = R.KIND_NAMES.get(rec.kind, str(rec.kind))
    name = reader.name(rec.name_id) if rec.kind == R.USER and rec.name_id else kind
    return json.dumps(
        {
            "rank": rank,
            "kind": kind,
            "name": name,
            "step": rec.step,
            "start_ns": rec.start_ns,
            "end_ns": rec.end_ns,
            "dur_us": round((rec.end_ns - rec.start_ns) / 1e3, 1),
            **({"device": "cuda"} if rec.aux == 1 else {}),
        },
        separators=(",", ":"),
    )
