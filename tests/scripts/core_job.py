"""Test job for the supervisor core: markers at the moments tests kill it."""

import argparse
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=20)
p.add_argument("--step-time-ms", type=float, default=20)
p.add_argument("--ckpt-every", type=int, default=5)
p.add_argument("--ckpt-pad-mb", type=int, default=0, help="extra tensor data so a save takes a while")
p.add_argument("--init-delay-rank", type=int, default=-1, help="this rank waits before init (first attempt only)")
p.add_argument("--init-delay", type=float, default=0.0)
p.add_argument("--raise-always", action="store_true")
p.add_argument("--exit-always", type=int, default=0, help="rank 0 exits with this code at step 2, every attempt")
p.add_argument("--kill-at", type=int, default=0, help="rank 1 SIGKILLs itself at this step, every attempt")
args = p.parse_args()

attempt = int(os.environ["TRAINGUARD_RESTART_COUNT"])
rank = int(os.environ["RANK"])
print(f"env run_dir={os.environ['TRAINGUARD_RUN_DIR']} restart_count={attempt}", flush=True)
if rank == args.init_delay_rank and attempt == 0:
    time.sleep(args.init_delay)
print("init_begin", flush=True)
dist.init_process_group("gloo")
print("init_done", flush=True)
model = nn.parallel.DistributedDataParallel(nn.Linear(8, 8))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
ckpt = Path(os.environ["TRAINGUARD_RUN_DIR"]) / "ckpt.pt"
start = 0
if ckpt.exists():
    state = torch.load(ckpt, weights_only=True)
    model.module.load_state_dict(state["model"])
    start = int(state["step"])
print(f"resume step={start}", flush=True)
pad = torch.zeros(args.ckpt_pad_mb * 262144)
for step in range(start + 1, args.steps + 1):
    if args.raise_always and rank == 1 and step == 2:
        raise ValueError("bad batch shape: the user's bug")
    if args.exit_always and rank == 0 and step == 2:
        os._exit(args.exit_always)
    if args.kill_at and rank == 1 and step == args.kill_at:
        os.kill(os.getpid(), 9)  # a native crash at the same step: a restart from the snapshot meets it again
    t0 = time.perf_counter()
    opt.zero_grad()
    model(torch.randn(4, 8)).sum().backward()
    opt.step()
    time.sleep(max(0.0, args.step_time_ms / 1000 - (time.perf_counter() - t0)))
    print(f"step={step} rank={rank} t={time.time():.3f}", flush=True)
    if rank == 0 and step % args.ckpt_every == 0:
        print(f"saving step={step}", flush=True)
        tmp = ckpt.with_suffix(".tmp")
        torch.save({"model": model.module.state_dict(), "step": step, "pad": pad}, tmp)
        os.replace(tmp, ckpt)
        print(f"saved step={step}", flush=True)
dist.barrier()
dist.destroy_process_group()
# Leave without interpreter teardown: under heavy load torch's gloo teardown at exit has
# aborted a finished worker here ("terminate called without an active exception"); these
# tests check trainguard, not torch's exit path.
sys.stdout.flush()
sys.stderr.flush()
os._exit(0)
