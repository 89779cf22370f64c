"""A small CUDA training job for the GPU kit (bench/gpu.py): an MLP with DDP on NCCL, one GPU per
rank (LOCAL_RANK), a fault of --mode on the first attempt only (the restarted attempt trains
through and ends, so a verdict's restart is seen to work):

  train         no fault
  device-wait   every rank runs a kernel that spins the GPU for --seconds at step --at, then waits
                for it in a stream synchronise: a long kernel is no hang (no proof it never ends)
  oom           rank --rank allocates device memory until CUDA is out of memory at step --at
  sigstop       rank --rank stops itself (SIGSTOP) at step --at: the others wait in an all-reduce
  sleep         rank --rank sleeps --seconds before its all-reduce at step --at
  skip          rank --rank leaves out one all_reduce of a metric at step --at (no DDP in this
                mode: the metric's all-reduces are the only collectives of the loop), so it reaches
                the closing all_gather while the others wait in their last all-reduce: mismatched
                collectives, named from NCCL's Flight Recorder (NCCL pairs calls by position; a
                mismatch is undefined behaviour there, the kit reports what it did)
  slow          rank --rank runs a competing GEMM before every forward (a straggler from the spans)
"""

from __future__ import annotations

import argparse
import os
import signal
import time

import torch
import torch.distributed as dist
from torch import nn

p = argparse.ArgumentParser()
p.add_argument("--mode", default="train",
               choices=["train", "device-wait", "oom", "sigstop", "sleep", "skip", "slow"])  # fmt: skip
p.add_argument("--steps", type=int, default=60)
p.add_argument("--at", type=int, default=20)
p.add_argument("--rank", type=int, default=1)
p.add_argument("--seconds", type=float, default=30.0)
p.add_argument("--width", type=int, default=2048)
p.add_argument("--cpu", action="store_true", help="gloo on the CPU: the kit's dry run (bench/gpu.py --cpu-dry-run)")
args = p.parse_args()

local = int(os.environ.get("LOCAL_RANK", "0"))
if args.cpu:
    dev = torch.device("cpu")
    dist.init_process_group("gloo")
else:
    torch.cuda.set_device(local)
    dev = torch.device("cuda", local)
    dist.init_process_group("nccl", device_id=dev)
sync = (lambda: None) if args.cpu else (lambda: torch.cuda.synchronize(dev))
rank, world = dist.get_rank(), dist.get_world_size()
first = int(os.environ.get("TRAINGUARD_RESTART_COUNT", "0")) == 0
fault = first and args.mode != "train" and (rank == args.rank or args.mode == "device-wait")

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(args.width, args.width), nn.ReLU(), nn.Linear(args.width, args.width)).to(dev)
hog = torch.randn(1024 if args.cpu else 8192, 1024 if args.cpu else 8192, device=dev) if fault and args.mode == "slow" else None


class Slowed(nn.Module):
    """The model, its forward preceded on the slowed rank by a competing GEMM (in the forward: the
    compute span that straggler detection compares; a slower GPU is slower there)."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        global hog
        if hog is not None:
            for _ in range(4):
                hog = hog @ hog
                hog = hog / hog.norm()
        return self.inner(x)


model = Slowed(model)
ddp = model if args.mode == "skip" else nn.parallel.DistributedDataParallel(model, device_ids=None if args.cpu else [local])
opt = torch.optim.Adam(ddp.parameters(), lr=1e-4)
x = torch.randn(64, args.width, device=dev)
metric = torch.zeros(1, device=dev)
held = []

for step in range(1, args.steps + 1):
    opt.zero_grad(set_to_none=True)
    loss = ddp(x).square().mean()
    loss.backward()
    opt.step()
    if fault and step == args.at:
        print(f"rank {rank}: {args.mode} at step {step}", flush=True)
        if args.mode == "device-wait":
            # torch.cuda._sleep spins for a number of GPU clock cycles; ~1.5e9 cycles per second on
            # a data-centre GPU (clocks vary: the wait is approximate, the spin is real).
            if args.cpu:
                time.sleep(args.seconds)  # the dry run's stand-in (no GPU to spin)
            else:
                torch.cuda._sleep(int(args.seconds * 1.5e9))
        elif args.mode == "oom":
            while True:
                held.append(torch.empty(1 << 30, dtype=torch.uint8, device=dev))
        elif args.mode == "sigstop":
            os.kill(os.getpid(), signal.SIGSTOP)
        elif args.mode == "sleep":
            time.sleep(args.seconds)
    metric.fill_(float(step))
    if not (args.mode == "skip" and fault and step == args.at):
        dist.all_reduce(metric)
    sync()  # the step ends when the GPU is done (what a .item() would wait for)
closing = torch.full((4096,), float(rank), device=dev)
dist.all_gather_into_tensor(torch.empty(world * 4096, device=dev), closing)
sync()
print(f"rank {rank} done", flush=True)
dist.destroy_process_group()
