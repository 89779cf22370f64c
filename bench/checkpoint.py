"""Training stall of ``trainguard.checkpoint.save`` vs a synchronous ``torch.save`` of the same state.

    python bench/checkpoint.py [--state-mb 128] [--saves 4] [--every 10] [--repeats 3] [--json FILE]

One process trains an MLP with Adam on CPU (model + optimizer state of about --state-mb MB) and
checkpoints every --every steps with each backend in turn, rounds interleaved so that machine noise
hits all of them alike:

- none:          no checkpoint (the baseline for the run-time overhead);
- torch.save:    ``torch.save(state, tmp); os.replace(tmp, path)`` on the training thread;
- trainguard:    ``trainguard.checkpoint.save(state, step)`` as it runs by default (the copy into
                 shared memory inside the call), with the checkpoint monitor persisting in a separate
                 process, as the agent does under ``trainguard run``;
- tg overlap:    the same with ``overlap=True`` (``--ckpt-overlap``): the CPU copy runs on an
                 idle-priority helper thread during the next forward/backward (the optimizer step
                 waits for it).

It prints, per backend, the training stall per save: the median time the save call blocks plus
the median slow-down of the steps until the next save (where an overlapped copy is waited for and
the background persist competes for CPU and disk), against the median step of the baseline;
the ratio trainguard / torch.save; the steps lost per failure when each backend may spend 5 % of
the training time on checkpoints; and, at this run's save interval, the steps lost when a process
fails (the in-memory snapshot survives) and when the node is lost (only what the agent had
persisted: the persist lag, measured at each save, adds to it).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TG = "trainguard"
OVERLAP = "tg overlap"


def agent_main(run_dir: str, ckpt_dir: str, shm_root: str) -> None:
    """Stand-in agent: the checkpoint monitor in its own process until stdin closes."""
    from trainguard.launch.checkpoint_monitor import CheckpointMonitor

    mon = CheckpointMonitor(ckpt_dir=ckpt_dir, keep=2, shm_root=shm_root)
    print(json.dumps(mon.worker_env(Path(run_dir))), flush=True)
    sys.stdin.read()
    mon.close()


def build(state_mb: float):
    import torch
    from torch import nn

    # Adam keeps two moments per parameter: state bytes ~= 3 x 4 bytes x params.
    width = 1024
    layers = max(1, round(state_mb * 1e6 / (12 * width * width)))
    torch.manual_seed(0)
    model = nn.Sequential(*[m for _ in range(layers) for m in (nn.Linear(width, width), nn.ReLU())])
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    x = torch.randn(32, width)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        model(x).square().mean().backward()
        opt.step()

    step()  # creates the optimizer state
    return model, opt, step


def state_bytes(state) -> int:
    import torch

    if isinstance(state, torch.Tensor):
        return state.numel() * state.element_size()
    if isinstance(state, dict):
        return sum(state_bytes(v) for v in state.values())
    if isinstance(state, list | tuple):
        return sum(state_bytes(v) for v in state)
    return 0


def run(backend: str, saves: int, every: int, model, opt, step_fn, ckpt, torch_path: Path, first: int,
        ckpt_dir: Path | None = None):
    """Train ``saves`` intervals of ``every`` steps, saving after each interval. Returns the step
    times, the time each save call blocked, for each save the step times of the interval after it
    (where an overlapped copy is waited for and the background persist competes), the last step,
    and (trainguard) at each save how many steps the newest persisted checkpoint was behind."""
    import torch

    from trainguard.checkpoint import disk

    step_times: list[float] = []
    blocked: list[float] = []
    after: list[list[float]] = []
    lags: list[int] = []
    i = first
    for n in range(saves + 1):
        interval = []
        for _ in range(every):
            t0 = time.perf_counter()
            step_fn()
            interval.append(time.perf_counter() - t0)
            i += 1
        step_times.extend(interval)
        if n > 0:
            after.append(interval)
        if backend == "none" or n == saves:
            continue
        state = {"model": model.state_dict(), "optim": opt.state_dict(), "step": i}
        t1 = time.perf_counter()
        if backend == "torch.save":
            tmp = torch_path.with_suffix(".tmp")
            torch.save(state, tmp)
            os.replace(tmp, torch_path)
        else:
            ckpt.save(state, i, overlap=backend == OVERLAP)
        blocked.append(time.perf_counter() - t1)
        if ckpt_dir is not None and backend != "torch.save":
            # Steps between this snapshot and the newest checkpoint on disk; this run's first save
            # counts as if the one before it (another backend's run came between) were persisted.
            persisted = disk.list_steps(ckpt_dir, 0)
            floor = first  # one interval before this run's first save
            lags.append(i - max(persisted[0] if persisted else floor, floor))
    return step_times, blocked, after, i, lags


def wait_persisted(ckpt_dir: Path, step: int, timeout: float = 600) -> None:
    from trainguard.checkpoint import disk

    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if step in disk.list_steps(ckpt_dir, 0):
            return
        time.sleep(0.05)
    raise SystemExit(f"bench: step {step} was not persisted within {timeout}s")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--state-mb", type=float, default=128)
    p.add_argument("--saves", type=int, default=4, help="saves per run")
    p.add_argument("--every", type=int, default=10, help="steps between saves")
    p.add_argument("--repeats", type=int, default=3, help="interleaved rounds")
    p.add_argument("--dir", default=None, help="where checkpoints go (default: a temp dir on the current disk)")
    p.add_argument("--json", default=None, help="also write the numbers to this file")
    p.add_argument("--agent", nargs=3, metavar=("RUN_DIR", "CKPT_DIR", "SHM_ROOT"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.agent:
        agent_main(*args.agent)
        return 0

    import torch

    from trainguard.checkpoint import disk
    from trainguard.checkpoint.client import Checkpointer

    base = Path(tempfile.mkdtemp(prefix="tg-bench-ckpt-", dir=args.dir or "."))
    shm_root = Path(tempfile.mkdtemp(prefix="tg-bench-ckpt-", dir="/dev/shm" if Path("/dev/shm").is_dir() else None))
    agent = subprocess.Popen([sys.executable, __file__, "--agent", str(base / "run"), str(base / "ckpt"), str(shm_root)],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    ckpt = None
    try:
        env = json.loads(agent.stdout.readline())
        ckpt = Checkpointer(Path(env["TRAINGUARD_CKPT_SHM_DIR"]), Path(env["TRAINGUARD_CKPT_DIR"]), 0, 1)
        model, opt, step_fn = build(args.state_mb)
        nbytes = state_bytes({"model": model.state_dict(), "optim": opt.state_dict()})
        print(f"state {nbytes / 1e6:.0f} MB (model + Adam), torch {torch.__version__}, "
              f"{torch.get_num_threads()} threads, checkpoints in {base}")
        ckpt_dir = Path(env["TRAINGUARD_CKPT_DIR"])
        # Warm-up: first saves allocate the shm slots and warm the page cache for every backend.
        for backend in ("torch.save", TG, OVERLAP):
            run(backend, 2, args.every, model, opt, step_fn, ckpt, base / "torch.pt", 0)
        ckpt.wait()
        backends = ["none", "torch.save", TG, OVERLAP]
        blocked: dict[str, list[float]] = {b: [] for b in backends}
        after: dict[str, list[list[float]]] = {b: [] for b in backends}
        lags: dict[str, list[int]] = {b: [] for b in backends}
        step_times: list[float] = []
        first = 1000
        for r in range(args.repeats):
            for b in backends[r % 4 :] + backends[: r % 4]:
                st, blk, aft, last, lag = run(b, args.saves, args.every, model, opt, step_fn, ckpt,
                                              base / "torch.pt", first, ckpt_dir)
                if b in (TG, OVERLAP):  # let the background persist finish before the next run
                    ckpt.wait()
                    wait_persisted(ckpt_dir, last - args.every)
                blocked[b].extend(blk)
                after[b].extend(aft)
                lags[b].extend(lag)
                if b == "none":
                    step_times.extend(st)
                first = last + 1
        step_s = statistics.median(step_times)
        print(f"median step {step_s * 1e3:.1f} ms (no checkpoint); {args.repeats} rounds x {args.saves} saves, "
              f"one every {args.every} steps\n")
        # Stall per save = the save call + what the steps until the next save lost against the
        # baseline median step (background copy and persist competing); medians over all saves.
        rows = {}
        for b in ("torch.save", TG, OVERLAP):
            blk = statistics.median(blocked[b])
            extra = max(0.0, statistics.median(sum(iv) - len(iv) * step_s for iv in after[b]))
            rows[b] = (blk, extra, blk + extra)
        print(f"{'backend':<15} {'save call':>10} {'+ interval':>11} {'= stall':>9}   {'at a 5 % budget:':<17} "
              f"{'save every':>10} {'lost/failure':>13}")
        out = {"step_ms": step_s * 1e3, "every": args.every, "backends": {}}
        for b, (blk, extra, stall) in rows.items():
            # With 5 % of training time for checkpoints: save every N steps; a failure at a random
            # moment loses N/2 steps on average (worst case N).
            n = max(1, math.ceil(stall / (0.05 * step_s)))
            print(f"{b:<15} {blk * 1e3:>7.1f} ms {extra * 1e3:>8.1f} ms {stall * 1e3:>6.1f} ms   {'':<17} "
                  f"{n:>10d} {n / 2:>6.1f} (max {n})")
            out["backends"][b] = {"call_ms": blk * 1e3, "interval_ms": extra * 1e3, "stall_ms": stall * 1e3,
                                  "budget_every": n, "lag_steps": statistics.median(lags[b]) if lags[b] else None}
        print()
        for b in (TG, OVERLAP):
            ratio = rows[b][2] / rows["torch.save"][2]
            out["backends"][b]["ratio"] = ratio
            print(f"ratio {b} / torch.save (median stall per save): {ratio:.3f} ({100 * ratio:.1f} %; goal <= 5 %)")
        print(f"\nsteps lost per failure when saving every {args.every} steps (average, worst):")
        print(f"  process failure (the in-memory snapshot survives): {args.every / 2:.1f}, {args.every}")
        for b in (TG, OVERLAP):
            # At each save, how far the newest checkpoint on disk is behind it: `every` when the
            # persist of the previous snapshot kept up. A node lost just before a save loses that.
            behind = statistics.median(lags[b])
            print(f"  node lost, {b}: {max(behind - args.every / 2, args.every / 2):.1f}, {max(lags[b])} "
                  f"(newest checkpoint on disk at a save: median {behind:.0f}, max {max(lags[b])} steps behind)")
        print(f"persisted by the agent: {sorted(disk.list_steps(ckpt_dir, 0))}")
        if args.json:
            Path(args.json).write_text(json.dumps(out, indent=1))
    finally:
        if ckpt is not None:
            ckpt.close()
        agent.stdin.close()
        agent.wait(timeout=300)
        disk.remove_tree(base)
        disk.remove_tree(shm_root)
    return 0


if __name__ == "__main__":
    sys.exit(main())
