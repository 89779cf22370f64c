"""Hang monitor: judges stalled steps by each rank's progress, names the culprit rank and its stack.

It runs on its own thread (``poll`` only hands over the evidence): every ``--hang-period`` it reads
the I/O, CPU and state of every worker and its children (probes.proc), GPU utilisation through
NVML when there is one, and the step samples the profiling monitor puts into ``ctx.steps``. The
seed's rule (detect.hang) watches I/O and utilisation. When steps stall (no step for the learned
threshold, or the first step of a later attempt past its learned allowance), py-spy samples every
rank's stack every ``stack_every`` seconds; detect.progress judges each rank's progress over the
window and the stall: ``hang_suspected`` (warning: the candidate is busy and progressing; the watch
goes on, ``hang_cleared`` when steps resume) or ``hang_detected`` (no progress, or no step for
``--hang-detect-time``). Both are recorded with the evidence and a readable report in the run dir
and handed to the policy as ``HangEvidence`` (``policy.decide_on_hang`` decides). On several
nodes the job gets one verdict per incident, recorded by one agent with every node's view and
acted on by all (monitors/hang/exchange.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import math
import os
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainguard.detect.culprit import CulpritVerdict, RankView, classify, find_culprit
from trainguard.detect.hang import (
    Activity,
    Assessment,
    HangConfig,
    HangDetector,
    first_step_allowance,
    phase_allowance,
)
from trainguard.detect.progress import Progress, RankSamples, judge_progress
from trainguard.detect.sequence import InCall, SequenceFinding, compare_sequences, flight_calls
from trainguard.detect.verdict import JobWindow, Limits, StallVerdict, judge_stall, phase_of, stopped_proof
from trainguard.detect.waits import Wait, classify_wait
from trainguard.evidence import HangEvidence, RankFailure
from trainguard.monitors.api import Monitor, MonitorContext
from trainguard.monitors.hang.exchange import HangExchange, NodeViews
from trainguard.monitors.hang.report import HangReport, write_report
from trainguard.options import SettingsError, given, number
from trainguard.probes import flight_recorder, nvml, proc, stacks, waits

log = logging.getLogger(__name__)

STACK_TIMEOUT = 10.0
FLIGHT_TIMEOUT = 2.0  # a worker's Flight Recorder answers from a C++ thread in ms, unless the process is stopped
FOLLOW_STALLED_S = 0.5  # how often the agent's loop looks for the job's verdict while steps stall here
FOLLOW_IDLE_S = 2.0  # ... and otherwise (a node that saw no stall still acts on the job's verdict)
FIRST_STEP = "first_step"  # key of the learned first-step time (beside the phases' pauses)
# Stack samples kept per rank; at the window a rank must stand on one stack in all of them
# (at least detect.verdict.WINDOW_MIN_STACKS) to count as not progressing.
WINDOW_STACKS = 16
# Environment names for --hang-detect-time, in order of preference (the seed's name is an alias).
DETECT_TIME_ENV = ("TRAINGUARD_HANG_DETECT_TIME", "MA_HANG_DETECT_TIME")
HANG_ACTIONS = ("restart", "notify")
HANG_ACTION_ENV = "TRAINGUARD_HANG_ACTION"


def add_run_arguments(group: argparse._ArgumentGroup) -> None:
    group.add_argument(
        "--hang-detect-time",
        type=number("minutes"),
        default=None,
        metavar="MINUTES",
        help="seed rule: a job whose workers did no I/O for this long and whose utilisation did not change is "
        f"hung (default: $TRAINGUARD_HANG_DETECT_TIME, $MA_HANG_DETECT_TIME, or {HangConfig.detect_time / 60:g}). "
        "With step samples, hangs are found far sooner (see --hang-step-slack).",
    )
    group.add_argument(
        "--hang-period",
        type=number("seconds"),
        default=None,
        metavar="SECONDS",
        help=f"how often worker I/O, CPU and utilisation are sampled (default {HangConfig.period:g})",
    )
    group.add_argument(
        "--hang-step-slack",
        type=number("seconds"),
        default=None,
        metavar="SECONDS",
        help=f"no finished step for SLACK + {HangConfig.step_factor:g} x p99 step time (and no I/O) is a hang "
        f"(default {HangConfig.step_slack:g})",
    )
    group.add_argument(
        "--hang-action",
        choices=HANG_ACTIONS,
        default=None,
        help="what a detected hang does: restart the job (default), or notify: record and notify every verdict "
        "and never stop a worker (seed 000's 'suspected hung' marking; also $TRAINGUARD_HANG_ACTION)",
    )
    group.add_argument("--no-hang-detect", action="store_true", help="switch hang detection off")


def _env_minutes() -> float | None:
    for name in DETECT_TIME_ENV:
        text = os.environ.get(name, "").strip()
        if not text:
            continue
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not (value > 0 and math.isfinite(value)):
            raise SettingsError(
                f"{name}={text!r}: expected minutes > 0, e.g. 30 (or --no-hang-detect to switch hang detection off)"
            )
        return value
    return None


@dataclass(frozen=True)
class HangSettings:
    """The hang monitor's settings: flags, then environment, then HangConfig's defaults."""

    enabled: bool = True
    config: HangConfig = field(default_factory=HangConfig)
    action: str = "restart"  # HANG_ACTIONS: "notify" records and notifies, never stops a worker

    @classmethod
    def from_options(cls, options: argparse.Namespace) -> HangSettings:
        if options.no_hang_detect:
            return cls(enabled=False)  # the environment is not even read
        fields = given(options, {"period": "hang_period", "step_slack": "hang_step_slack"})
        minutes = options.hang_detect_time or _env_minutes()
        if minutes is not None:
            fields["detect_time"] = minutes * 60.0
        return cls(config=dataclasses.replace(HangConfig(), **fields), action=_action(getattr(options, "hang_action", None)))


def _action(given_action: str | None) -> str:
    """--hang-action, else $TRAINGUARD_HANG_ACTION, else restart."""
    if given_action:
        return given_action
    text = os.environ.get(HANG_ACTION_ENV, "").strip().lower()
    if not text:
        return "restart"
    if text not in HANG_ACTIONS:
        raise SettingsError(f"{HANG_ACTION_ENV}={text!r}: expected one of {', '.join(HANG_ACTIONS)}")
    return text


def settings(options: argparse.Namespace) -> HangSettings:
    return HangSettings.from_options(options)


def create(settings: HangSettings) -> Monitor | None:
    return HangMonitor(settings.config, action=settings.action) if settings.enabled else None


# --------------------------------------------------------------------------------------------


class _Gpu:
    """Utilisation of the GPUs this job sees (NVML); none without NVML (then each rank's CPU is
    the series)."""

    def __init__(self) -> None:
        self.indices = nvml.visible_indices(os.environ.get("CUDA_VISIBLE_DEVICES"), nvml.gpu_ids() or [])

    def read(self) -> list[float] | None:
        return nvml.utilization(self.indices) if self.indices else None


class _History:
    """The last few /proc samples and py-spy stacks of every rank (bounded), for detect.progress."""

    def __init__(self, cfg: HangConfig) -> None:
        keep = int(max(cfg.window, WINDOW_STACKS * cfg.stack_every) / cfg.period) + 8
        # rank -> (its /proc sample, the collectives it had started then: None when unknown)
        self.procs: dict[int, deque[tuple[proc.ProcSample, int | None]]] = {}
        self.stacks: dict[int, deque[tuple[float, tuple[stacks.Frame, ...] | None]]] = {}
        self._keep = keep

    def add_procs(self, samples: dict[int, proc.ProcSample], collectives: dict[int, Any] | None = None) -> None:
        for r, s in samples.items():
            seq = getattr((collectives or {}).get(r), "seq", None)
            self.procs.setdefault(r, deque(maxlen=self._keep)).append((s, seq))

    def add_stacks(self, when: float, views: dict[int, RankView]) -> None:
        for r, v in views.items():
            frames = tuple(v.frames) if v.frames else None
            self.stacks.setdefault(r, deque(maxlen=WINDOW_STACKS)).append((when, frames))

    def clear_stacks(self) -> None:
        self.stacks.clear()

    def samples(self, rank: int, now: float, cfg: HangConfig, since: float, span: float | None = None) -> RankSamples:
        """The rank's window: ``span`` seconds (default ``cfg.window``; or the last 3 stack samples
        when they go further back), never before ``since`` (the stall's start: the last step's own
        log line is no progress of the stall)."""
        st = list(self.stacks.get(rank, ()))
        start = now - (cfg.window if span is None else span)
        if len(st) >= 3:
            start = min(start, st[-3][0])
        start = max(start, since)
        st = [(t, f) for t, f in st if t >= start - 1e-6]
        kept = [(p, c) for p, c in self.procs.get(rank, ()) if p.time >= start - 1e-6]
        ps = [p for p, _ in kept]
        return RankSamples(
            rank,
            times=[p.time for p in ps],
            states=[p.state if p.alive else "" for p in ps],
            cpu=[p.cpu for p in ps],
            io=[p.io for p in ps],
            stacks=[f for _, f in st],
            net=[p.net for p in ps],
            collectives=[c for _, c in kept],
            own_cpu=[p.own_cpu for p in ps],
        )


class _Watch:
    """One attempt's watch: samples, judges stalls by the ranks' progress. Runs on the monitor's thread."""

    def __init__(self, ctx: MonitorContext, cfg: HangConfig, learned: dict[str, float], gpu: _Gpu | None,
                 notify_only: bool = False) -> None:  # fmt: skip
        self.ctx = ctx
        self.cfg = cfg
        self.notify_only = notify_only  # --hang-action notify: verdicts are recorded, never acted on
        self.detected_here = False  # notify only: this stall's hang was recorded (once per stall)
        self.windows_announced = 0  # window suspicions recorded in this stall (one per --hang-detect-time)
        self.io_mark: int | None = None  # the job's I/O bytes when the stall began
        self.learned = learned  # phase kind -> longest healthy pause seen (kept across attempts)
        self.gpu = gpu
        self.detector = HangDetector(cfg, start=time.time())
        self.history = _History(cfg)
        self.next_stacks = -math.inf
        self.stall_phases: set[str] = set()  # the phases seen during the current stall
        self.stall_from = -math.inf  # the last step end the current stall counts from
        self.suspected: StallVerdict | None = None  # the suspicion in force (recorded once)
        self.suspect_since: float | None = None  # when the stall first read as a suspicion
        self.remote_views: dict[int, RankView] = {}  # other nodes' ranks, when they named the culprit
        self.remote_progress: dict[int, str] = {}
        self.exchange: HangExchange | None = None  # set on the watch's thread, on several nodes
        self.stalled = False  # steps stall here (the agent's loop then looks for the job's verdict more often)
        self.suspect_recorded = False  # this node recorded the suspicion in force (and records its clearing)
        self.gather_wait = max(10.0, 3 * cfg.period)  # for the other nodes' declarations
        self.exit_since: float | None = None  # when the workers were first seen shutting down
        self.last_dumps: dict[int, stacks.StackDump] = {}
        # The ranks' Flight Recorders, read since the last stack dumps: only when a question needs
        # them (an own-lock proof, a verdict's sequence). Read every round, they delayed proofs
        # that a helper process was stopped by ~4 s (bench/hang.py, 2026-11-29).
        self.last_flight: dict[int, flight_recorder.FlightView] = {}
        self.last_verdict: CulpritVerdict | None = None
        self.last_views: dict[int, RankView] = {}
        self.first_step_seen = False
        # rank -> the healthy phase its stacks showed during this stall: one sample inside the
        # user's own evaluation loop body must not lose the evaluation the others showed.
        self.recent_phase: dict[int, str] = {}
        self.d_since: dict[int, float] = {}  # rank -> when it was first seen in D (uninterruptible sleep)
        self.t_since: dict[int, float] = {}  # rank -> when it was first seen stopped by a signal (T), this time
        self.waits: dict[int, Wait] = {}  # rank -> what it waits on (the latest stall round)
        self.raw_waits: dict[int, Wait] = {}  # ... as the last round classified it (before confirmation)

    def round(self, now: float) -> HangEvidence | None:
        pids = self.ctx.pids()
        samples = waits.with_net(proc.sample_workers(pids, now))
        if not any(s.alive and s.state not in ("Z", "X") for s in samples.values()):
            self.learn_first_step()  # a short attempt may end before a round saw its steps
            return None  # all workers exited: the agent handles that
        self.history.add_procs(samples, self.ctx.steps.collectives())
        for r, s in samples.items():
            # Only "T" (a stop signal) takes the early path: "t" is a tracer's stop (a debugger, or a
            # stack dump in progress), a person at work that the step threshold still judges.
            for since, held in ((self.d_since, s.state == "D"), (self.t_since, s.alive and s.state == "T")):
                if held:
                    since.setdefault(r, now)
                else:
                    since.pop(r, None)
        self.detector.observe(
            now,
            [Activity(r, s.io, s.cpu, s.state, s.alive, s.net) for r, s in samples.items()],
            self.gpu.read() if self.gpu else None,
        )
        steps = {r: self.ctx.steps.recent(r) for r in pids}
        a = self.detector.assess(now, steps)
        if self.io_mark is None:
            self.io_mark = self.detector.io_total
        stats = a.steps
        if stats is None:
            return None
        if stats.last_end == -math.inf:
            # No step yet in this attempt: judged once an earlier attempt showed how long its first
            # step took (compile, warm-up, loading), or once the seed's rule holds (no I/O for the
            # window, flat utilisation); either way by the same verdict over the ranks' progress.
            allowed = first_step_allowance(self.learned.get(FIRST_STEP), self.cfg)
            if allowed is None and not a.hang:
                return None
            since, stall = self.detector.start, now - self.detector.start
            threshold = allowed if allowed is not None else self.cfg.detect_time
        else:
            if not self.first_step_seen:
                self._learn_first_step(steps)
            if stats.last_end > self.stall_from:
                self._steps_resumed(now, stats.last_end)
            since, stall = stats.last_end, a.stall
            threshold = stats.threshold if stats.ready else math.inf
        if self.detected_here:
            return None  # notify only: this stall's hang is recorded; the next stall is judged anew
        # A rank stopped for a whole window is proof in hand before the threshold (stopped_proof).
        stopped = any(now - t >= self.cfg.window for t in self.t_since.values())
        if stall < min(0.5 * threshold, self.cfg.detect_time) and not stopped:
            return None
        self.stalled = True
        if now >= self.next_stacks:
            # Stacks from half the threshold on: by the threshold there are several to compare.
            t0 = time.monotonic()
            verdict, dumps, views = self._stacks(pids, steps)
            self.history.add_stacks(time.time(), views)
            self.last_dumps, self.last_verdict, self.last_views = dumps, verdict, views
            for r, pos in verdict.positions.items():
                if phase_of(pos):
                    self.recent_phase[r] = phase_of(pos)
            self.next_stacks = now + max(self.cfg.stack_every, 2 * (time.monotonic() - t0))
        verdict = self.last_verdict
        if verdict is None:
            return None
        if stall <= threshold and stall < self.cfg.detect_time:
            return self._judge_stopped(now, dataclasses.replace(a, stall=stall), verdict, pids, since) if stopped else None
        if verdict.phase == "exit" and stall >= self.cfg.detect_time:
            # Training is over and the processes are shutting down; only a shutdown that itself
            # lasts the window is judged.
            self.exit_since = now if self.exit_since is None else self.exit_since
            if now - self.exit_since < self.cfg.detect_time:
                return None
        return self._judge(now, dataclasses.replace(a, stall=stall), verdict, pids, since, threshold)

    def learn_first_step(self) -> None:
        """Learn the first step from the steps recorded so far, unless a round already did."""
        if not self.first_step_seen:
            self._learn_first_step({r: self.ctx.steps.recent(r) for r in self.ctx.pids()})

    def _learn_first_step(self, steps: dict[int, list]) -> None:
        """The attempt's first step: how long it took from the workers' start (the first-step
        allowance of later attempts)."""
        start = self.detector.start
        ends = [s.end for samples in steps.values() for s in samples if s.end >= start - 1.0]
        if not ends:
            return
        self.first_step_seen = True
        took = min(ends) - start
        if took > self.learned.get(FIRST_STEP, 0.0):
            self.learned[FIRST_STEP] = took
            log.debug("hang: first step after %.1fs; allowance learned", took)

    def _steps_resumed(self, now: float, last_end: float) -> None:
        """A step finished: a stall (if any) is over. Learn how long its phase took; clear a suspicion."""
        if self.stall_from > -math.inf:
            pause = last_end - self.stall_from
            for phase in self.stall_phases:
                if pause > self.learned.get(phase, 0.0):
                    self.learned[phase] = pause
                    log.debug("hang: %s pause of %.1fs ended; allowance learned", phase, pause)
        if self.detected_here:
            pause = last_end - self.stall_from
            self.ctx.events.emit(
                "hang_cleared",
                f"steps resumed after {pause:.1f}s without a step, after a detected hang the workers were left "
                "running for (--hang-action notify)",
                severity="info",
                evidence={"pause_s": round(pause, 2), "after": "hang_detected", "attempt": self.ctx.restart_count},
            )
        elif self.suspected is not None and self.suspect_recorded:
            pause = last_end - self.stall_from
            s = self.suspected
            self.ctx.events.emit(
                "hang_cleared",
                f"hang suspicion cleared: steps resumed after {pause:.1f}s without a step "
                f"(rank {s.culprit} {s.phase or 'own code'})",
                severity="info",
                rank=s.culprit,
                evidence={"pause_s": round(pause, 2), "phase": s.phase, "culprit": s.culprit,
                          "attempt": self.ctx.restart_count},  # fmt: skip
            )
        self.stall_from, self.stall_phases, self.suspected, self.suspect_since = last_end, set(), None, None
        self.stalled = self.suspect_recorded = self.detected_here = False
        self.windows_announced, self.io_mark, self.exit_since = 0, self.detector.io_total, None
        self.history.clear_stacks()
        self.recent_phase.clear()
        self.waits, self.raw_waits = {}, {}
        self.next_stacks = -math.inf

    def _progress(self, now: float, verdict: CulpritVerdict, since: float,
                  span: float | None = None) -> tuple[CulpritVerdict, dict[int, Progress]]:  # fmt: skip
        """The verdict with each rank's recent phase, and each rank's progress since ``since``
        (over the last ``span`` seconds; default the progress window)."""
        verdict = dataclasses.replace(verdict, positions={
            r: p if phase_of(p) else dataclasses.replace(p, phase=self.recent_phase.get(r, ""))
            for r, p in verdict.positions.items()
        })  # fmt: skip
        progress = {
            r: judge_progress(self.history.samples(r, now, self.cfg, since, span), self.cfg, waiting=p.waiting)
            for r, p in verdict.positions.items()
        }
        return verdict, progress

    def _judge_stopped(
        self, now: float, a: Assessment, verdict: CulpritVerdict, pids: dict[int, int], since: float
    ) -> HangEvidence | None:
        """Before the step threshold: a verdict only on a rank stopped for a whole window
        (detect.progress.stopped_proof); the other nodes' declarations add nothing to that proof,
        so they are not waited for (their ranks wait in the collective: their views arrive when
        they have shared them)."""
        verdict, progress = self._progress(now, verdict, since)
        stopped_for = {r: now - t for r, t in self.t_since.items()}
        sv = stopped_proof(verdict, progress, stopped_for, self.cfg.window)
        if sv is None or self._moved_on(a, pids):
            return None
        if self.exchange is not None:
            self._share(verdict, progress)
        return self._conclude(now, a, sv, verdict, progress, gather_s=self.cfg.period)

    def _judge(
        self, now: float, a: Assessment, verdict: CulpritVerdict, pids: dict[int, int], since: float, threshold: float
    ) -> HangEvidence | None:
        """The verdict on a stall of ``a.stall`` seconds (since ``since``, over ``threshold``)."""
        cfg = self.cfg
        # At the window a rank's stack is compared over every sample kept (WINDOW_STACKS), not the
        # short progress window: a tight loop on one line is seen off its line now and then.
        span = WINDOW_STACKS * cfg.stack_every if a.stall >= cfg.detect_time else None
        verdict, progress = self._progress(now, verdict, since, span)
        threshold = min(threshold, cfg.detect_time)
        limits = Limits(
            threshold=threshold,
            detect_time=cfg.detect_time,
            allowance=lambda r, ph: phase_allowance(self.learned.get(ph), threshold, cfg, recognised=bool(ph)),
            stalled_limit=cfg.stalled_limit,
            stalled_for={r: now - t for r, t in self.d_since.items()},
            idle_cpu=cfg.idle_cpu,
        )
        self.waits = self._waits(verdict, pids)
        sv = judge_stall(verdict, progress, a.stall, limits, self.waits, self._others_wait(), self._job_window(now, a))
        self.stall_phases.update(phase_of(p) for p in verdict.positions.values() if phase_of(p))
        if self.exchange is not None:
            self._share(verdict, progress)
            if sv.state == "detected" and sv.rule == "steps":
                sv = self._with_other_nodes(verdict, sv)
        if sv.state == "suspected" and sv.rule == "window":
            return self._announce_window(now, a, sv, verdict, progress)
        if sv.state != "suspected":
            self.suspect_since = None
        elif self.suspected is None:
            # Recorded once it held for a window: a log line written just before a rank blocked
            # reads as I/O progress for a moment; the window it leaves decides.
            self.suspect_since = now if self.suspect_since is None else self.suspect_since
            if now - self.suspect_since < cfg.window:
                return None
            self.suspected = sv
            self.suspect_recorded = self._claim_suspicion(a)
            if not self.suspect_recorded:
                return None  # another node records this incident's suspicion
            return self._record(now, a, sv, verdict, progress, self._latest_nodes(verdict, progress))
        if sv.state != "detected":
            return None
        if self._moved_on(a, pids):
            return None  # a step finished while we looked: slow, not hung
        return self._conclude(now, a, sv, verdict, progress)

    def _job_window(self, now: float, a: Assessment) -> JobWindow:
        """The seed's window facts for the whole job, as this node sees them."""
        cfg = self.cfg
        util = self.detector.utilisation(now - min(cfg.detect_time, cfg.util_window))
        no_steps = a.steps is None or a.steps.last_end == -math.inf
        return JobWindow(now - self.detector.last_io_change, util.unchanged, util.source,
                         "io+utilisation" if no_steps else "detect-time",
                         None if self.io_mark is None else max(0, self.detector.io_total - self.io_mark))  # fmt: skip

    def _announce_window(
        self, now: float, a: Assessment, sv: StallVerdict, verdict: CulpritVerdict, progress: dict[int, Progress],
    ) -> HangEvidence | None:  # fmt: skip
        """Past the window and alive: a suspicion recorded once per window (never a restart)."""
        window = int(a.stall // self.cfg.detect_time)
        if window <= self.windows_announced:
            return None
        self.windows_announced = window
        self.suspected = sv
        key = f"{max(a.steps.last_step.values()) if a.steps and a.steps.last_step else 'start'}-window{window}"
        self.suspect_recorded = self._claim_suspicion(a, key)
        if not self.suspect_recorded:
            return None  # another node records this window's suspicion
        return self._record(now, a, sv, verdict, progress, self._latest_nodes(verdict, progress))

    def _others_wait(self) -> bool:
        """Whether ranks on other nodes wait in a collective (their latest shared stacks, not
        waited for): a rank idle here is then waited for, as when its peers were local."""
        if self.exchange is None:
            return False
        others = self._others(0.0, declared=False)
        return any(classify(v).waiting for nv in others.values() for v in nv.views.values())

    def _flight(self, ranks: list[int]) -> dict[int, flight_recorder.FlightView]:
        """These ranks' Flight Recorders, read once per stack dump (``last_flight``)."""
        missing = [r for r in ranks if r not in self.last_flight]
        if missing:
            sockets = {r: p for r, p in self.ctx.steps.flight_sockets().items() if r in missing}
            self.last_flight.update(read_flight(sockets, self.last_dumps))
        return self.last_flight

    def _waits(self, verdict: CulpritVerdict, pids: dict[int, int]) -> dict[int, Wait]:
        """What every rank outside a collective waits on, from the kernel (probes.waits) and its
        innermost frames (detect.waits). A wait counts as dead only when two rounds in a row
        found it dead the same way: a pipe or a peer caught between two states is not proof."""
        out: dict[int, Wait] = {}
        for r, p in verdict.positions.items():
            if p.waiting or p.kind in ("stopped", "gone", "exiting") or r not in pids:
                continue
            dump = self.last_dumps.get(r)
            main = dump.main_thread() if dump else None
            threads = sum(1 for t in dump.threads if t.frames) if dump else 0
            tids = [t.os_tid for t in dump.threads if t.frames and t.os_tid] if dump else []
            try:
                facts = waits.wait_facts(pids[r])
                frames = main.frames if main else ()
                w = classify_wait(facts, frames, threads, python_tids=tids)
                if w.dead and w.kind == "lock":  # a lock proof, unless a collective is in flight
                    w = classify_wait(facts, frames, threads, in_flight_of(self._flight([r]).get(r)), tids)
            except Exception:  # a probe must never end the watch
                log.exception("hang: could not read what rank %s waits on", r)
                continue
            prev = self.raw_waits.get(r)
            self.raw_waits[r] = w
            if w.dead and not (prev and prev.dead and (prev.kind, prev.proof) == (w.kind, w.proof)):
                w = dataclasses.replace(w, dead=False, proof="")  # seen dead once: confirmed next round
            out[r] = w
        return out

    def _stacks(
        self, pids: dict[int, int], steps: dict[int, list]
    ) -> tuple[CulpritVerdict, dict[int, stacks.StackDump], dict[int, RankView]]:
        dumps = stacks.dump_all(pids, timeout=STACK_TIMEOUT)
        self.last_flight = {}  # read only when a question needs it (see _flight)
        views: dict[int, RankView] = {}
        for rank, d in dumps.items():
            main = d.main_thread()
            others = [t.frames for t in d.threads if t is not main]
            cpu = self.detector.cpu_percent.get(rank, 0.0)
            busy = bool(main and (main.owns_gil or main.active)) or cpu >= 50.0
            last = steps.get(rank) or []
            error = d.error
            if error is None and not any(t.frames for t in d.threads):
                error = "no python frames: interpreter finalised (exiting)"
            views[rank] = RankView(
                rank=rank,
                state=d.state,
                frames=main.frames if main else (),
                busy=busy,
                error=error,
                last_step=last[-1].step if last else None,
                other_frames=others,
            )
        return find_culprit(views, nnodes=self.ctx.nnodes), dumps, views

    # ---- one verdict for the job (monitors/hang/exchange.py) ------------------------------------
    def _node_views(self, verdict: CulpritVerdict, progress: dict[int, Progress], declared: bool = False) -> NodeViews:
        return NodeViews.of(self.ctx, self.last_views, verdict, {r: p.kind for r, p in progress.items()}, declared)

    def _share(self, verdict: CulpritVerdict, progress: dict[int, Progress]) -> None:
        """This node's latest stacks and progress, for the other nodes' judgement."""
        assert self.exchange is not None
        try:
            self.exchange.publish(self._node_views(verdict, progress))
        except Exception as exc:  # the store going away must not stop the watch
            log.warning("hang: could not share stacks with the other nodes: %s", exc)

    def _others(self, wait_s: float, declared: bool) -> dict[int, NodeViews]:
        assert self.exchange is not None
        try:
            others = self.exchange.gather(wait_s, declared)
        except Exception as exc:
            log.warning("hang: could not read the other nodes' stacks: %s", exc)
            return {}
        self.remote_progress = {r: k for nv in others.values() for r, k in nv.progress.items()}
        return others

    def _with_other_nodes(self, verdict: CulpritVerdict, sv: StallVerdict) -> StallVerdict:
        """A local "no progress" verdict is only final when no rank on another node progresses:
        the ranks here may all wait for a long evaluation over there. (The other nodes judge the
        same stall from their own samples and stacks: give their views time to arrive.)"""
        assert self.exchange is not None
        local = verdict.positions
        if sv.culprit in local and not local[sv.culprit].waiting:
            return sv  # a culprit here, outside any collective: what the others do cannot clear it
        try:
            moving, rank = self.exchange.others_moving(max(5.0, 3 * self.cfg.period))
        except Exception as exc:  # the store going away must not stop the watch
            log.warning("hang: could not read the other nodes' progress: %s", exc)
            moving, rank = 0, None
        if moving:
            rank = rank if rank not in local else None
            who = f"rank {rank}" if rank is not None else "a rank"
            return StallVerdict("watch", rank, "", f"{who} on another node progresses")
        return sv

    def _claim_suspicion(self, a: Assessment, key: str | None = None) -> bool:
        """Whether this node records the suspicion: the first node to claim the incident (the
        stall after the job's latest step; ``key``: a later window of it) does, for the job."""
        if self.exchange is None:
            return True
        last = a.steps.last_step if a.steps else {}
        try:
            return self.exchange.claim_suspicion(key or (str(max(last.values())) if last else "start"))
        except Exception as exc:  # recording it here beats losing it
            log.warning("hang: could not agree with the other nodes on who records the suspicion: %s", exc)
            return True

    def _latest_nodes(self, verdict: CulpritVerdict, progress: dict[int, Progress]) -> dict[str, dict] | None:
        """Every node's latest view, without waiting (for a suspicion)."""
        if self.exchange is None:
            return None
        others = self._others(0.0, declared=False)
        return _by_node([self._node_views(verdict, progress), *others.values()])

    def _conclude(
        self, now: float, a: Assessment, sv: StallVerdict, verdict: CulpritVerdict, progress: dict[int, Progress],
        gather_s: float | None = None,
    ) -> HangEvidence | None:
        """This node found a hang. On one node: record it. On several: declare it, and either
        judge it for the job (the first to claim it, waiting ``gather_s`` for the others'
        declarations, gather_wait by default) or act on the verdict of the node that did."""
        ex = self.exchange
        if ex is None:
            return self._record(now, a, sv, verdict, progress)
        mine = self._node_views(verdict, progress, declared=True)
        wait = 2 * self.gather_wait
        try:
            ex.publish(mine)
            if ex.claim():
                return self._judge_for_job(now, a, sv, verdict, progress, mine,
                                           self.gather_wait if gather_s is None else gather_s)  # fmt: skip
            agreed = ex.verdict(wait)
        except Exception as exc:  # no store: this node's own verdict rather than none
            log.warning("hang: could not agree on a verdict with the other nodes (%s): recording this node's", exc)
            return self._record(now, a, sv, verdict, progress)
        if agreed is not None:
            return self._adopt(agreed)
        log.warning("hang: the node that claimed this hang gave no verdict in %.1fs: judging it here", wait)
        return self._judge_for_job(now, a, sv, verdict, progress, mine, 0.0)

    def _judge_for_job(
        self, now: float, a: Assessment, sv: StallVerdict, verdict: CulpritVerdict, progress: dict[int, Progress],
        mine: NodeViews, wait_s: float,
    ) -> HangEvidence | None:  # fmt: skip
        """The verdict for the whole job from every node's declaration (the latest view of a node
        that has not declared within ``wait_s``), written once to the store and recorded here
        unless another node's verdict stands already."""
        assert self.exchange is not None
        others = self._others(wait_s, declared=True)
        self.remote_views = {r: v for nv in others.values() for r, v in nv.views.items()}
        verdict, sv = self._merge_other_nodes(verdict, sv)
        kind, message, evidence, found = self._evidence(now, a, sv, verdict, progress, _by_node([mine, *others.values()]))
        try:
            stood = self.exchange.offer(found)
        except Exception as exc:
            log.warning("hang: could not write the job's verdict (%s): recording it here", exc)
            stood = found
        if stood is not found:  # a node that waited for this one judged meanwhile: its verdict stands
            if found.report:
                Path(found.report).unlink(missing_ok=True)
            return self._adopt(stood)
        self.ctx.events.emit(kind, message, severity="error", rank=found.rank, evidence=evidence)
        return found

    def _adopt(self, agreed: HangEvidence) -> HangEvidence:
        log.info("hang: acting on the job's verdict recorded by %s: culprit rank %s", agreed.recorded_by, agreed.rank)
        return dataclasses.replace(agreed, attempt=self.ctx.restart_count)

    def _merge_other_nodes(self, verdict: CulpritVerdict, sv: StallVerdict) -> tuple[CulpritVerdict, StallVerdict]:
        """When no local rank is the culprit, name it from every node's stacks."""
        if verdict.rank is not None or not self.remote_views:
            return verdict, sv
        merged = find_culprit({**self.remote_views, **self.last_views}, nnodes=1)
        if merged.rank is None:
            return verdict, sv
        if merged.rank not in self.last_views:
            merged.reason += f" (from the stacks of all {self.ctx.nnodes} nodes: rank {merged.rank} is on another node)"
        why = sv.why.replace(verdict.reason, merged.reason, 1) if verdict.reason and verdict.reason in sv.why else merged.reason
        return merged, dataclasses.replace(sv, culprit=merged.rank, why=why)

    def _moved_on(self, a: Assessment, pids: dict[int, int]) -> bool:
        later = time.time()
        samples = waits.with_net(proc.sample_workers(pids, later))
        self.history.add_procs(samples, self.ctx.steps.collectives())
        self.detector.observe(
            later,
            [Activity(r, x.io, x.cpu, x.state, x.alive, x.net) for r, x in samples.items()],
            self.gpu.read() if self.gpu else None,
        )
        if a.rule == "io+utilisation" and self.detector.last_io_change == later:
            return True
        if not any(x.alive and x.state not in ("Z", "X") for x in samples.values()):
            return True  # every worker has exited meanwhile: the agent takes it from here
        start = self.detector.start - 1.0  # an earlier attempt's steps are not this one's
        last_end = max((s.end for r in pids for s in self.ctx.steps.recent(r)[-1:] if s.end >= start), default=-math.inf)
        return a.steps is not None and last_end > a.steps.last_end

    def _record(
        self, now: float, a: Assessment, sv: StallVerdict, verdict: CulpritVerdict, progress: dict[int, Progress],
        nodes: dict[str, dict] | None = None,
    ) -> HangEvidence:
        """Record ``hang_suspected`` (warning) or ``hang_detected`` (error) with the evidence and the
        report file; hand the evidence to the policy."""
        kind, message, evidence, found = self._evidence(now, a, sv, verdict, progress, nodes)
        severity = "warning" if found.level == "suspected" else "error"
        self.ctx.events.emit(kind, message, severity=severity, rank=found.rank, evidence=evidence)
        return found

    def _evidence(
        self, now: float, a: Assessment, sv: StallVerdict, verdict: CulpritVerdict, progress: dict[int, Progress],
        nodes: dict[str, dict] | None,
    ) -> tuple[str, str, dict, HangEvidence]:
        """The event's kind, message and evidence (``nodes``: what each node saw, on several
        nodes) and the evidence for the policy; writes the report file."""
        ctx = self.ctx
        dumps = self.last_dumps
        level = sv.state
        rule = sv.rule or "steps"
        signals = dict(a.signals, progress={str(r): p.to_dict() for r, p in sorted(progress.items())},
                       limit_s=round(sv.limit, 2), phase=sv.phase,
                       waits={str(r): w.to_dict() for r, w in sorted(self.waits.items())})  # fmt: skip
        shown = dataclasses.replace(a, rule=rule, message=sv.why, signals=signals)
        if level == "detected":  # the verdict's sequence, from every local rank's recorder
            self._flight(sorted(verdict.positions))
        seq = sequence_finding(verdict, ctx.steps.collectives(), self.last_flight)
        report = None
        try:
            report = write_report(ctx.run_dir, HangReport(now, ctx.node, ctx.restart_count, shown, verdict, dumps,
                                                          self.remote_views, level, nodes or {}, seq.lines))  # fmt: skip
        except OSError as exc:  # a full disk must not stop the restart
            log.error("could not write the hang report: %s", exc)
        culprit = sv.culprit
        culprit_dump = dumps.get(culprit) if culprit is not None else None
        main = culprit_dump.main_thread() if culprit_dump else None
        who = f"rank {culprit}" if culprit is not None else "no single rank"
        causes = ", ".join(c["cause"] for c in verdict.causes) if level == "detected" else ""
        p = progress.get(culprit) if culprit is not None else None
        progress_kind = p.kind if p else self.remote_progress.get(culprit, "") if culprit is not None else ""
        reason = verdict.reason if culprit == verdict.rank else sv.why
        if level == "suspected":
            message = (f"hang suspected: no step for {a.stall:.0f}s (allowance {sv.limit:.0f}s); candidate {who}: "
                       f"{sv.why}. Not a hang yet: watching (hang_detected if a wait is proven dead, or if at "
                       f"--hang-detect-time ({self.cfg.detect_time:.0f}s) nothing in the job moves: no I/O, flat "
                       "utilisation, no rank progressing)")  # fmt: skip
        else:
            message = f"job hung ({rule}): culprit {who}: {sv.why}" + (f". Known causes: {causes}" if causes else "")
        if seq.lines:
            message += ". Sequence: " + "; ".join(seq.lines)
        if level == "detected" and self.notify_only:
            message += " (--hang-action notify: the workers are left running)"
        evidence = {
            "level": level,
            "rule": rule,
            "signals": signals,
            "culprit": culprit,
            "reason": reason,
            "doing": sv.why,
            "progress": p.to_dict() if p else ({"kind": progress_kind} if progress_kind else None),
            "candidates": verdict.candidates,
            "causes": verdict.causes,
            "stack": [str(f) for f in main.frames] if main else _remote_stack(self.remote_views, culprit),
            "stack_error": culprit_dump.error if culprit_dump else None,
            "wait": self.waits[culprit].to_dict() if culprit in self.waits else None,
            "ranks": {
                str(r): {
                    "pid": dumps[r].pid if r in dumps else None,
                    "state": dumps[r].state if r in dumps else None,
                    "summary": pos.describe(),
                    **pos.to_dict(),
                    **({"progress": progress[r].kind} if r in progress else {}),
                    **({"wait": self.waits[r].to_dict()} if r in self.waits else {}),
                }
                for r, pos in sorted(verdict.positions.items())
            },
            "report": str(report) if report else None,
            **({"sequence": seq.to_dict()} if seq.lines else {}),
            **({"flight_recorder": {str(r): v.to_dict() for r, v in sorted(self.last_flight.items())}}
               if self.last_flight else {}),
            "attempt": ctx.restart_count,
            "recorded_by": ctx.node,
            **({"nodes": nodes} if nodes else {}),
        }
        kind = "hang_suspected" if level == "suspected" else "hang_detected"
        return kind, message, evidence, HangEvidence(
            culprit, rule, reason, list(verdict.causes) if level == "detected" else [], evidence["report"],
            ctx.restart_count, level=level, progress=progress_kind, doing=sv.why, recorded_by=ctx.node,
        )  # fmt: skip


def in_flight_of(view: flight_recorder.FlightView | None) -> str:
    """The collective a rank has started and not finished, per its Flight Recorder ("" if none
    or unknown): an async collective's Work.wait() waits on it."""
    for g in view.groups.values() if view is not None else ():
        if g.in_flight is not None:
            return f"{g.in_flight.op} #{g.in_flight.seq} of process group {g.pg}" + (f" ({g.desc})" if g.desc else "")
    return ""


def read_flight(sockets: dict[int, str], dumps: dict[int, stacks.StackDump]) -> dict[int, flight_recorder.FlightView]:
    """The Flight Recorders of the local ranks whose stacks were dumped, except stopped ones (their
    server thread is stopped too: it would only cost the timeout) and gone ones."""
    paths = {r: p for r, p in sockets.items() if r in dumps and dumps[r].state not in ("", "T", "t", "Z", "X")}
    return flight_recorder.read_all(paths, timeout=FLIGHT_TIMEOUT) if paths else {}


def sequence_finding(verdict: CulpritVerdict, counts: dict[int, object],
                     flight: dict[int, flight_recorder.FlightView] | None = None) -> SequenceFinding:
    """Ranks waiting in different collectives, compared by torch's Flight Recorder where it shows
    them (its numbering is per process group, and it knows the call an NCCL rank waits on from its
    stream), else by the collective counters (the profiling monitor reads them from the rings into
    ``ctx.steps``; none without the hooks) and the calls the stacks show."""
    label, fcalls, fcounts = flight_calls({r: v.groups for r, v in (flight or {}).items() if v.groups})
    if fcalls:
        # The call site where the stack shows the rank in a collective; not where an NCCL rank
        # waits for its stream (that line is no collective's).
        sites = {r: pos.site for r, pos in verdict.positions.items() if pos.site and pos.kind in ("collective", "backward")}
        found = compare_sequences({r: InCall(c.op, sites.get(r, "")) for r, c in fcalls.items()}, fcounts)
        if found.lines:
            return dataclasses.replace(found, lines=[f"torch Flight Recorder, {label}:"] + found.lines)
    calls = {}
    for r, pos in verdict.positions.items():
        if pos.kind == "collective" and pos.op:
            calls[r] = InCall(pos.op, pos.site)
        elif pos.kind == "backward":
            calls[r] = InCall("ddp_gradient_all_reduce", pos.site)
    return compare_sequences(calls, counts)  # type: ignore[arg-type]


def _remote_stack(views: dict[int, RankView], rank: int | None) -> list[str]:
    view = views.get(rank) if rank is not None else None
    return [f"{f.name} ({f.filename}:{f.line})" for f in view.frames] if view else []


def _by_node(nodes: list[NodeViews]) -> dict[str, dict]:
    """What each node saw, by node name (node rank order)."""
    return {nv.node: nv.evidence() for nv in sorted(nodes, key=lambda nv: nv.node_rank)}


class HangMonitor(Monitor):
    name = "hang"

    def __init__(self, cfg: HangConfig, action: str = "restart") -> None:
        self.cfg = cfg
        self.notify_only = action == "notify"  # --hang-action notify: never hand a hang to the policy
        self._learned: dict[str, float] = {}
        self._lock = threading.Lock()
        self._evidence: list[HangEvidence] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._gpu: _Gpu | None = None
        self._watch: _Watch | None = None
        # The job's verdict, looked for from the agent's loop (several nodes): this attempt's
        # exchange on the agent's own store connection, when it was last read, and whether a
        # detected hang went to the policy already.
        self._follower: HangExchange | None = None
        self._followed_at = -math.inf
        self._handed = False

    def on_workers_started(self, ctx: MonitorContext) -> None:
        self._stop_thread()
        with self._lock:
            self._evidence = []
        self._stop = threading.Event()
        self._watch = watch = _Watch(ctx, self.cfg, self._learned, None, self.notify_only)
        self._follower = HangExchange.for_ctx(ctx, own_client=False)
        self._followed_at, self._handed = -math.inf, False
        self._thread = threading.Thread(target=self._run, args=(watch, self._stop), name="trainguard-hang", daemon=True)
        self._thread.start()

    def _run(self, watch: _Watch, stop: threading.Event) -> None:
        if self._gpu is None:  # NVML start-up can take a moment: never on the agent's thread
            self._gpu = _Gpu()
        watch.gpu = self._gpu
        try:  # a store connection of the watch's own (it waits on the store at times)
            watch.exchange = HangExchange.for_ctx(watch.ctx)
        except Exception as exc:
            log.warning("hang: no connection to the rendezvous store (%s): judging this node alone", exc)
        next_at = time.monotonic()
        while not stop.is_set():
            try:
                found = watch.round(time.time())
            except Exception:  # never let one bad round end the watch
                log.exception("hang monitor round failed")
                found = None
            if found is not None:
                with self._lock:
                    if not stop.is_set():
                        self._evidence.append(found)
                if found.level == "detected":
                    if not self.notify_only:
                        return  # one hang per attempt: the policy decides on it
                    watch.detected_here = True  # recorded and notified; the next stall is judged anew
            # (a suspicion is handed over and the watch goes on)
            next_at += self.cfg.period
            if next_at < time.monotonic():  # a slow round (stack dumps): skip, do not catch up
                next_at = time.monotonic() + self.cfg.period
            stop.wait(max(0.0, next_at - time.monotonic()))

    def poll(self, ctx: MonitorContext) -> HangEvidence | None:
        with self._lock:
            # A detected hang outranks a suspicion handed over in the same poll interval.
            found = max(self._evidence, key=lambda e: e.level == "detected") if self._evidence else None
            self._evidence = []
        if found is None:
            found = self._follow(ctx)
        if found is None or found.level != "detected":
            return found
        if self.notify_only:
            return None  # recorded and notified where it was found; the workers are left running
        if self._handed:
            return None  # one hang per attempt: the policy has decided on it
        self._handed = True
        return found

    def on_workers_failed(self, ctx: MonitorContext, failures: dict[int, RankFailure]) -> HangEvidence | None:
        """Workers failed while a hang verdict stands that the policy has not had yet: they failed
        because of it (on several nodes: another node restarted on the job's verdict and these
        ranks lost their peers), so the verdict goes with the failure."""
        with self._lock:
            found = next((e for e in self._evidence if e.level == "detected"), None)
            self._evidence = []
        if self._handed or self.notify_only:
            return None
        if found is None and self._follower is not None:
            try:
                found = self._follower.verdict()
            except Exception as exc:  # the store of a round whose host left
                log.debug("hang: could not look for the job's verdict: %s", exc)
        if found is None:
            return None
        self._handed = True
        return dataclasses.replace(found, attempt=ctx.restart_count)

    def _follow(self, ctx: MonitorContext) -> HangEvidence | None:
        """The job's verdict, recorded by another node (looked up every FOLLOW_STALLED_S while
        steps stall here, FOLLOW_IDLE_S otherwise): this node acts on it too. One recorded here
        comes from the watch itself, after the other nodes acted on it."""
        if self._follower is None or self._handed or self.notify_only:
            return None  # (notify only: the verdict was recorded where it was found; nothing to act on)
        now = time.monotonic()
        every = FOLLOW_STALLED_S if self._watch is not None and self._watch.stalled else FOLLOW_IDLE_S
        if now - self._followed_at < every:
            return None
        self._followed_at = now
        try:
            agreed = self._follower.verdict()
        except Exception as exc:  # the store of a round whose host left: try again later
            log.debug("hang: could not look for the job's verdict: %s", exc)
            return None
        if agreed is None or agreed.recorded_by == ctx.node:
            return None
        self._stop.set()  # this attempt's watch has nothing left to find
        log.info("hang: acting on the job's verdict recorded by %s: culprit rank %s", agreed.recorded_by, agreed.rank)
        return dataclasses.replace(agreed, attempt=ctx.restart_count)

    def _stop_thread(self) -> None:
        self._stop.set()
        t, self._thread = self._thread, None
        if t is not None and t is not threading.current_thread():
            # Short: a py-spy call in flight ends on its own timeout, and a stopped watch never
            # hands over its evidence.
            t.join(timeout=2.0)
        watch = self._watch
        if watch is not None and (t is None or not t.is_alive()):
            # An attempt that ended before any round saw a step (a few fast steps between two
            # rounds) still teaches the next attempt its first-step allowance: without it a rank
            # that hangs before its first step is judged only by the seed's 30 minutes.
            try:
                watch.learn_first_step()
            except Exception:  # never let bookkeeping stop the agent
                log.exception("hang: could not learn the first step")

    def on_workers_stopped(self, ctx: MonitorContext) -> None:
        self._stop_thread()

    def close(self) -> None:
        self._stop_thread()
