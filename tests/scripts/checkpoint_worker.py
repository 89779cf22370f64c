"""A training worker for the checkpoint tests: DDP (gloo) MLP + Adam, trainguard.checkpoint every
--every steps. Prints `resume step=S digest=D world=W saved_world=V`, `step=S`,
`saved step=S digest=D ok=B`, `done`. The state records the world size it was saved at.

The digest is a SHA-256 of the whole saved state's tensor bytes, so the test can check that a
resumed state is bit-identical to the one saved at that step. --big-mb adds a tensor filled with
the step number (a large state makes the persist window long enough to interrupt).
--die-in-save N: the process dies inside its N-th save, after copying, before committing.
--kill-after-save S: rank 1 SIGKILLs itself right after the save of step S (first attempt only).
--steps-after-resize K: when the resumed state was saved at another world size, train K more steps.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import signal
import sys
import time

import torch
import torch.distributed as dist
from torch import nn

from trainguard import checkpoint as ckpt


def digest(state: dict) -> str:
    h = hashlib.sha256()

    def walk(v):
        if isinstance(v, torch.Tensor):
            t = v.detach().cpu().contiguous().view(-1)
            raw = bytearray(t.numel() * t.element_size())
            if raw:
                torch.frombuffer(raw, dtype=torch.uint8).copy_(t.view(torch.uint8))
            h.update(raw)
        elif isinstance(v, dict):
            for k in sorted(v, key=str):
                h.update(str(k).encode())
                walk(v[k])
        elif isinstance(v, list | tuple):
            for x in v:
                walk(x)
        else:
            h.update(repr(v).encode())

    walk(state)
    return h.hexdigest()[:16]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=100000)
    p.add_argument("--every", type=int, default=1)
    p.add_argument("--big-mb", type=float, default=0.0)
    p.add_argument("--step-sleep", type=float, default=0.01)
    p.add_argument("--die-in-save", type=int, default=0)
    p.add_argument("--kill-after-save", type=int, default=-1,
                   help="SIGKILL this process right after saving step S (first attempt, rank 1 only)")
    p.add_argument("--steps-after-resize", type=int, default=-1)
    args = p.parse_args()

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 1))
    net = nn.parallel.DistributedDataParallel(model) if world > 1 else model
    opt = torch.optim.Adam(net.parameters(), lr=1e-3)
    big_n = int(args.big_mb * (1 << 20) / 4)

    if args.die_in_save:
        from trainguard.checkpoint.client import Checkpointer

        publish = Checkpointer._publish
        count = [0]

        def dying_publish(self, p):
            count[0] += 1
            if count[0] == args.die_in_save:
                print(f"dying in save step={p.step}", flush=True)
                os._exit(9)
            publish(self, p)

        Checkpointer._publish = dying_publish

    state = ckpt.load_latest()
    start, saved_world = 0, world
    if state is not None:
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optim"])
        start, saved_world = int(state["step"]), int(state.get("world", world))
        if big_n:
            assert bool((state["big"] == start).all()), "big tensor does not match the step"
        if saved_world != world and args.steps_after_resize >= 0:
            args.steps = start + args.steps_after_resize
    print(f"resume step={start} digest={digest(state) if state is not None else '-'} world={world} "
          f"saved_world={saved_world}", flush=True)
    print(f"shm_dir={os.environ.get('TRAINGUARD_CKPT_SHM_DIR', '-')}", flush=True)

    gen = torch.Generator().manual_seed(1000 + start)
    for step in range(start + 1, args.steps + 1):
        x = torch.randn(32, 16, generator=gen)
        loss = nn.functional.mse_loss(net(x), x.sum(1, keepdim=True))
        opt.zero_grad()
        loss.backward()
        opt.step()
        print(f"step={step}", flush=True)
        if step % args.every == 0:
            state = {"model": model.state_dict(), "optim": opt.state_dict(), "step": step, "world": world}
            if big_n:
                state["big"] = torch.full((big_n,), float(step))
            d = digest(state)
            ok = ckpt.save(state, step)
            print(f"saved step={step} digest={d} ok={ok}", flush=True)
            if (step == args.kill_after_save and int(os.environ.get("RANK", "0")) == 1
                    and os.environ.get("TRAINGUARD_RESTART_COUNT", "0") == "0"):
                os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(args.step_sleep)
    ckpt.wait()
    if world > 1:
        dist.barrier()
        dist.destroy_process_group()
    print("done", flush=True)
    if world > 1:
        # Leave without interpreter teardown: under heavy load torch's gloo teardown at exit has
        # aborted a finished worker here ("terminate called without an active exception"); these
        # tests check trainguard, not torch's exit path.
        sys.stderr.flush()
        os._exit(0)


if __name__ == "__main__":
    main()
