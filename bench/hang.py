"""Hang detection latency: trainguard's hang monitor vs. torch/gloo's own collective timeout.

Runs a small gloo job (tests/scripts/hang_worker.py, CPU) whose rank hangs at a known moment
(it prints `fault=... t=<unix time>` just before) and measures the time until the hang monitor
hands the RESTART decision to the agent (the monitor driven as the agent drives it, with the
job's step samples fed as the profiling monitor feeds them). Default production settings
(period 1 s, slack 5 s) unless flags say otherwise.

The peer is torchrun + gloo without trainguard: a hung collective only ends when the process
group's timeout fires. That time is *stated* from torch's default ``timeout`` of
``init_process_group`` (torch.distributed.constants.default_pg_timeout, 30 min for gloo), not
waited for.

    python bench/hang.py --runs 5 --fault sleep
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "scripts"))

from hang_harness import run_job  # noqa: E402

from trainguard.detect.hang import percentile  # noqa: E402
from trainguard.launch.hang import HangConfig, HangMonitor  # noqa: E402


def p99_step(steps: dict) -> float:
    intervals = []
    for samples in steps.values():
        ends = [s.end for s in samples]
        intervals += [b - a for a, b in zip(ends, ends[1:], strict=False)]
    return percentile(intervals, 99) if intervals else float("nan")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--fault", choices=["sleep", "stop", "spin", "mismatch"], default="sleep")
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--step-time-ms", type=float, default=100.0)
    p.add_argument("--fault-step", type=int, default=20)
    p.add_argument("--period", type=float, default=HangConfig.period)
    p.add_argument("--slack", type=float, default=HangConfig.step_slack)
    args = p.parse_args()
    if args.runs < 1 or args.world < 2:
        p.error("--runs >= 1 and --world >= 2")

    from torch.distributed.constants import default_pg_timeout

    cfg = HangConfig(period=args.period, step_slack=args.slack)  # the seed's 30 min detect time, factor 3
    worker_args = [
        "--steps", str(args.fault_step + 50), "--step-time-ms", str(args.step_time_ms),
        "--fault", args.fault, "--fault-rank", str(args.world - 1), "--fault-step", str(args.fault_step),
    ]  # fmt: skip
    latencies, p99s = [], []
    print(f"hang bench: fault={args.fault} world={args.world} step={args.step_time_ms:g}ms "
          f"period={cfg.period:g}s slack={cfg.step_slack:g}s factor={cfg.step_factor:g}")
    for i in range(args.runs):
        with tempfile.TemporaryDirectory(prefix="tg-hang-bench-") as tmp:
            attempts, events = run_job(Path(tmp), HangMonitor(cfg), args.world, worker_args,
                                       deadline_s=120.0, max_attempts=1)
        a = attempts[0]
        fault_at = a.fault_time()
        if a.decision is None or a.decided_at is None or fault_at is None:
            print(f"  run {i + 1}: NOT detected (decision={a.decision}, fault at {fault_at})")
            continue
        latency = a.decided_at - fault_at
        p99 = p99_step(a.steps)
        latencies.append(latency)
        p99s.append(p99)
        print(f"  run {i + 1}: detected in {latency:6.2f}s  culprit={a.decision.rank} "
              f"(expected {args.world - 1})  p99 step={p99 * 1000:.0f}ms")
    if not latencies:
        print("no run detected the hang")
        return 1
    med = statistics.median(latencies)
    goal = 10.0 + 3 * statistics.median(p99s)
    gloo = default_pg_timeout.total_seconds()
    print()
    print(f"trainguard detection latency, median of {len(latencies)}: {med:.2f}s "
          f"(goal <= 10s + 3 x p99 step = {goal:.2f}s: {'met' if med <= goal else 'NOT met'})")
    print(f"torchrun + gloo: the hung collective fails after the process group timeout, {gloo:.0f}s "
          f"(torch default_pg_timeout for init_process_group; stated, not waited for)")
    print(f"ratio gloo timeout / trainguard: {gloo / med:.0f}x sooner")
    return 0


if __name__ == "__main__":
    sys.exit(main())
