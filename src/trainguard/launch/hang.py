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
and handed to the policy as ``HangEvidence`` (``policy.decide_on_hang`` decides).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import os
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from trainguard.detect.culprit import CulpritVerdict, RankView, find_culprit
from trainguard.detect.hang import (
    Activity,
    Assessment,
    HangConfig,
    HangDetector,
    busy_limit,
    first_step_allowance,
    phase_allowance,
)
from trainguard.detect.progress import (
    BUSY,
    PROGRESSING,
    Limits,
    Progress,
    RankSamples,
    StallVerdict,
    decide_stall,
    judge_progress,
    phase_of,
)
from trainguard.evidence import HangEvidence
from trainguard.launch.hang_report import HangReport, write_report
from trainguard.launch.monitor import Monitor, MonitorContext
from trainguard.options import SettingsError, given, number
from trainguard.probes import nvml, proc, stacks

log = logging.getLogger(__name__)

STACK_TIMEOUT = 10.0
FIRST_STEP = "first_step"  # key of the learned first-step time (beside the phases' pauses)
# Environment names for --hang-detect-time, in order of preference (the seed's name is an alias).
DETECT_TIME_ENV = ("TRAINGUARD_HANG_DETECT_TIME", "MA_HANG_DETECT_TIME")


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

    @classmethod
    def from_options(cls, options: argparse.Namespace) -> HangSettings:
        if options.no_hang_detect:
            return cls(enabled=False)  # the environment is not even read
        fields = given(options, {"period": "hang_period", "step_slack": "hang_step_slack"})
        minutes = options.hang_detect_time or _env_minutes()
        if minutes is not None:
            fields["detect_time"] = minutes * 60.0
        return cls(config=dataclasses.replace(HangConfig(), **fields))


def create(options: argparse.Namespace) -> Monitor | None:
    settings = HangSettings.from_options(options)
    return HangMonitor(settings.config) if settings.enabled else None


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
        keep = int(max(cfg.window, 4 * cfg.stack_every) / cfg.period) + 8
        self.procs: dict[int, deque[proc.ProcSample]] = {}
        self.stacks: dict[int, deque[tuple[float, tuple[stacks.Frame, ...] | None]]] = {}
        self.same_since: dict[int, float] = {}  # rank -> when its main-thread stack last changed
        self._keep = keep

    def add_procs(self, samples: dict[int, proc.ProcSample]) -> None:
        for r, s in samples.items():
            self.procs.setdefault(r, deque(maxlen=self._keep)).append(s)

    def add_stacks(self, when: float, views: dict[int, RankView]) -> None:
        for r, v in views.items():
            frames = tuple(v.frames) if v.frames else None
            q = self.stacks.setdefault(r, deque(maxlen=16))
            prev = next((f for _, f in reversed(q) if f is not None), None)
            if frames is not None and (prev is None or _sig(frames) != _sig(prev)):
                self.same_since[r] = when
            q.append((when, frames))

    def clear_stacks(self) -> None:
        self.stacks.clear()
        self.same_since.clear()

    def samples(self, rank: int, now: float, cfg: HangConfig, since: float) -> RankSamples:
        """The rank's window: ``cfg.window`` seconds (or the last 3 stack samples when they go
        further back), never before ``since`` (the stall's start: the last step's own log line
        is no progress of the stall)."""
        st = list(self.stacks.get(rank, ()))
        start = now - cfg.window
        if len(st) >= 3:
            start = min(start, st[-3][0])
        start = max(start, since)
        st = [(t, f) for t, f in st if t >= start - 1e-6]
        ps = [p for p in self.procs.get(rank, ()) if p.time >= start - 1e-6]
        return RankSamples(
            rank,
            times=[p.time for p in ps],
            states=[p.state if p.alive else "" for p in ps],
            cpu=[p.cpu for p in ps],
            io=[p.io for p in ps],
            stacks=[f for _, f in st],
        )


def _sig(frames: tuple[stacks.Frame, ...]) -> tuple[tuple[str, str, int], ...]:
    return tuple((f.name, f.filename, f.line) for f in frames)


