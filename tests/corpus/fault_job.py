"""A tiny gloo DDP job that fails in one chosen, real way (for tests/corpus/make_corpus.py).

    python fault_job.py --mode exception|timeout|sigkill|hostoom|diskfull|dataloader|segfault|nan|hang|slowdown|healthy
                        [--steps N] [--fail-rank R] [--fail-step S]

Prints ``step=<n> rank=<r> t=<unix time> loss=<x>`` per step, like examples/train_mlp.py.
"""

from __future__ import annotations

import argparse
import ctypes
import datetime
import faulthandler
import os
import resource
import signal
import time

import torch
import torch.distributed as dist
from torch import nn


class KillerDataset(torch.utils.data.Dataset):
    """Item ``die_at`` kills the DataLoader worker process that loads it (as the OOM killer would)."""

    def __init__(self, die_at: int) -> None:
        self.die_at = die_at

    def __len__(self) -> int:
        return 1000

    def __getitem__(self, i: int) -> torch.Tensor:
        if i == self.die_at:
            os.kill(os.getpid(), signal.SIGKILL)
        return torch.randn(16)


def fail(mode: str, step: int) -> None:
    if mode == "exception":
        raise ValueError(f"bad sample in batch {step}: expected 16 features, got 15")
    if mode == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)
    if mode == "hostoom":
        soft = 600 << 20
        resource.setrlimit(resource.RLIMIT_AS, (soft + _vm_size(), resource.RLIM_INFINITY))
        hog = bytearray(4 << 30)  # noqa: F841 - the allocation is the point
    if mode == "diskfull":
        with open("/dev/full", "wb") as f:
            f.write(b"\0" * 65536)
            f.flush()
    if mode == "dataloader":
        loader = torch.utils.data.DataLoader(KillerDataset(die_at=3), batch_size=2, num_workers=1)
        for _ in loader:
            pass
    if mode == "segfault":
        faulthandler.enable()
        ctypes.string_at(0)
    if mode == "hang":
        while True:
            time.sleep(1)


def _vm_size() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    return 0


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--mode", required=True)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--fail-rank", type=int, default=1)
    p.add_argument("--fail-step", type=int, default=4)
    p.add_argument("--step-ms", type=float, default=20.0)
    a = p.parse_args()
    timeout = datetime.timedelta(seconds=3 if a.mode in ("timeout", "rendezvous") else 300)
    dist.init_process_group("gloo", timeout=timeout)
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    gen = torch.Generator().manual_seed(rank)
    print("resume step=0", flush=True)
    for step in range(1, a.steps + 1):
        if rank == a.fail_rank and step == a.fail_step:
            if a.mode == "timeout":
                time.sleep(6)  # late for the next collective: the peer's gloo timeout (3 s) fires
            else:
                fail(a.mode, step)
        x = torch.randn(8, 16, generator=gen)
        if a.mode == "nan" and rank == a.fail_rank and step >= a.fail_step:
            x = x * float("inf")
        pad = a.step_ms * (4 if a.mode == "slowdown" and step > a.steps * 2 // 3 else 1)
        time.sleep(pad / 1000)
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        print(f"step={step} rank={rank} t={time.time():.3f} loss={loss.item():.4f}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
