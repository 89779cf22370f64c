"""What trainguard's policy, detectors and restart path give at the scale its users run: a
discrete-event simulation of one training job at 64 -> 100,000 ranks (8 per node) over 30 days,
in ETTR (effective training time ratio: the time spent on progress that is kept / wall time).

Failures are drawn per node (Poisson, seeded) from Llama 3's published mix of 419 unexpected
interruptions in 54 days on 16,384 GPUs (bench/fleet_rates_llama3.json; ``--rates FILE`` replaces
it). Every trainguard decision is made by the real ``trainguard.policy`` on synthetic evidence of
its real types (bench/fleet_sim.py); detection, decision and recovery times are drawn from
bench/fleet_calibration.json, written by hand from the figures in docs/benchmarks.md. Compared in
the same run, on the same failures, with torchrun as users run it today: a full-job re-launch by
the scheduler per failure, torch.save every N minutes (Young/Daly unless ``--ckpt-minutes``), hangs
and lost peers found by the NCCL watchdog's default 10 minutes.

    python bench/fleet.py                                   # 64 -> 100,000 ranks, 30 days
    python bench/fleet.py --ranks 16384 --ckpt-minutes 30 --restart-on-error
    python bench/fleet.py --rates my_cluster.json --png fleet.png

Prints ETTR and its breakdown per scale and row, a sweep over the failure rate (x0.5 -> x8 at
--sweep-ranks), the wall time, and writes a PNG where matplotlib is importable.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))
sys.path.insert(0, str(REPO / "bench"))

from fleet_sim import (  # noqa: E402
    DEFAULT_CALIBRATION,
    DEFAULT_RATES,
    PARTS,
    RANKS_PER_NODE,
    Calibration,
    Rates,
    RowResult,
    Scenario,
    load_json,
    simulate,
)

DEFAULT_SCALES = "64,512,4096,16384,100000"
DEFAULT_MULTIPLIERS = "0.5,1,2,4,8"


class BadInput(Exception):
    """One line for stderr, exit 2."""


def _numbers(text: str, kind: type, what: str) -> list:
    try:
        values = [kind(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise BadInput(f"{what}: a comma-separated list of numbers, not {text!r}") from None
    if not values or any(not math.isfinite(v) or v < 0 for v in values):
        raise BadInput(f"{what}: numbers >= 0, at least one")
    return values


def parse(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", default=DEFAULT_SCALES, help=f"scales, comma-separated (default {DEFAULT_SCALES})")
    ap.add_argument("--days", type=float, default=30.0, help="simulated days (default 30)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--rates", type=Path, default=None, help="failure rates JSON (default: Llama 3's, %(default)s)")
    ap.add_argument("--calibration", type=Path, default=DEFAULT_CALIBRATION)
    ap.add_argument("--standby-fraction", type=float, default=0.005,
                    help="standby nodes of the trainguard+standby row, a share of the nodes (at least 1; 0: no row)")
    ap.add_argument("--elastic-slack", type=float, default=0.0,
                    help="share of the nodes the job may go on without (--nnodes MIN:MAX); default 0: fixed size")
    ap.add_argument("--restart-on-error", action="store_true", help="trainguard's --restart-on-error")
    ap.add_argument("--max-restarts", type=int, default=100, help="trainguard's restart budget per launch (default 100)")
    ap.add_argument("--ckpt-minutes", default="young-daly", help="torchrun's checkpoint interval: minutes or young-daly")
    ap.add_argument("--requeue-s", type=float, default=None,
                    help="the scheduler's re-queue / replacement time (default: the calibration file's assumption)")
    ap.add_argument("--multipliers", default=DEFAULT_MULTIPLIERS, help="failure-rate multipliers of the sweep")
    ap.add_argument("--sweep-ranks", type=int, default=16384, help="scale of the failure-rate sweep (0: no sweep)")
    ap.add_argument("--png", type=Path, default=None,
                    help="write the plot there (where matplotlib is importable); docs/fleet.png is the docs' copy")
    args = ap.parse_args(argv)
    _check(args)
    return args


def _check(args: argparse.Namespace) -> None:
    args.scales = [int(x) for x in _numbers(args.ranks, float, "--ranks")]
    if any(r < RANKS_PER_NODE or r % RANKS_PER_NODE for r in args.scales + ([args.sweep_ranks] if args.sweep_ranks else [])):
        raise BadInput(f"--ranks / --sweep-ranks: multiples of {RANKS_PER_NODE} (8 ranks per node), at least 8")
    args.mults = _numbers(args.multipliers, float, "--multipliers")
    if not (math.isfinite(args.days) and 0 < args.days <= 3650):
        raise BadInput("--days: a number of days in (0, 3650]")
    if not (0 <= args.standby_fraction <= 1 and 0 <= args.elastic_slack < 1) or args.max_restarts < 0:
        raise BadInput("--standby-fraction in [0, 1], --elastic-slack in [0, 1), --max-restarts >= 0")
    if args.requeue_s is not None and not (math.isfinite(args.requeue_s) and args.requeue_s >= 0):
        raise BadInput("--requeue-s: seconds >= 0")
    if args.ckpt_minutes == "young-daly":
        args.ckpt = None
    else:
        minutes = _numbers(args.ckpt_minutes, float, "--ckpt-minutes")
        if len(minutes) != 1 or minutes[0] <= 0:
            raise BadInput("--ckpt-minutes: one number of minutes > 0, or young-daly")
        args.ckpt = minutes[0]


def scenario(args: argparse.Namespace, ranks: int) -> Scenario:
    nodes = ranks // RANKS_PER_NODE
    standbys = max(1, math.ceil(nodes * args.standby_fraction)) if args.standby_fraction > 0 else 0
    return Scenario(ranks, args.days, standbys, args.elastic_slack, args.restart_on_error, args.max_restarts, args.ckpt)


# ------------------------------------------------------------------------------ printing


def print_scale(ranks: int, days: float, n: int, rows: list[RowResult], wall_s: float) -> None:
    groups: dict[str, int] = {}
    for e in rows[0].trace:
        groups[e.group] = groups.get(e.group, 0) + 1
    mix = ", ".join(f"{g} {c}" for g, c in sorted(groups.items(), key=lambda x: -x[1])) or "none"
    print(f"\n== {ranks:,} ranks ({ranks // RANKS_PER_NODE:,} nodes), {days:g} days: {n} failures ({mix}); "
          f"simulated in {wall_s:.2f} s")
    width = max(12, *(len(r.name) + 2 for r in rows))
    print(" " * 28 + "".join(f"{r.name:>{width}}" for r in rows))
    print(f"   {'ETTR':<25}" + "".join(f"{r.ettr:>{width}.4f}" for r in rows))
    for part in PARTS:
        print(f"   {part:<25}" + "".join(f"{r.parts[part] * 100:>{width - 2}.2f} %" for r in rows))
    for r in rows:
        acts = ", ".join(f"{a} {c}" for a, c in sorted(r.actions().items()))
        hist = (f"; re-launched {sum(r.relaunches.values())} times ({r.relaunches['stopped']} stopped by the policy, "
                f"{r.relaunches['budget spent']} with the restart budget spent); node history: {r.history_records} "
                f"records, {r.refused_hosts} host(s) it would refuse") if r.relaunches else ""  # fmt: skip
        print(f"   {r.name}: {r.note}; decisions: {acts or 'none'}{hist}")


def print_examples(rows: list[RowResult]) -> None:
    """One decision of each (failure class, action) the real policy made, with its reason."""
    print("\nThe policy's decisions, one per failure class and action (the largest scale's trainguard rows):")
    seen: set[tuple[str, str, str]] = set()
    for r in rows[1:]:
        for e in r.trace:
            key = (r.name, e.group, e.action)
            if key not in seen and e.action != "absorbed":
                seen.add(key)
                print(f"   {r.name:<24} {e.group:<9} {e.action:<13} [{e.source}] {e.reason[:150]}")


def print_summary(title: str, keys: list[str], table: dict[str, list[RowResult]]) -> None:
    names = [r.name.split("(")[0] for r in next(iter(table.values()))]
    print(f"\n{title}")
    print(f"   {'':<12}" + "".join(f"{n:>22}" for n in names))
    for k in keys:
        print(f"   {k:<12}" + "".join(f"{r.ettr:>22.4f}" for r in table[k]))


def plot(path: Path, scales: dict[str, list[RowResult]], sweep: dict[str, list[RowResult]], sweep_ranks: int) -> str:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not importable: no PNG written (pip install matplotlib for one)"
    if path.is_symlink():
        return f"{path} is a symlink: no PNG written"
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4.2))
    _lines(a, [int(k) for k in scales], list(scales.values()), "ranks", log=True)
    a.set_title("ETTR against scale (Llama 3's failure rates)")
    if sweep:
        _lines(b, [float(k.rstrip("x")) for k in sweep], list(sweep.values()), "failure-rate multiplier", log=True)
        b.set_title(f"ETTR against failure rate at {sweep_ranks:,} ranks")
    fig.tight_layout()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_NOFOLLOW", 0), 0o600)
    with os.fdopen(fd, "wb") as fh:
        fig.savefig(fh, format="png", dpi=110)
    return f"plot: {path}"


def _lines(ax, xs: list[float], results: list[list[RowResult]], xlabel: str, log: bool) -> None:
    for i, name in enumerate(r.name.split("(")[0] for r in results[0]):
        ax.plot(xs, [rows[i].ettr for rows in results], marker="o", label=name)
    ax.set_xscale("log" if log else "linear")
    ax.set_xticks(xs, [f"{x:,g}" for x in xs])
    ax.minorticks_off()
    ax.set_xlabel(xlabel)
    ax.set_ylabel("ETTR")
    ax.set_ylim(0, 1.02)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)


# ------------------------------------------------------------------------------ main


def run(args: argparse.Namespace) -> None:
    started = time.perf_counter()
    rates = Rates.from_dict(load_json(args.rates or DEFAULT_RATES))
    cal = Calibration(load_json(args.calibration))
    if args.requeue_s is not None:
        cal.assumed["requeue_s"] = {"value": args.requeue_s, "why": "--requeue-s"}
    print(f"fleet simulation: {args.days:g} days per scale, seed {args.seed}; rates {args.rates or DEFAULT_RATES.name}: "
          f"{rates.per_node_hour * 24:.5f} failures per node-day ({', '.join(f'{g} {w:.1%}' for g, w in rates.weights.items())})")
    print(f"times calibrated from docs/benchmarks.md figures of {cal.dates} ({args.calibration.name}); "
          "the real benches do not yet write this file; the rest is assumed (the file says what and why)")
    scales: dict[str, list[RowResult]] = {}
    for ranks in args.scales:
        t0 = time.perf_counter()
        rows, n = simulate(scenario(args, ranks), rates, cal, 1.0, args.seed)
        print_scale(ranks, args.days, n, rows, time.perf_counter() - t0)
        scales[str(ranks)] = rows
    print_examples(scales[str(max(args.scales))])
    print_summary("ETTR against scale:", list(scales), scales)
    sweep: dict[str, list[RowResult]] = {}
    if args.sweep_ranks:
        for m in args.mults:
            sweep[f"{m:g}x"] = simulate(scenario(args, args.sweep_ranks), rates, cal, m, args.seed)[0]
        print_summary(f"ETTR against the failure rate at {args.sweep_ranks:,} ranks:", list(sweep), sweep)
    if args.png is not None:
        print(f"\n{plot(args.png, scales, sweep, args.sweep_ranks)}")
    print(f"wall time: {time.perf_counter() - started:.1f} s on one core ({max(args.scales):,} ranks x {args.days:g} "
          "days included)")


def main(argv: list[str] | None = None) -> int:
    try:
        args = parse(sys.argv[1:] if argv is None else argv)
        run(args)
    except (BadInput, ValueError, KeyError) as exc:
        print(f"fleet.py: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
