"""Training stall of ``trainguard.checkpoint.save`` vs a synchronous ``torch.save`` of the same state.

    python bench/checkpoint.py [--state-mb 128] [--saves 4] [--every 10] [--repeats 3]

One process trains an MLP with Adam on CPU (model + optimizer state of about --state-mb MB) and
checkpoints every --every steps with each backend in turn, rounds interleaved so that machine noise
hits all of them alike:

- none:        no checkpoint (the baseline for the run-time overhead);
- torch.save:  ``torch.save(state, tmp); os.replace(tmp, path)`` on the training thread;
- trainguard:  ``trainguard.checkpoint.save(state, step)``, with the checkpoint monitor persisting
               in a separate process, as the agent does under ``trainguard run``;
- tg overlap:  the same with ``overlap=True``: the CPU copy runs on a helper thread during the
               next forward/backward (the optimizer step waits for it).

It prints, per backend, the training stall per save: the median time the save call blocks plus
the median slow-down of the steps until the next save (where an overlapped copy is waited for and
the background persist competes for CPU and disk), against the median step of the baseline;
the ratio trainguard / torch.save; and the steps lost per failure when each backend may spend 5 %
of the training time on checkpoints.
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

OVERLAP = "tg overlap"
TG = "trainguard"


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


def run(backend: str, saves: int, every: int, model, opt, step_fn, ckpt, torch_path: Path, first: int):
    """Train ``saves`` intervals of ``every`` steps, saving after each interval. Returns the step
    times, the time each save call blocked, and for each save the step times of the interval
    after it (where an overlapped copy is waited for and the background persist competes)."""
    import torch

    step_times: list[float] = []
    blocked: list[float] = []
    after: list[list[float]] = []
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
    return step_times, blocked, after, i


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
        # Warm-up: first saves allocate the shm slots and warm the page cache for every backend.
        for backend in ("torch.save", TG, OVERLAP):
            run(backend, 2, args.every, model, opt, step_fn, ckpt, base / "torch.pt", 0)
        ckpt.wait()
        backends = ["none", "torch.save", TG, OVERLAP]
        blocked: dict[str, list[float]] = {b: [] for b in backends}
        after: dict[str, list[list[float]]] = {b: [] for b in backends}
        step_times: list[float] = []
        first = 1000
        for r in range(args.repeats):
            for b in backends[r % 4 :] + backends[: r % 4]:
                st, blk, aft, last = run(b, args.saves, args.every, model, opt, step_fn, ckpt, base / "torch.pt", first)
                if b in (TG, OVERLAP):  # let the background persist finish before the next run
                    ckpt.wait()
                    wait_persisted(Path(env["TRAINGUARD_CKPT_DIR"]), last - args.every)
                blocked[b].extend(blk)
                after[b].extend(aft)
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
        print(f"{'backend':<11} {'save call':>10} {'+ interval':>11} {'= stall':>9} {'save every':>11} {'steps lost/failure':>19}")
        for b, (blk, extra, stall) in rows.items():
            # With 5 % of training time for checkpoints: save every N steps; a failure at a random
            # moment loses N/2 steps on average (worst case N).
            n = max(1, math.ceil(stall / (0.05 * step_s)))
            print(f"{b:<11} {blk * 1e3:>7.1f} ms {extra * 1e3:>8.1f} ms {stall * 1e3:>6.1f} ms {n:>11d} "
                  f"{n / 2:>10.1f} (max {n})")
        print()
        for b in (TG, OVERLAP):
            print(f"ratio {b} / torch.save (median stall per save): {rows[b][2] / rows['torch.save'][2]:.3f} "
                  f"({100 * rows[b][2] / rows['torch.save'][2]:.1f} %; goal <= 5 %)")
        print(f"persisted by the agent: {sorted(disk.list_steps(Path(env['TRAINGUARD_CKPT_DIR']), 0))}")
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