class _Watch:
    """One attempt's watch: samples, judges stalls by the ranks' progress. Runs on the monitor's thread."""

    def __init__(self, ctx: MonitorContext, cfg: HangConfig, learned: dict[str, float], gpu: _Gpu | None) -> None:
        self.ctx = ctx
        self.cfg = cfg
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
        self.exit_since: float | None = None  # when the workers were first seen shutting down
        self.hold_until = -math.inf  # no new stack dumps before this (a deferred seed-rule verdict)
        self.last_dumps: dict[int, stacks.StackDump] = {}
        self.last_verdict: CulpritVerdict | None = None
        self.last_views: dict[int, RankView] = {}
        self.first_step_seen = False
        # rank -> the healthy phase its stacks showed during this stall: one sample inside the
        # user's own evaluation loop body must not lose the evaluation the others showed.
        self.recent_phase: dict[int, str] = {}

    def round(self, now: float) -> HangEvidence | None:
        pids = self.ctx.pids()
        samples = proc.sample_workers(pids, now)
        if not any(s.alive and s.state not in ("Z", "X") for s in samples.values()):
            return None  # all workers exited: the agent handles that
        self.history.add_procs(samples)
        self.detector.observe(
            now,
            [Activity(r, s.io, s.cpu, s.state, s.alive) for r, s in samples.items()],
            self.gpu.read() if self.gpu else None,
        )
        steps = {r: self.ctx.steps.recent(r) for r in pids}
        a = self.detector.assess(now, steps)
        if a.hang and now >= self.hold_until:
            return self._seed_rule(now, a, pids)
        stats = a.steps
        if stats is None:
            return None
        if stats.last_end == -math.inf:
            # No step yet in this attempt: judged only once an earlier attempt showed how long its
            # first step took (compile, warm-up, loading); before that only the seed rule watches.
            allowed = first_step_allowance(self.learned.get(FIRST_STEP), self.cfg)
            if allowed is None:
                return None
            since, stall, threshold = self.detector.start, now - self.detector.start, allowed
        else:
            if not self.first_step_seen:
                self._learn_first_step(steps)
            if stats.last_end > self.stall_from:
                self._steps_resumed(now, stats.last_end)
            since, stall = stats.last_end, a.stall
            threshold = stats.threshold if stats.ready else math.inf
        if stall < min(0.5 * threshold, self.cfg.detect_time):
            return None
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
        if verdict is None or (stall <= threshold and stall < self.cfg.detect_time):
            return None
        return self._judge(now, dataclasses.replace(a, stall=stall), verdict, pids, since, threshold)

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
        if self.suspected is not None:
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
        self.history.clear_stacks()
        self.recent_phase.clear()
        self.next_stacks = -math.inf

    def _judge(
        self, now: float, a: Assessment, verdict: CulpritVerdict, pids: dict[int, int], since: float, threshold: float
    ) -> HangEvidence | None:
        """The verdict on a stall of ``a.stall`` seconds (since ``since``, over ``threshold``)."""
        cfg = self.cfg
        verdict = dataclasses.replace(verdict, positions={
            r: p if phase_of(p) else dataclasses.replace(p, phase=self.recent_phase.get(r, ""))
            for r, p in verdict.positions.items()
        })  # fmt: skip
        progress = {
            r: judge_progress(self.history.samples(r, now, cfg, since), cfg, waiting=p.waiting)
            for r, p in verdict.positions.items()
        }
        threshold = min(threshold, cfg.detect_time)
        limits = Limits(
            threshold=threshold,
            detect_time=cfg.detect_time,
            allowance=lambda r, ph: phase_allowance(self.learned.get(ph), threshold, cfg, recognised=bool(ph)),
            busy_limit=lambda r, ph: busy_limit(self.learned.get(ph), cfg),
            frozen_for={r: now - t for r, t in self.history.same_since.items()},
        )
        sv = decide_stall(verdict, progress, a.stall, limits)
        self.stall_phases.update(phase_of(p) for p in verdict.positions.values() if phase_of(p))
        multinode = self.ctx.nnodes > 1 and self.ctx.store is not None
        if multinode:
            self._publish(progress)
        if sv.state == "detected" and sv.rule == "steps" and multinode:
            verdict, sv = self._with_other_nodes(verdict, sv)
        if sv.state != "suspected":
            self.suspect_since = None
        elif self.suspected is None:
            # Recorded once it held for a window: a log line written just before a rank blocked
            # reads as I/O progress for a moment; the window it leaves decides.
            self.suspect_since = now if self.suspect_since is None else self.suspect_since
            if now - self.suspect_since < cfg.window:
                return None
            self.suspected = sv
            return self._record(now, a, sv, verdict, progress)
        if sv.state != "detected":
            return None
        if self._moved_on(a, pids):
            return None  # a step finished while we looked: slow, not hung
        return self._record(now, a, sv, verdict, progress)

    def _seed_rule(self, now: float, a: Assessment, pids: dict[int, int]) -> HangEvidence | None:
        steps = {r: self.ctx.steps.recent(r) for r in pids}
        verdict, dumps, views = self._stacks(pids, steps)
        self.last_dumps = dumps
        if self._moved_on(a, pids):
            return None
        if verdict.phase == "exit":
            # Training is over and the processes are shutting down; only a shutdown that itself
            # lasts detect_time is a hang.
            self.exit_since = now if self.exit_since is None else self.exit_since
            if now - self.exit_since < self.cfg.detect_time:
                self.hold_until = now + max(10.0, 3 * self.cfg.period)
                return None
        if self.ctx.nnodes > 1 and self.ctx.store is not None:
            verdict = self._merge_other_nodes(verdict, views)
        sv = StallVerdict("detected", verdict.rank, a.rule, f"{verdict.reason}. {a.message}")
        return self._record(now, a, sv, verdict, {})

    def _stacks(
        self, pids: dict[int, int], steps: dict[int, list]
    ) -> tuple[CulpritVerdict, dict[int, stacks.StackDump], dict[int, RankView]]:
        dumps = stacks.dump_all(pids, timeout=STACK_TIMEOUT)
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

    def _publish(self, progress: dict[int, Progress]) -> None:
        """This node's latest stacks and progress, for the other nodes' verdicts."""
        try:
            publish_views(_client(self.ctx.store), self.ctx.restart_count, self.ctx.node_rank, self.last_views,
                          {r: p.kind for r, p in progress.items()})  # fmt: skip
        except Exception as exc:  # the store going away must not stop the watch
            log.warning("hang: could not share stacks with the other nodes: %s", exc)

    def _gather(self, key: str) -> dict[int, RankView]:
        ctx = self.ctx
        # The other nodes judge the same stall from their own samples and stacks (a window, a few
        # py-spy dumps on busy machines): give their verdicts time to arrive.
        wait = max(5.0, 3 * self.cfg.period) if key == HANG_VIEWS_KEY else max(10.0, 3 * self.cfg.period)
        try:
            remote, progress = gather_views(_client(ctx.store), ctx.restart_count, ctx.node_rank, ctx.nnodes, wait, key)
        except Exception as exc:
            log.warning("hang: could not read the other nodes' stacks: %s", exc)
            return {}
        if key == HANG_VIEWS_KEY:
            self.remote_progress = progress
        return remote

    def _with_other_nodes(self, verdict: CulpritVerdict, sv: StallVerdict) -> tuple[CulpritVerdict, StallVerdict]:
        """A local "no progress" verdict is only final when no rank on another node progresses:
        the ranks here may all wait for a long evaluation over there."""
        local = verdict.positions
        self._gather(HANG_VIEWS_KEY)
        moving = [r for r, k in self.remote_progress.items() if k in (PROGRESSING, BUSY) and r not in local]
        culprit_dead = sv.culprit in local and not local[sv.culprit].waiting
        if moving and not culprit_dead:
            r = moving[0]
            return verdict, StallVerdict("watch", r, "", f"rank {r} on another node progresses")
        merged = self._merge_other_nodes(verdict, self.last_views)
        if merged is not verdict:
            sv = dataclasses.replace(sv, culprit=merged.rank, why=merged.reason)
        return merged, sv

    def _merge_other_nodes(self, verdict: CulpritVerdict, views: dict[int, RankView]) -> CulpritVerdict:
        """Share this node's stacks at its verdict; when no local rank is the culprit, look at the
        other nodes' stacks too. Waits for the other nodes' verdicts even when the culprit is
        here: they see the same hang within seconds, and declaring before them would restart the
        job under their feet."""
        try:
            publish_views(_client(self.ctx.store), self.ctx.restart_count, self.ctx.node_rank, views, {},
                          HANG_DECIDED_KEY)  # fmt: skip
        except Exception as exc:
            log.warning("hang: could not share stacks with the other nodes: %s", exc)
        remote = self._gather(HANG_DECIDED_KEY)
        if remote:
            self.remote_views = remote
        if verdict.rank is not None or not remote:
            return verdict
        merged = find_culprit({**remote, **views}, nnodes=1)
        if merged.rank is None:
            return verdict
        if merged.rank not in views:
            merged.reason += f" (from the stacks of all {self.ctx.nnodes} nodes: rank {merged.rank} is on another node)"
        return merged

    def _moved_on(self, a: Assessment, pids: dict[int, int]) -> bool:
        later = time.time()
        samples = proc.sample_workers(pids, later)
        self.history.add_procs(samples)
        self.detector.observe(
            later,
            [Activity(r, x.io, x.cpu, x.state, x.alive) for r, x in samples.items()],
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
        self, now: float, a: Assessment, sv: StallVerdict, verdict: CulpritVerdict, progress: dict[int, Progress]
    ) -> HangEvidence:
        """Record ``hang_suspected`` (warning) or ``hang_detected`` (error) with the evidence and the
        report file; hand the evidence to the policy."""
        ctx = self.ctx
        dumps = self.last_dumps
        level = sv.state
        rule = sv.rule or "steps"
        signals = dict(a.signals, progress={str(r): p.to_dict() for r, p in sorted(progress.items())},
                       limit_s=round(sv.limit, 2), phase=sv.phase)  # fmt: skip
        shown = dataclasses.replace(a, rule=rule, message=sv.why, signals=signals)
        report = None
        try:
            report = write_report(ctx.run_dir, HangReport(now, ctx.node, ctx.restart_count, shown, verdict, dumps,
                                                          self.remote_views, level))  # fmt: skip
        except OSError as exc:  # a full disk must not stop the restart
            log.error("could not write the hang report: %s", exc)
        culprit = sv.culprit
        culprit_dump = dumps.get(culprit) if culprit is not None else None
        main = culprit_dump.main_thread() if culprit_dump else None
        who = f"rank {culprit}" if culprit is not None else "no single rank"
        causes = ", ".join(c["cause"] for c in verdict.causes) if level == "detected" else ""
        p = progress.get(culprit) if culprit is not None else None
        reason = verdict.reason if culprit == verdict.rank else sv.why
        if level == "suspected":
            message = (f"hang suspected: no step for {a.stall:.0f}s (allowance {sv.limit:.0f}s); candidate {who}: "
                       f"{sv.why}. Not a hang yet: watching (hang_detected if progress stops, or after "
                       f"{self.cfg.detect_time:.0f}s without a step)")  # fmt: skip
        else:
            message = f"job hung ({rule}): culprit {who}: {sv.why}" + (f". Known causes: {causes}" if causes else "")
        evidence = {
            "level": level,
            "rule": rule,
            "signals": signals,
            "culprit": culprit,
            "reason": reason,
            "doing": sv.why,
            "progress": p.to_dict() if p else None,
            "candidates": verdict.candidates,
            "causes": verdict.causes,
            "stack": [str(f) for f in main.frames] if main else _remote_stack(self.remote_views, culprit),
            "stack_error": culprit_dump.error if culprit_dump else None,
            "ranks": {
                str(r): {
                    "pid": dumps[r].pid if r in dumps else None,
                    "state": dumps[r].state if r in dumps else None,
                    "summary": pos.describe(),
                    **pos.to_dict(),
                    **({"progress": progress[r].kind} if r in progress else {}),
                }
                for r, pos in sorted(verdict.positions.items())
            },
            "report": str(report) if report else None,
            "attempt": ctx.restart_count,
        }
        kind, severity = ("hang_suspected", "warning") if level == "suspected" else ("hang_detected", "error")
        ctx.events.emit(kind, message, severity=severity, rank=culprit, evidence=evidence)
        return HangEvidence(
            culprit, rule, reason, list(verdict.causes) if level == "detected" else [], evidence["report"],
            ctx.restart_count, level=level, progress=p.kind if p else "", doing=sv.why,
        )  # fmt: skip


