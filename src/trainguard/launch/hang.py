"""Hang monitor: finds a hung job in seconds, names the culprit rank and its stack.

It runs on its own thread (``poll`` only hands over the evidence): every ``--hang-period`` it reads
the I/O and CPU counters of every worker and its children (probes.proc), GPU utilisation through
NVML when there is one, and the step samples the profiling monitor puts into ``ctx.steps``. The pure
detector (detect.hang) says when the job looks hung; py-spy stacks (probes.stacks) then say where
every rank is, which rank is the culprit (detect.culprit), and whether a long pause is a checkpoint
save or an evaluation that has its own allowance. A confirmed hang is recorded as ``hang_detected``
with the evidence, written as a readable report in the run dir, and handed to the policy as
``HangEvidence`` (``policy.decide_on_hang``).
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
from dataclasses import dataclass, field
from typing import Any

from trainguard.detect.culprit import CulpritVerdict, RankView, find_culprit
from trainguard.detect.hang import Activity, Assessment, HangConfig, HangDetector, phase_allowance
from trainguard.evidence import HangEvidence
from trainguard.launch.hang_report import HangReport, write_report
from trainguard.launch.monitor import Monitor, MonitorContext
from trainguard.options import SettingsError, given, number
from trainguard.probes import nvml, proc, stacks

log = logging.getLogger(__name__)

STACK_TIMEOUT = 10.0
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


class _Watch:
    """One attempt's watch: samples, assesses, confirms with stacks. Runs on the monitor's thread."""

    def __init__(self, ctx: MonitorContext, cfg: HangConfig, learned: dict[str, float], gpu: _Gpu | None) -> None:
        self.ctx = ctx
        self.cfg = cfg
        self.learned = learned  # phase kind -> longest healthy pause seen (kept across attempts)
        self.gpu = gpu
        self.detector = HangDetector(cfg, start=time.time())
        self.allowance = 0.0
        self.phase = ""
        self.phase_since = -math.inf
        self.recheck_at = math.inf
        self.remote_views: dict[int, RankView] = {}  # other nodes' ranks, when they named the culprit
        self.exit_since: float | None = None  # when the workers were first seen shutting down
        self.hold_until = -math.inf  # no new stack dumps before this (a deferred seed-rule verdict)

    def round(self, now: float) -> HangEvidence | None:
        pids = self.ctx.pids()
        samples = proc.sample_workers(pids, now)
        if not any(s.alive and s.state not in ("Z", "X") for s in samples.values()):
            return None  # all workers exited: the agent handles that
        self.detector.observe(
            now,
            [Activity(r, s.io, s.cpu, s.state, s.alive) for r, s in samples.items()],
            self.gpu.read() if self.gpu else None,
        )
        steps = {r: self.ctx.steps.recent(r) for r in pids}
        a = self.detector.assess(now, steps, self.allowance)
        stats = a.steps
        if self.phase and stats is not None and stats.last_end > self.phase_since:
            # Steps resumed after a checkpoint save / evaluation: learn how long that kind takes.
            pause = stats.last_end - self.phase_since
            self.learned[self.phase] = max(self.learned.get(self.phase, 0.0), pause)
            log.info("hang: %s pause of %.1fs ended; allowance learned", self.phase, pause)
            self.phase, self.allowance, self.recheck_at = "", 0.0, math.inf
        if a.hang and now >= self.hold_until:
            return self._confirm(now, a, pids)
        if self.phase and now >= self.recheck_at:
            # Still paused: is it still the checkpoint/eval, or did it end in a hang?
            plain = self.detector.assess(now, steps, 0.0)
            if plain.hang:
                verdict, _, _ = self._stacks(pids, steps)
                if not verdict.phase:
                    self.phase, self.allowance = "", 0.0
                    return self._confirm(now, plain, pids)
            self.recheck_at = now + self._recheck_every(a)
        return None

    def _recheck_every(self, a: Assessment) -> float:
        threshold = a.steps.threshold if a.steps and a.steps.ready else 0.0
        return max(10.0, threshold, 3 * self.cfg.period)

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

    def _confirm(self, now: float, a: Assessment, pids: dict[int, int]) -> HangEvidence | None:
        steps = {r: self.ctx.steps.recent(r) for r in pids}
        verdict, dumps, views = self._stacks(pids, steps)
        stats = a.steps
        if self._moved_on(a, pids):
            return None  # a step finished or I/O happened while we looked: slow, not hung
        if verdict.phase == "exit" and a.rule != "steps":
            # Training is over and the processes are shutting down; only a shutdown that itself
            # lasts detect_time is a hang.
            self.exit_since = now if self.exit_since is None else self.exit_since
            if now - self.exit_since < self.cfg.detect_time:
                self.hold_until = now + self._recheck_every(a)
                return None
        if a.rule == "steps" and verdict.phase and stats is not None:
            limit = phase_allowance(self.learned.get(verdict.phase), stats.threshold, self.cfg)
            if a.stall <= limit:
                # A checkpoint save or an evaluation: healthy long pause with its own allowance.
                if self.phase != verdict.phase:
                    log.info("hang: %s in progress, allowing %.0fs without a step", verdict.phase, limit)
                self.phase, self.allowance = verdict.phase, limit
                self.phase_since = stats.last_end
                self.recheck_at = now + self._recheck_every(a)
                return None
        if self.ctx.nnodes > 1 and self.ctx.store is not None:
            verdict = self._with_other_nodes(verdict, views)
        return self._declare(now, a, verdict, dumps)

    def _with_other_nodes(self, verdict: CulpritVerdict, views: dict[int, RankView]) -> CulpritVerdict:
        """Share this node's stacks through the rendezvous store; when no local rank is the
        culprit, look at the other nodes' stacks too (they see the same hang within seconds)."""
        ctx = self.ctx
        store = _client(ctx.store)
        try:
            publish_views(store, ctx.restart_count, ctx.node_rank, views)
            # Wait for the other nodes' stacks even when the culprit is here: they see the same hang
            # within seconds, and declaring before them would restart the job under their feet.
            remote = gather_views(store, ctx.restart_count, ctx.node_rank, ctx.nnodes, max(5.0, 3 * self.cfg.period))
        except Exception as exc:  # the store going away must not stop the restart
            log.warning("hang: could not share stacks with the other nodes: %s", exc)
            return verdict
        if remote:
            self.remote_views = remote
        if verdict.rank is not None or not remote:
            return verdict
        merged = find_culprit({**remote, **views}, nnodes=1)
        if merged.rank is None:
            return verdict
        self.remote_views = remote
        if merged.rank not in views:
            merged.reason += f" (from the stacks of all {ctx.nnodes} nodes: rank {merged.rank} is on another node)"
        return merged

    def _moved_on(self, a: Assessment, pids: dict[int, int]) -> bool:
        later = time.time()
        samples = proc.sample_workers(pids, later)
        self.detector.observe(
            later,
            [Activity(r, x.io, x.cpu, x.state, x.alive) for r, x in samples.items()],
            self.gpu.read() if self.gpu else None,
        )
        if self.detector.last_io_change == later:
            return True
        if not any(x.alive and x.state not in ("Z", "X") for x in samples.values()):
            return True  # every worker has exited meanwhile: the agent takes it from here
        last_end = max((s.end for r in pids for s in self.ctx.steps.recent(r)[-1:]), default=-math.inf)
        return a.steps is not None and last_end > a.steps.last_end

    def _declare(self, now: float, a: Assessment, verdict: CulpritVerdict, dumps: dict[int, stacks.StackDump]) -> HangEvidence:
        ctx = self.ctx
        report = None
        try:
            report = write_report(ctx.run_dir, HangReport(now, ctx.node, ctx.restart_count, a, verdict, dumps, self.remote_views))
        except OSError as exc:  # a full disk must not stop the restart
            log.error("could not write the hang report: %s", exc)
        culprit_dump = dumps.get(verdict.rank) if verdict.rank is not None else None
        main = culprit_dump.main_thread() if culprit_dump else None
        who = f"rank {verdict.rank}" if verdict.rank is not None else "no single rank"
        causes = ", ".join(c["cause"] for c in verdict.causes)
        message = f"job hung ({a.rule}): culprit {who}: {verdict.reason}. {a.message}" + (
            f". Known causes: {causes}" if causes else ""
        )
        evidence = {
            "rule": a.rule,
            "signals": a.signals,
            "culprit": verdict.rank,
            "reason": verdict.reason,
            "candidates": verdict.candidates,
            "causes": verdict.causes,
            "stack": [str(f) for f in main.frames] if main else _remote_stack(self.remote_views, verdict.rank),
            "stack_error": culprit_dump.error if culprit_dump else None,
            "ranks": {
                str(r): {
                    "pid": dumps[r].pid if r in dumps else None,
                    "state": dumps[r].state if r in dumps else None,
                    "summary": p.describe(),
                    **p.to_dict(),
                }
                for r, p in sorted(verdict.positions.items())
            },
            "report": str(report) if report else None,
            "attempt": ctx.restart_count,
        }
        ctx.events.emit("hang_detected", message, severity="error", rank=verdict.rank, evidence=evidence)
        return HangEvidence(verdict.rank, a.rule, verdict.reason, list(verdict.causes), evidence["report"], ctx.restart_count)


