"""Test job: one rank keeps allocating host memory at a given step until the kernel's OOM killer
stops it (bounded by --limit-mb, so a machine without a memory limit is not exhausted)."""

import argparse
import os
import time

import torch
import torch.distributed as dist

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=200)
p.add_argument("--grow-rank", type=int, default=1)
p.add_argument("--grow-step", type=int, default=3)
p.add_argument("--limit-mb", type=int, default=6144, help="stop growing here (then exit 3)")
args = p.parse_args()

dist.init_process_group("gloo")
rank = dist.get_rank()
t = torch.ones(4)
held = []
for step in range(1, args.steps + 1):
    dist.all_reduce(t)
    print(f"step={step} rank={rank}", flush=True)
    if rank == args.grow_rank and step == args.grow_step:
        for _ in range(args.limit_mb // 64):
            chunk = bytearray(64 << 20)
            chunk[::4096] = b"\x01" * len(chunk[::4096])  # touch every page: real memory, not reserve
            held.append(chunk)
        print("grew to the limit without being killed", flush=True)
        os._exit(3)
    time.sleep(0.05)
dist.destroy_process_group()
os._exit(0)
