"""Hang verdicts on real gloo jobs (CPU): false positives over the healthy matrix beside the
detection latency of the fault matrix, in the same run (issue 11).

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
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "scripts"))

from hang_harness import Attempt, hang_events, run_job  # noqa: E402

from trainguard.detect.hang import percentile  # noqa: E402
from trainguard.monitors.hang.monitor import HangConfig, HangMonitor  # noqa: E402

HEALTHY = ROOT / "tests" / "scripts" / "healthy_phases.py"
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


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=1, help="runs of each fault case")
    p.add_argument("--step-time-ms", type=float, default=100.0)
    p.add_argument("--healthy-scale", type=float, default=1.0, help="scales the healthy phases' durations")
    p.add_argument("--loop-detect-time", type=float, default=60.0, help="--hang-detect-time (s) for the endless loop")
    args = p.parse_args()
    if args.runs < 1:
        p.error("--runs >= 1")
    from torch.distributed.constants import default_pg_timeout

    cfg = HangConfig()  # production: period 1 s, slack 5 s, factor 3, detect time 30 min
    print(f"hang bench: period={cfg.period:g}s slack={cfg.step_slack:g}s factor={cfg.step_factor:g} "
          f"window={cfg.window:g}s detect_time={cfg.detect_time:g}s")  # fmt: skip
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
    return 0 if fp == 0 and len(latencies) == len(FAULTS) * args.runs else 1


if __name__ == "__main__":
    sys.exit(main())