# Each node's latest stacks and progress while steps stall; its stacks again when it declares.
HANG_VIEWS_KEY = "trainguard/hang/{attempt}/{node_rank}"
HANG_DECIDED_KEY = "trainguard/hang/{attempt}/{node_rank}/declared"


def _remote_stack(views: dict[int, RankView], rank: int | None) -> list[str]:
    view = views.get(rank) if rank is not None else None
    return [f"{f.name} ({f.filename}:{f.line})" for f in view.frames] if view else []


def _client(store: Any) -> Any:
    """A connection of our own for this thread (TCPStore clients are cheap), else the shared one."""
    try:
        return store.clone()
    except Exception:
        return store


def view_to_dict(v: RankView) -> dict[str, Any]:
    return {
        "state": v.state,
        "frames": [[f.name, f.filename, f.line] for f in v.frames],
        "busy": v.busy,
        "error": v.error,
        "last_step": v.last_step,
    }


def view_from_dict(rank: int, d: dict[str, Any]) -> RankView:
    return RankView(
        rank=rank,
        state=str(d.get("state", "")),
        frames=tuple(stacks.Frame(str(n), str(f), int(ln)) for n, f, ln in d.get("frames") or []),
        busy=bool(d.get("busy")),
        error=d.get("error"),
        last_step=d.get("last_step"),
    )