HANG_VIEWS_KEY = "trainguard/hang/{attempt}/{node_rank}"


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


def publish_views(store: Any, attempt: int, node_rank: int, views: dict[int, RankView]) -> None:
    data = {str(r): view_to_dict(v) for r, v in views.items()}
    store.set(HANG_VIEWS_KEY.format(attempt=attempt, node_rank=node_rank), json.dumps(data))


def gather_views(store: Any, attempt: int, node_rank: int, nnodes: int, wait_s: float) -> dict[int, RankView]:
    """The other nodes' published views, waiting up to wait_s for all of them (fewer is fine)."""
    keys = [HANG_VIEWS_KEY.format(attempt=attempt, node_rank=n) for n in range(nnodes) if n != node_rank]
    deadline = time.monotonic() + wait_s
    while True:
        ready = [k for k in keys if store.check([k])]
        if len(ready) == len(keys) or time.monotonic() >= deadline:
            break
        time.sleep(0.2)
    views: dict[int, RankView] = {}
    for key in ready:
        try:
            data = json.loads(store.get(key))
            views.update({int(r): view_from_dict(int(r), d) for r, d in data.items()})
        except (ValueError, TypeError, KeyError) as exc:
            log.warning("hang: ignoring malformed stacks under %s: %s", key, exc)
    return views


class HangMonitor(Monitor):
    name = "hang"

    def __init__(self, cfg: HangConfig) -> None:
        self.cfg = cfg
        self._learned: dict[str, float] = {}
        self._lock = threading.Lock()
        self._evidence: HangEvidence | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._gpu: _Gpu | None = None

    def on_workers_started(self, ctx: MonitorContext) -> None:
        self._stop_thread()
        with self._lock:
            self._evidence = None
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
                        self._evidence = found
                return  # one hang per attempt: the policy restarts the group
            next_at += self.cfg.period
            if next_at < time.monotonic():  # a slow round (stack dumps): skip, do not catch up
                next_at = time.monotonic() + self.cfg.period
            stop.wait(max(0.0, next_at - time.monotonic()))

    def poll(self, ctx: MonitorContext) -> HangEvidence | None:
        with self._lock:
            found, self._evidence = self._evidence, None
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
