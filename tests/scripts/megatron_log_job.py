"""A gloo job that logs like Megatron-LM: the last rank prints one iteration line per step.

    [2026-11-23 10:21:13] iteration       12/      70 | consumed samples:          96 | elapsed time per
    iteration (ms): 51.2 | learning rate: 1.000E-04 | global batch size:     8 | lm loss: 1.234567E+00 |
    loss scale: 1.0 | grad norm: 0.512 | number of skipped iterations:   0 | number of nan iterations:   0 |

(the format of megatron/training/training.py's training_log; values are this job's own). From
``--slow-from`` on, every rank's step takes ``--slow-factor`` times longer: a whole-job slowdown.
"""

import argparse
import os
import time
from datetime import datetime

import torch
import torch.distributed as dist
from torch import nn

p = argparse.ArgumentParser()
p.add_argument("--iters", type=int, default=70)
p.add_argument("--step-time-ms", type=float, default=50)
p.add_argument("--slow-from", type=int, default=0, help="first slow iteration (0: never)")
p.add_argument("--slow-factor", type=float, default=5)
args = p.parse_args()

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
torch.manual_seed(0)
model = nn.parallel.DistributedDataParallel(nn.Linear(16, 1))
opt = torch.optim.SGD(model.parameters(), lr=1e-4)
for it in range(1, args.iters + 1):
    t0 = time.perf_counter()
    opt.zero_grad()
    loss = model(torch.randn(8, 16)).pow(2).mean()
    loss.backward()
    opt.step()
    pad = args.step_time_ms * (args.slow_factor if args.slow_from and it >= args.slow_from else 1) / 1000
    time.sleep(max(0.0, pad - (time.perf_counter() - t0)))
    ms = (time.perf_counter() - t0) * 1000
    if rank == world - 1:  # Megatron's print_rank_last
        print(f" [{datetime.now():%Y-%m-%d %H:%M:%S}] iteration {it:8d}/{args.iters:8d} | consumed samples: "
              f"{it * 8 * world:12d} | elapsed time per iteration (ms): {ms:.1f} | learning rate: 1.000E-04 | "
              f"global batch size: {8 * world:5d} | lm loss: {loss.item():.6E} | loss scale: 1.0 | grad norm: 0.512 | "
              "number of skipped iterations:   0 | number of nan iterations:   0 |", flush=True)
dist.barrier()
dist.destroy_process_group()
os._exit(0)  # skip gloo's teardown race under load (see tests/tgtest.py)