def publish_views(
    store: Any,
    attempt: int,
    node_rank: int,
    views: dict[int, RankView],
    progress: dict[int, str] | None = None,
    key: str = HANG_VIEWS_KEY,
) -> None:
    """This node's views, each with the rank's progress kind (detect.progress) when judged."""
    data = {str(r): {**view_to_dict(v), "progress": (progress or {}).get(r, "")} for r, v in views.items()}
    store.set(key.format(attempt=attempt, node_rank=node_rank), json.dumps(data))


def gather_views(
    store: Any, attempt: int, node_rank: int, nnodes: int, wait_s: float, key: str = HANG_VIEWS_KEY
) -> tuple[dict[int, RankView], dict[int, str]]:
    """The other nodes' published views and progress kinds, waiting up to wait_s for all of them
    (fewer is fine)."""
    keys = [key.format(attempt=attempt, node_rank=n) for n in range(nnodes) if n != node_rank]
    deadline = time.monotonic() + wait_s
    while True:
        ready = [k for k in keys if store.check([k])]
        if len(ready) == len(keys) or time.monotonic() >= deadline:
            break
        time.sleep(0.2)
    views: dict[int, RankView] = {}
    progress: dict[int, str] = {}
    for key in ready:
        try:
            data = json.loads(store.get(key))
            views.update({int(r): view_from_dict(int(r), d) for r, d in data.items()})
            progress.update({int(r): str(d.get("progress") or "") for r, d in data.items()})
        except (ValueError, TypeError, KeyError, AttributeError) as exc:
            log.warning("hang: ignoring malformed stacks under %s: %s", key, exc)
    return views, progress


