"""Hang verdicts on real gloo jobs (CPU): false positives over the healthy matrix beside the
detection latency of the fault matrix, in the same run.

Healthy: tests/scripts/healthy_phases.py, one job with every long legitimate phase (a first step
30 s slower, rank-0-only evaluation 40 s while the others wait in a barrier, all ranks evaluating
30 s, a rank-0 save of 1 GB then a barrier, a DataLoader blocking 20 s at an epoch boundary,
gradient accumulation throughout) under the production settings; a false positive is a
``hang_detected`` or a restart decision (goal 0). Suspicions (warnings) are counted beside.

Faults: tests/scripts/hang_worker.py, a rank hangs at a known moment (it prints `fault=... t=`
just before); latency is the time until the hang monitor hands the RESTART decision over (the
monitor driven as the agent drives it, step samples fed as the profiling monitor feeds them),
production settings (period 1 s, slack 5 s). The endless loop is only a suspicion within seconds
and a detected hang at --hang-detect-time (here --loop-detect-time).

Wait patterns: tests/scripts/wait_patterns.py, long waits from real usage — healthy
ones on the outside world (downloads at 40 KB/s from a local slow server, uploads, idle
children, sleeps, files, locks, recompiles, FSDP2 accumulation, persistent DataLoader workers, a
slow sync) and the same waits made dead (frozen server, stopped child, a recv never sent, a pipe
only the rank itself can write, a lock it holds itself ...). The frozen third (PATTERNS[...].frozen,
held out while the detector was tuned) is reported on its own line. ``--jobs`` runs patterns side
by side.

Window patterns: tests/scripts/window_patterns.py, healthy work that outlasts --hang-detect-time
(--window-detect-time here; the work lasts 1.4 x as long): evaluations with and without I/O, a
slow fsynced save, tokenising or compiling before the first step, pickling inside object
collectives, an upload at the exit, accumulation, DataLoader decoding, an evaluator child, HF
Trainer and Lightning evaluation; and the same shapes made dead (a spin, judged at the window; a
stopped rank; a thread deadlock; a pipe cycle; DataLoader workers on a lock inherited at fork).

The peer is torchrun + gloo without trainguard: a hung collective only ends when the process
group's timeout fires, *stated* from torch's default (default_pg_timeout), not waited for.

    python bench/hang.py
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "scripts"))

from hang_harness import Attempt, hang_events, run_job  # noqa: E402

from trainguard.detect.hang import percentile  # noqa: E402
from trainguard.monitors.hang.monitor import HangConfig, HangMonitor  # noqa: E402

HEALTHY = ROOT / "tests" / "scripts" / "healthy_phases.py"
WAITS = ROOT / "tests" / "scripts" / "wait_patterns.py"
WINDOW = ROOT / "tests" / "scripts" / "window_patterns.py"
FAULTS = {  # fault -> (world, culprit rank)
    "stop": (2, 1),
    "sleep": (2, 1),
    "cblock": (2, 1),
    "savestop": (2, 1),
    "mismatch": (3, 1),
}


def p99_step(a: Attempt) -> float:
    intervals = []
    for samples in a.steps.values():
        ends = [s.end for s in samples]
        intervals += [b - x for x, b in zip(ends, ends[1:], strict=False)]
    return percentile(intervals, 99) if intervals else float("nan")


def healthy(cfg: HangConfig, scale: float) -> tuple[int, int, int]:
    """(false positives, suspicions, phases) over one run of the healthy matrix."""
    with tempfile.TemporaryDirectory(prefix="tg-hang-bench-") as tmp:
        t0 = time.monotonic()
        attempts, detected = run_job(Path(tmp), HangMonitor(cfg), 2, ["--scale", str(scale)], deadline_s=900.0,
                                     max_attempts=1, worker=HEALTHY)  # fmt: skip
        kinds = [e.kind for e in hang_events(Path(tmp))]
        a = attempts[0]
        phases = [ln for ln in a.output[0] if ln.startswith("phase=")]
        restarts = int(a.decision is not None)
        print(f"  healthy job: {time.monotonic() - t0:.0f}s, exit codes {a.returncodes}")
        for ln in phases:
            print(f"    {ln}")
        print(f"    hang_detected={len(detected)} restarts={restarts} hang_suspected={kinds.count('hang_suspected')} "
              f"hang_cleared={kinds.count('hang_cleared')}")  # fmt: skip
        return len(detected) + restarts, kinds.count("hang_suspected"), len(phases) + 1  # + the first step


def fault(cfg: HangConfig, name: str, runs: int, step_ms: float) -> list[tuple[float, float, bool]]:
    world, culprit = FAULTS[name]
    args = ["--steps", "80", "--step-time-ms", str(step_ms), "--fault", name, "--fault-rank", str(culprit),
            "--fault-step", "20"]  # fmt: skip
    out = []
    for _ in range(runs):
        with tempfile.TemporaryDirectory(prefix="tg-hang-bench-") as tmp:
            attempts, _ = run_job(Path(tmp), HangMonitor(cfg), world, args, deadline_s=180.0, max_attempts=1)
        a = attempts[0]
        at = a.fault_time()
        if a.decision is None or a.decided_at is None or at is None:
            print(f"  {name:9s} NOT detected")
            continue
        out.append((a.decided_at - at, p99_step(a), a.decision.rank == culprit))
    return out


def loop(cfg: HangConfig, step_ms: float) -> tuple[float | None, float | None, bool]:
    args = ["--steps", "80", "--step-time-ms", str(step_ms), "--fault", "spin", "--fault-rank", "1",
            "--fault-step", "20"]  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="tg-hang-bench-") as tmp:
        attempts, _ = run_job(Path(tmp), HangMonitor(cfg), 2, args, deadline_s=cfg.detect_time + 120, max_attempts=1)
    a = attempts[0]
    at = a.fault_time()
    if at is None:
        return None, None, False
    sus = a.suspected[0][0] - at if a.suspected else None
    det = a.decided_at - at if a.decided_at else None
    return sus, det, a.decision is not None and a.decision.rank == 1


@dataclass
class WaitResult:
    name: str
    healthy: bool
    frozen: bool
    detected: int = 0  # hang_detected events
    restarts: int = 0
    suspected: int = 0
    latency: float | None = None  # faults: fault line -> RESTART decision
    p99: float = float("nan")
    right: bool = False  # faults: the culprit named
    finished: bool = False  # healthy: every rank printed done
    goal: float = 0.0  # faults: the latency goal, 10 s + 3 x p99 step (+ the window for a spin)
    note: str = ""

    @property
    def ok(self) -> bool:
        if self.healthy:
            return self.detected == 0 and self.restarts == 0 and self.finished
        return self.latency is not None and self.right and self.latency <= self.goal


def patterns(script: Path) -> dict:
    """The PATTERNS of a pattern script (wait_patterns.py or window_patterns.py)."""
    import importlib

    return importlib.import_module(script.stem).PATTERNS


def wait_pattern(cfg: HangConfig, name: str, wait_s: float, script: Path = WAITS) -> WaitResult:
    pat = patterns(script)[name]
    args = ["--pattern", name, "--wait-s", str(wait_s)]
    with tempfile.TemporaryDirectory(prefix="tg-hang-bench-") as tmp:
        attempts, detected = run_job(Path(tmp), HangMonitor(cfg), 2, args, deadline_s=wait_s + 240.0 + cfg.detect_time,
                                     max_attempts=1, worker=script)  # fmt: skip
        kinds = [e.kind for e in hang_events(Path(tmp))]
        notes = [e.message for e in hang_events(Path(tmp)) if e.kind != "hang_cleared"]
    a = attempts[0]
    res = WaitResult(name, pat.healthy, pat.frozen, len(detected), int(a.decision is not None),
                     kinds.count("hang_suspected"), p99=p99_step(a), note=notes[0][:300] if notes else "")  # fmt: skip
    res.finished = all(any(ln.startswith("done") for ln in out) for out in a.output.values())
    res.goal = 10.0 + 3 * (res.p99 if res.p99 == res.p99 else 0.0) + (cfg.detect_time if pat.at_window else 0.0)
    at = a.fault_time()
    if not pat.healthy and a.decision is not None and a.decided_at is not None and at is not None:
        res.latency = a.decided_at - at
        res.right = a.decision.rank == pat.culprit
    return res


def wait_matrix(cfg: HangConfig, wait_s: float, jobs: int, only: list[str], script: Path = WAITS) -> list[WaitResult]:
    from concurrent.futures import ThreadPoolExecutor

    names = [n for n in patterns(script) if not only or n in only]
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        results = list(pool.map(lambda n: wait_pattern(cfg, n, wait_s, script), names))
    for r in results:
        if r.healthy:
            what = f"detected={r.detected} restarts={r.restarts} suspected={r.suspected} finished={r.finished}"
        else:
            lat = "NOT detected" if r.latency is None else f"detected in {r.latency:5.2f}s"
            what = f"{lat} culprit {'right' if r.right else 'WRONG'} p99 step={r.p99 * 1000:.0f}ms"
        tag = "frozen " if r.frozen else ""
        print(f"  {'healthy' if r.healthy else 'fault':7s} {tag:7s}{r.name:22s} {what}  {'ok' if r.ok else 'FAIL'}")
        if r.note:
            print(f"      {r.note}")
    return results


def summary(results: list[WaitResult], frozen: bool) -> str:
    rs = [r for r in results if r.frozen == frozen]
    h = [r for r in rs if r.healthy]
    f = [r for r in rs if not r.healthy]
    lat = [r.latency for r in f if r.latency is not None]
    return (f"{len(h)} healthy: hang_detected {sum(r.detected for r in h)}, restarts {sum(r.restarts for r in h)}, "
            f"suspicions {sum(r.suspected for r in h)}, unfinished {sum(not r.finished for r in h)}; "
            f"{len(f)} faults: {sum(r.ok for r in f)} detected in time with the right culprit"
            + (f" (latency median {statistics.median(lat):.2f}s, max {max(lat):.2f}s)" if lat else ""))  # fmt: skip


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=1, help="runs of each fault case")
    p.add_argument("--step-time-ms", type=float, default=100.0)
    p.add_argument("--healthy-scale", type=float, default=1.0, help="scales the healthy phases' durations")
    p.add_argument("--loop-detect-time", type=float, default=60.0, help="--hang-detect-time (s) for the endless loop")
    p.add_argument("--matrix", choices=["all", "waits", "window", "classic"], default="all",
                   help="waits: only the wait patterns; window: only the patterns that outlast --hang-detect-time; "
                   "classic: only the healthy phases and the classic faults")
    p.add_argument("--window-detect-time", type=float, default=60.0,
                   help="--hang-detect-time (s) of the window matrix; its healthy patterns last 1.4 x as long")
    p.add_argument("--wait-s", type=float, default=40.0, help="how long each healthy wait pattern waits")
    p.add_argument("--jobs", type=int, default=1, help="wait patterns run side by side")
    p.add_argument("--only", default="", help="comma-separated wait patterns (default: all)")
    args = p.parse_args()
    if args.runs < 1 or args.jobs < 1:
        p.error("--runs >= 1")
    from torch.distributed.constants import default_pg_timeout

    cfg = HangConfig()  # production: period 1 s, slack 5 s, factor 3, detect time 30 min
    print(f"hang bench: period={cfg.period:g}s slack={cfg.step_slack:g}s factor={cfg.step_factor:g} "
          f"window={cfg.window:g}s detect_time={cfg.detect_time:g}s")  # fmt: skip
    ok = True
    if args.matrix in ("all", "waits"):
        print(f"wait patterns (production settings, waits of {args.wait_s:g}s, {args.jobs} side by side):")
        results = wait_matrix(cfg, args.wait_s, args.jobs, [x for x in args.only.split(",") if x])
        print(f"wait patterns, tuned split: {summary(results, frozen=False)}")
        print(f"wait patterns, FROZEN split: {summary(results, frozen=True)}")
        ok = all(r.ok for r in results)
        if args.matrix == "waits":
            return 0 if ok else 1
    if args.matrix in ("all", "window"):
        wcfg = HangConfig(detect_time=args.window_detect_time)
        wait = round(1.4 * wcfg.detect_time, 1)
        print(f"window patterns (--hang-detect-time {wcfg.detect_time:g}s, healthy work of {wait:g}s, "
              f"{args.jobs} side by side):")  # fmt: skip
        wres = wait_matrix(wcfg, wait, args.jobs, [x for x in args.only.split(",") if x], WINDOW)
        print(f"window patterns, tuned split: {summary(wres, frozen=False)}")
        print(f"window patterns, FROZEN split: {summary(wres, frozen=True)}")
        ok = ok and all(r.ok for r in wres)
        if args.matrix == "window":
            return 0 if ok else 1
    print("healthy matrix (production settings):")
    fp, sus, phases = healthy(cfg, args.healthy_scale)
    print("fault matrix:")
    latencies, p99s = [], []
    for name in FAULTS:
        got = fault(cfg, name, args.runs, args.step_time_ms)
        for lat, p99, right in got:
            latencies.append(lat)
            p99s.append(p99)
            print(f"  {name:9s} detected in {lat:6.2f}s  culprit {'right' if right else 'WRONG'}  "
                  f"p99 step={p99 * 1000:.0f}ms")  # fmt: skip
    s, d, right = loop(HangConfig(detect_time=args.loop_detect_time), args.step_time_ms)
    print(f"  spin      suspected in {s if s is None else round(s, 2)}s, detected in "
          f"{d if d is None else round(d, 2)}s (--hang-detect-time {args.loop_detect_time:g}s)  "
          f"culprit {'right' if right else 'WRONG'}")  # fmt: skip
    print()
    print(f"false positives over the healthy matrix ({phases} phases): {fp} (goal 0); suspicions: {sus}")
    if latencies:
        med = statistics.median(latencies)
        goal = 10.0 + 3 * statistics.median(p99s)
        gloo = default_pg_timeout.total_seconds()
        print(f"detection latency of {len(latencies)} fault runs: median {med:.2f}s, max {max(latencies):.2f}s "
              f"(goal <= 10s + 3 x p99 step = {goal:.2f}s: {'met' if max(latencies) <= goal else 'NOT met'})")
        print(f"torchrun + gloo: the hung collective fails after the process group timeout, {gloo:.0f}s "
              f"(stated, not waited for): {gloo / med:.0f}x later")  # fmt: skip
    return 0 if ok and fp == 0 and len(latencies) == len(FAULTS) * args.runs else 1


if __name__ == "__main__":
    sys.exit(main())
