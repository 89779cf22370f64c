"""A training worker for the NaN triage tests: DDP (gloo) MLP + SGD, a trainguard snapshot after
every step. Stops like most training loops do on a non-finite gradient norm or loss
(FloatingPointError). Prints `resume step=S`, `step=S`, `done`.

--flip-step N: rank 1 corrupts one gradient value to NaN after the reduction at step N, in its
run's first attempt only (TRAINGUARD_RESTART_COUNT 0, or the variable --first-attempt-var names: a
torchrun script reads TORCHELASTIC_RESTART_COUNT): a one-off fault on one rank, as silent data
corruption would. --lr: a learning rate that diverges on every rank. Every attempt prints
`TORCHELASTIC_RESTART_COUNT=N` first.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time

import torch
import torch.distributed as dist
from torch import nn

from trainguard import checkpoint as ckpt


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--flip-step", type=int, default=-1)
    p.add_argument("--step-sleep", type=float, default=0.02)
    p.add_argument("--first-attempt-var", default="TRAINGUARD_RESTART_COUNT")
    args = p.parse_args()

    print(f"TORCHELASTIC_RESTART_COUNT={os.environ.get('TORCHELASTIC_RESTART_COUNT')}", flush=True)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 1))
    net = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(net.parameters(), lr=args.lr)
    state = ckpt.load_latest()
    start = 0
    if state is not None:
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optim"])
        start = int(state["step"])
    print(f"resume step={start}", flush=True)
    first_attempt = os.environ.get(args.first_attempt_var, "0") == "0"
    for step in range(start + 1, args.steps + 1):
        gen = torch.Generator().manual_seed(1000 * step + rank)
        x = torch.randn(32, 16, generator=gen)
        loss = nn.functional.mse_loss(net(x), x.sum(1, keepdim=True))
        opt.zero_grad()
        loss.backward()
        if step == args.flip_step and rank == 1 and first_attempt:
            with torch.no_grad():
                model[0].weight.grad[0, 0] = float("nan")
        norm = float(torch.nn.utils.clip_grad_norm_(net.parameters(), 1e30))
        if not (math.isfinite(norm) and math.isfinite(float(loss))):
            raise FloatingPointError(f"gradient norm is {norm} (loss {float(loss)}) at step {step}")
        opt.step()
        ckpt.save({"model": model.state_dict(), "optim": opt.state_dict(), "step": step}, step)
        print(f"step={step}", flush=True)
        time.sleep(args.step_sleep)
    ckpt.wait()
    dist.barrier()
    dist.destroy_process_group()
    print("done", flush=True)
    sys.stderr.flush()
    os._exit(0)  # see checkpoint_worker.py: gloo's teardown at exit is not what these tests check


if __name__ == "__main__":
    main()
