"""The profiling monitor: reads the workers' rings, persists spans, detects stragglers.

- ``worker_env`` gives workers the ring name prefix (``/dev/shm/trainguard-<agent pid>-<random>``;
  each worker's ring is ``<prefix>-a<attempt>-r<rank>``) and the initial switch word.
- A background thread (never ``poll``) opens the rings (and unlinks their names at once, so
  nothing outlives the agent), applies the run's switch file (``trainguard profile``) to the rings'
  flag words, appends every new record to ``RUN_DIR/profiling/<rank>/<timestamp>`` with the seed's
  rotation and aging, and sums spans per step and per window for the straggler detector.
- ``poll`` feeds each rank's new steps (from the always-on step history in the ring header) into
  ``ctx.steps``, publishes this node's finished windows to the rendezvous store, merges all nodes'
  windows and runs the (pure) straggler detector. The agent of the straggler's node records
  ``straggler_detected``; with ``--exclude-straggler`` it returns EXCLUDE_NODE.
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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

from trainguard.detect import straggler as S
from trainguard.launch.monitor import Monitor, MonitorContext, StepSample
from trainguard.policy import STRAGGLER_EXIT_MESSAGE, Action, Decision
from trainguard.probes.ring_reader import RingNotReady, RingReader
from trainguard.launch import profile_files as pf
from trainguard.worker import ring as R
from trainguard.worker.bootstrap import ENV_FLAGS, ENV_RING_PREFIX

log = logging.getLogger(__name__)

TICK_S = 0.2  # background thread period
AGING_EVERY_S = 2.0
KEEP_WINDOWS = 16  # this node's windows kept while waiting for other nodes
HISTORY_WINDOWS = 256  # merged windows kept for the detector (it needs >= 1 s of them)
STORE_PREFIX = "trainguard/straggler"


def add_run_arguments(group: argparse._ArgumentGroup) -> None:
    group.add_argument("--profiling", choices=["on", "off"], default="on",
                       help="lightweight profiling: Step/FP/DataLoader/SaveCheckpoint spans (switch at run time "
                       "with `trainguard profile RUN_DIR on|off`); step timing is kept either way")
    group.add_argument("--profiling-comm", choices=["on", "off"], default="off",
                       help="Communication spans (collectives, DDP all-reduce); needs --profiling on")
    group.add_argument("--profiling-dir-cap-mb", type=float, default=1024.0,
                       help="cap of RUN_DIR/profiling; past it the oldest 20%% of record files are deleted")
    group.add_argument("--exclude-straggler", action="store_true",
                       help="a node found to be a straggler leaves the job (elastic jobs go on without it)")
    group.add_argument("--straggler-window", type=int, default=5, metavar="STEPS",
                       help="steps per straggler-analysis window")
    group.add_argument("--straggler-windows", type=int, default=3, metavar="N",
                       help="consecutive slow windows before a rank is named a straggler")
    group.add_argument("--straggler-ratio", type=float, default=1.25,
                       help="how much slower than its peers' median a rank must be")
    group.add_argument("--straggler-min-seconds", type=float, default=1.0,
                       help="...and for at least this long (besides --straggler-windows windows)")


def create(options: argparse.Namespace) -> ProfilingMonitor:
    return ProfilingMonitor(options)


def _opt(options: Any, name: str, default: Any) -> Any:
    value = getattr(options, name, None)
    return default if value is None else value


@dataclass
class _Rank:
    """One open ring and what the agent derived from it so far."""

    reader: RingReader
    files: pf.RankFileWriter
    acc: S.StepAccumulator
    windows: S.WindowBuilder
    seen_step: int = 0


@dataclass
class _Exchange:
    """Straggler windows of the current attempt: this node's, and all nodes' merged."""

    local: dict[int, dict[int, S.RankWindow]] = field(default_factory=dict)
    published: list[int] = field(default_factory=list)
    merged: dict[int, list[S.RankWindow]] = field(default_factory=dict)
    analysed: int = -1  # newest merged window the detector has seen
    reported: set[tuple[int, str]] = field(default_factory=set)
    decided: bool = False


class ProfilingMonitor(Monitor):
    name = "profiling"

    def __init__(self, options: Any = None, tick_s: float = TICK_S) -> None:
        basic = _opt(options, "profiling", "on") == "on"
        comm = _opt(options, "profiling_comm", "off") == "on"
        if comm and not basic:
            log.warning("--profiling-comm on needs --profiling on (seed rule); Communication stays off")
            comm = False
        self.flags = (R.FLAG_BASIC if basic else 0) | (R.FLAG_COMM if comm else 0)
        self.cap_bytes = int(float(_opt(options, "profiling_dir_cap_mb", 1024.0)) * 1024 * 1024)
        self.exclude = bool(_opt(options, "exclude_straggler", False))
        self.cfg = S.StragglerConfig(
            window_steps=max(1, int(_opt(options, "straggler_window", 5))),
            windows=max(1, int(_opt(options, "straggler_windows", 3))),
            ratio=float(_opt(options, "straggler_ratio", 1.25)),
            min_seconds=float(_opt(options, "straggler_min_seconds", 1.0)),
        )
        self.prefix = os.path.join(R.shm_dir(), f"trainguard-{os.getpid()}-{secrets.token_hex(4)}")
        self.tick_s = tick_s
        self.run_dir: Path | None = None
        self._node = ""
        self._bus: Any = None
        self._lock = threading.RLock()  # guards _ranks, _expected, _exchange.local
        self._tick_lock = threading.Lock()  # one tick at a time (thread, or agent on stop)
        self._ranks: dict[int, _Rank] = {}
        self._expected: dict[int, str] = {}
        self._exchange = _Exchange()
        self._switch_stat: tuple[int, int] | None = None
        self._last_aging = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ---- agent hooks ------------------------------------------------------------------------------
    def worker_env(self, run_dir: Path) -> dict[str, str]:
        self._start(Path(run_dir))
        return {ENV_RING_PREFIX: self.prefix, ENV_FLAGS: str(self.flags)}

    def on_workers_started(self, ctx: MonitorContext) -> None:
        self._start(ctx.run_dir)
        with self._lock:
            self._node, self._bus = ctx.node, ctx.events
            self._expected = {w.global_rank: R.ring_path(self.prefix, ctx.restart_count, w.global_rank) for w in ctx.workers}
            self._exchange = _Exchange()

    def on_workers_stopped(self, ctx: MonitorContext) -> None:
        with self._lock:
            self._expected = {}
        self._tick()  # drain what the workers wrote last, then close their rings
        sweep_rings(self.prefix)  # rings of workers stopped before we opened them

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        with self._lock:
            self._expected = {}
        self._tick()
        sweep_rings(self.prefix)

    def poll(self, ctx: MonitorContext) -> Decision | None:
        with self._lock:
            for rank, st in self._ranks.items():
                for e in st.reader.steps_since(st.seen_step):
                    ctx.steps.record(StepSample(rank, e.step, e.end_unix_ns / 1e9, e.duration_ns / 1e9))
                    st.seen_step = e.step
        return self._straggler(ctx)

    # ---- background thread ------------------------------------------------------------------------
    def _start(self, run_dir: Path) -> None:
        if self._thread is not None:
            return
        self.run_dir = run_dir
        sweep_rings()  # rings left by agents that were killed (SIGKILL leaves no chance to clean up)
        try:
            pf.write_switch(run_dir, self.flags)  # this agent's flags are the run's initial state
            self._switch_stat = self._stat_switch()
        except OSError as exc:
            log.warning("cannot write the profiling switch: %s", exc)
        self._thread = threading.Thread(target=self._loop, name="trainguard-profiling", daemon=True)
        self._thread.start()

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
            if self.run_dir is not None and now - self._last_aging >= AGING_EVERY_S:
                self._last_aging = now
                pf.age(self.run_dir / pf.PROFILING_DIR, self.cap_bytes)

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
                files=pf.RankFileWriter(self.run_dir / pf.PROFILING_DIR, rank),
                acc=S.StepAccumulator(),
                windows=S.WindowBuilder(rank, self._node, self.cfg.window_steps),
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
                log.warning("cannot write profiling records of rank %d: %s", rank, exc)

    def _account(self, rank: int, st: _Rank, rec: R.Record) -> None:
        kind = R.KIND_NAMES.get(rec.kind, "")
        dur_ms = (rec.end_ns - rec.start_ns) / 1e6
        if rec.kind != R.STEP:
            st.acc.add_span(kind, rec.step, dur_ms)
            return
        b = st.acc.close_step(rec.step, dur_ms)
        w = st.windows.add(b) if b is not None else None
        if w is not None:
            with self._lock:
                local = self._exchange.local
                local.setdefault(w.window, {})[rank] = w
                for old in sorted(local)[:-KEEP_WINDOWS]:
                    del local[old]

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

    def _emit(self, kind: str, message: str, severity: str, evidence: dict, rank: int | None = None) -> None:
        if self._bus is not None:
            self._bus.emit(kind, message, severity=severity, rank=rank, evidence=evidence)
        else:
            log.info("%s: %s", kind, message)

    # ---- straggler exchange (agent thread) ----------------------------------------------------------
    def _key(self, ctx: MonitorContext, window: int, node_rank: int) -> str:
        # A c10d rendezvous store is scoped to the round (every restart is a new round), and agents
        # that joined at different times count attempts differently: no attempt in the key there.
        # The static rendezvous reuses one store for every attempt (all agents restart together).
        scope = f"a{ctx.restart_count}/" if getattr(ctx.options, "rdzv_backend", "") == "static" else ""
        return f"{STORE_PREFIX}/{scope}w{window}/n{node_rank}"

    def _straggler(self, ctx: MonitorContext) -> Decision | None:
        try:
            return self._exchange_and_detect(ctx)
        except Exception as exc:  # the store of a round whose host left: try again next poll
            log.debug("straggler exchange failed: %s", exc)
            return None

    def _exchange_and_detect(self, ctx: MonitorContext) -> Decision | None:
        ex = self._exchange
        nworkers = len(ctx.workers)
        with self._lock:
            ready = sorted(w for w, ranks in ex.local.items() if nworkers and len(ranks) >= nworkers)
            windows = {w: list(ex.local.pop(w).values()) for w in ready}
        for w, ranks in windows.items():
            if ctx.store is None or ctx.nnodes <= 1:
                ex.merged[w] = ranks
                continue
            ctx.store.set(self._key(ctx, w, ctx.node_rank), json.dumps([r.to_dict() for r in ranks]))
            ex.published.append(w)
        if ctx.store is not None and ctx.nnodes > 1:
            self._collect(ctx, ex)
        for old in sorted(ex.merged)[:-HISTORY_WINDOWS]:
            del ex.merged[old]
        if not ex.merged or max(ex.merged) == ex.analysed:
            return None
        ex.analysed = last = max(ex.merged)
        history = []
        while last in ex.merged:  # the consecutive windows ending at the newest
            history.append(ex.merged[last])
            last -= 1
        return self._act(ctx, S.detect(history[::-1], self.cfg))

    def _collect(self, ctx: MonitorContext, ex: _Exchange) -> None:
        """Merge the published windows that every node has published (a few store round trips)."""
        assert ctx.store is not None
        ex.published = ex.published[-KEEP_WINDOWS:]
        complete = []
        for w in ex.published[:4]:
            keys = [self._key(ctx, w, n) for n in range(ctx.nnodes)]
            if ctx.store.check(keys):
                ex.merged[w] = [S.RankWindow.from_dict(d) for k in keys for d in json.loads(ctx.store.get(k))]
                complete.append(w)
        if complete:  # an older window still missing somewhere was lost there (a rank lost records)
            ex.published = [w for w in ex.published if w > max(complete)]

    def _act(self, ctx: MonitorContext, verdicts: list[S.Verdict]) -> Decision | None:
        ex = self._exchange
        mine = {w.global_rank for w in ctx.workers}
        decision = None
        for v in verdicts:
            if v.rank not in mine or (v.rank, v.kind) in ex.reported:
                continue
            ex.reported.add((v.rank, v.kind))
            message = (
                f"rank {v.rank} on node {v.node} is a straggler: {v.kind} {v.slower_by:.2f}x slower than its peers "
                f"({v.value_ms:.1f} ms vs {v.peers_ms:.1f} ms per step, steps {v.windows[0] * self.cfg.window_steps + 1}-"
                f"{(v.windows[-1] + 1) * self.cfg.window_steps})"
            )
            evidence = {**v.to_dict(), "steps": [v.windows[0] * self.cfg.window_steps + 1,
                                                  (v.windows[-1] + 1) * self.cfg.window_steps]}
            ctx.events.emit("straggler_detected", message, severity="warning", rank=v.rank, evidence=evidence)
            if self.exclude and not ex.decided:
                ex.decided = True
                decision = Decision(
                    Action.EXCLUDE_NODE,
                    message,
                    source="straggler",
                    rank=v.rank,
                    evidence=evidence,
                    exit_message=STRAGGLER_EXIT_MESSAGE,
                )
        return decision


_RING_NAME = re.compile(r"trainguard-(\d+)-[0-9a-f]{8}-a\d+-r\d+")


def sweep_rings(prefix: str | None = None) -> list[str]:
    """Unlink ring files of this agent (``prefix``), or, without one, of agents no longer alive."""
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
