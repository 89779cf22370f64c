"""A healthy DDP job (gloo, CPU) with long legitimate phases in sequence — the hang monitor's
false-positive matrix. None of them is a hang; a guard that restarts here kills a
healthy job.

Run with RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT set (trainguard run, torchrun, or
tests/scripts/hang_harness.py). Prints `step=<n> rank=<r> t=<unix time>` after every optimizer
step, `phase=<name> rank=<r> seconds=<s>` after each phase, and `done rank=<r>` at the end.
Every optimizer step is taken after --accum micro-batches (gradient accumulation, DDP no_sync).

Phases (--phases, comma-separated, in the order given; --scale multiplies every duration,
--phase-scale NAME=X one phase's instead):

  first     the first step is 30 s slower (CPU-busy warm-up on every rank, as a compile)
  eval0     rank 0 alone evaluates 40 s (CPU-busy forward passes under no_grad: the first half
            through model.module, the second through the unwrapped model); the others wait in
            dist.barrier()
  evalall   every rank evaluates 30 s, no collective
  save      rank 0 alone saves >= 1 GB with torch.save (to --save-dir, removed after), then a
            barrier
  loader    at an epoch boundary the DataLoader blocks 20 s once: its worker processes are busy
            preparing the first batch of the epoch
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset

PHASES = ("first", "eval0", "evalall", "save", "loader")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--phases", default=",".join(PHASES))
    p.add_argument("--steps-between", type=int, default=12, help="optimizer steps before and after each phase")
    p.add_argument("--accum", type=int, default=8, help="micro-batches per optimizer step")
    p.add_argument("--scale", type=float, default=1.0, help="multiplies every phase's duration")
    p.add_argument("--phase-scale", action="append", default=[], metavar="NAME=X",
                   help="multiplies this phase's duration instead of --scale (repeatable)")
    p.add_argument("--save-gb", type=float, default=1.0)
    p.add_argument("--save-dir", default="/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir())
    args = p.parse_args()
    args.phases = [x for x in args.phases.split(",") if x]
    unknown = set(args.phases) - set(PHASES)
    own = dict(x.split("=", 1) for x in args.phase_scale if "=" in x)
    if len(own) != len(args.phase_scale) or set(own) - set(PHASES):
        p.error(f"--phase-scale wants NAME=X with NAME one of {PHASES}")
    if unknown:
        p.error(f"unknown phases: {sorted(unknown)}")
    args.scales = {name: float(own.get(name, args.scale)) for name in PHASES}
    return args


def cpu_busy(seconds: float, fn) -> int:
    """Call fn() until `seconds` of wall time passed; returns the number of calls."""
    deadline = time.monotonic() + seconds
    n = 0
    while time.monotonic() < deadline:
        fn()
        n += 1
    return n


class Batches(Dataset):
    """Cheap items, except the first item of the epoch given (`slow_epoch`): computing it keeps
    the DataLoader worker busy for `slow_s` seconds (re-indexing, decoding a shard...)."""

    def __init__(self, n: int, slow_epoch: int, slow_s: float) -> None:
        self.n, self.slow_epoch, self.slow_s = n, slow_epoch, slow_s
        self.epoch = 0

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        if i == 0 and self.epoch == self.slow_epoch:
            a = torch.randn(128, 128)
            cpu_busy(self.slow_s, lambda: a @ a)
        return torch.randn(32)


def main() -> int:
    args = parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    model = DDP(net)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)  # its step() marks step boundaries for trainguard
    s = args.scales
    loader_epoch = 1 if "loader" in args.phases else -1
    data = Batches(args.accum * args.steps_between, loader_epoch, 20.0 * s["loader"])
    step = 0

    def train(steps: int, epoch: int = 0) -> None:
        nonlocal step
        data.epoch = epoch
        # Workers are (re)started per epoch: they see the epoch the dataset is in.
        loader = DataLoader(data, batch_size=1, num_workers=1 if "loader" in args.phases else 0)
        batches = iter(loader)
        for _ in range(steps):
            opt.zero_grad()
            for micro in range(args.accum):
                x = next(batches)
                if micro < args.accum - 1:
                    with model.no_sync():  # gradient accumulation: no all-reduce before the last
                        model(x).square().mean().backward()
                else:
                    model(x).square().mean().backward()
            if step == 0 and "first" in args.phases:
                warm = torch.randn(128, 128)
                cpu_busy(30.0 * s["first"], lambda m=warm: m @ m)  # a slow first step (compilation, warm-up)
            opt.step()
            step += 1
            print(f"step={step} rank={rank} t={time.time():.6f}", flush=True)

    def phase(name: str, fn) -> None:
        t0 = time.monotonic()
        fn()
        print(f"phase={name} rank={rank} seconds={time.monotonic() - t0:.1f}", flush=True)

    def eval0() -> None:
        if rank == 0:
            with torch.no_grad():
                x = torch.randn(256, 32)
                cpu_busy(20.0 * s["eval0"], lambda: model.module(x))  # through the DDP wrapper's module
                cpu_busy(20.0 * s["eval0"], lambda: net(x))  # through the unwrapped model
        dist.barrier()

    def evalall() -> None:
        with torch.no_grad():
            x = torch.randn(256, 32)
            cpu_busy(30.0 * s["evalall"], lambda: net(x))

    def save() -> None:
        if rank == 0:
            path = os.path.join(args.save_dir, f"tg-healthy-{os.getpid()}.pt")
            try:
                n = int(args.save_gb * (1 << 30) / 4)
                torch.save({"model": net.state_dict(), "big": torch.ones(n)}, path)
            finally:
                if os.path.exists(path):
                    os.unlink(path)
        dist.barrier()

    train(args.steps_between)
    for i, name in enumerate(p for p in args.phases if p != "first"):
        if name == "loader":
            phase(name, lambda: train(args.steps_between, epoch=loader_epoch))
        else:
            phase(name, {"eval0": eval0, "evalall": evalall, "save": save}[name])
            train(args.steps_between, epoch=2 + i)
    dist.barrier()
    dist.destroy_process_group()
    print(f"done rank={rank}", flush=True)
    sys.stderr.flush()
    os._exit(0)  # skip gloo's teardown race under load (see tests/scripts/hang_worker.py)


if __name__ == "__main__":
    sys.exit(main())