class HangMonitor(Monitor):
    name = "hang"

    def __init__(self, cfg: HangConfig) -> None:
        self.cfg = cfg
        self._learned: dict[str, float] = {}
        self._lock = threading.Lock()
        self._evidence: list[HangEvidence] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._gpu: _Gpu | None = None

    def on_workers_started(self, ctx: MonitorContext) -> None:
        self._stop_thread()
        with self._lock:
            self._evidence = []
        self._stop = threading.Event()
        watch = _Watch(ctx, self.cfg, self._learned, None)
        self._thread = threading.Thread(target=self._run, args=(watch, self._stop), name="trainguard-hang", daemon=True)
        self._thread.start()

    def _run(self, watch: _Watch, stop: threading.Event) -> None:
        if self._gpu is None:  # NVML start-up can take a moment: never on the agent's thread
            self._gpu = _Gpu()
        watch.gpu = self._gpu
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
                    return  # one hang per attempt: the policy decides on it
            # (a suspicion is handed over and the watch goes on)
            next_at += self.cfg.period
            if next_at < time.monotonic():  # a slow round (stack dumps): skip, do not catch up
                next_at = time.monotonic() + self.cfg.period
            stop.wait(max(0.0, next_at - time.monotonic()))

    def poll(self, ctx: MonitorContext) -> HangEvidence | None:
        with self._lock:
            if not self._evidence:
                return None
            # A detected hang outranks a suspicion handed over in the same poll interval.
            found = max(self._evidence, key=lambda e: e.level == "detected")
            self._evidence = []
        return found

    def _stop_thread(self) -> None:
        self._stop.set()
        t, self._thread = self._thread, None
        if t is not None and t is not threading.current_thread():
            # Short: a py-spy call in flight ends on its own timeout, and a stopped watch never
            # hands over its evidence.
            t.join(timeout=2.0)

    def on_workers_stopped(self, ctx: MonitorContext) -> None:
        self._stop_thread()

    def close(self) -> None:
        self._stop_thread()
