"""Rank 1 skips one all_reduce: a gloo job whose every step all-reduces a metric; on the
first attempt rank 1 leaves out the one of step --skip-step. The group pairs collectives by
position, so the ranks go on silently shifted by one until rank 1 reaches the final barrier while
rank 0 waits in its last all_reduce: two ranks in two different collectives, rank 1 out of
sequence. The restarted attempt skips nothing and ends."""

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=20)
p.add_argument("--skip-step", type=int, default=10)
args = p.parse_args()
dist.init_process_group("gloo")
rank, attempt = dist.get_rank(), int(os.environ["TRAINGUARD_RESTART_COUNT"])
model = torch.nn.Linear(8, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
metric = torch.zeros(1)
for step in range(1, args.steps + 1):
    loss = model(torch.randn(4, 8)).square().mean()
    loss.backward()
    opt.step()  # a step for trainguard's hooks
    opt.zero_grad()
    metric.fill_(loss.item())
    if rank == 1 and attempt == 0 and step == args.skip_step:
        print(f"skipping the all_reduce of step {step}", flush=True)
    else:
        dist.all_reduce(metric)
    time.sleep(0.05)
print(f"rank {rank} at the final barrier", flush=True)
dist.barrier()
dist.destroy_process_group()
print("done", flush=True)
sys.stdout.flush()
os._exit(0)  # skip gloo's teardown race under load (see tests/tgtest.py)
