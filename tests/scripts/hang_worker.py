"""A small gloo training loop that hangs on purpose (first attempt only) — for the hang tests.

Run with RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT set (torchrun, trainguard run, or a test).
Prints `step=<n> rank=<r> t=<unix time>` after every step. Faults (on --fault-rank at --fault-step,
only while TRAINGUARD_RESTART_COUNT / TORCHELASTIC_RESTART_COUNT is --fault-attempt, default 0,
so a restart finishes):

  stop      the rank stops itself with SIGSTOP
  sleep     the rank sleeps before the step's all-reduce while the others block in it
  spin      the rank loops forever in Python, holding the GIL
  mismatch  the rank calls broadcast where the others call all_reduce: a deadlock
  cblock    the rank blocks forever in a C-level call (libc pause() through ctypes)
  savestop  every rank enters a checkpoint phase: the rank writes a large-ish state with
            torch.save and stops itself (SIGSTOP) just after, while the others wait in a barrier

Healthy long phases: --ckpt-at/--ckpt-pause (rank 0 saves a checkpoint that first uploads for
--ckpt-pause seconds, a small write every half second as to slow storage; the others wait in a
barrier) and --eval-at/--eval-seconds (every rank evaluates without printing).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time

import torch
import torch.distributed as dist


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--step-time-ms", type=float, default=50.0)
    p.add_argument("--fault", choices=["none", "stop", "sleep", "spin", "mismatch", "cblock", "savestop"], default="none")
    p.add_argument("--fault-rank", type=int, default=1)
    p.add_argument("--fault-step", type=int, default=10)
    p.add_argument("--fault-attempt", type=int, default=0, help="the attempt (restart count) the fault happens in")
    p.add_argument("--ckpt-at", type=int, default=-1)
    p.add_argument("--ckpt-pause", type=float, default=30.0)
    p.add_argument("--eval-at", type=int, default=-1)
    p.add_argument("--eval-seconds", type=float, default=8.0)
    p.add_argument("--eval-rank", type=int, default=-1, help="the one rank that evaluates (-1: every rank)")
    return p.parse_args()


def attempt() -> int:
    return int(
        os.environ.get("TRAINGUARD_RESTART_COUNT") or os.environ.get("TORCHELASTIC_RESTART_COUNT") or 0
    )


def save_checkpoint(model: torch.Tensor, pause: float, rank: int) -> None:
    if rank == 0:
        path = os.path.join(os.environ.get("TRAINGUARD_RUN_DIR", "."), "hang_worker_ckpt.pt")
        deadline = time.monotonic() + pause
        with open(path + ".upload", "wb") as f:
            while time.monotonic() < deadline:  # a slow upload: a little data every half second
                f.write(b"x" * 4096)
                f.flush()
                time.sleep(min(0.5, max(0.0, deadline - time.monotonic())))
        os.unlink(path + ".upload")
        torch.save({"w": model}, path)
    dist.barrier()


def evaluate(model: torch.Tensor, seconds: float) -> float:
    deadline = time.monotonic() + seconds
    total = torch.zeros(1)
    while time.monotonic() < deadline:
        x = torch.randn(64, model.shape[0])
        total += (x @ model).square().mean()
    dist.all_reduce(total)
    return float(total)


def save_then_stop(rank: int) -> None:
    """A checkpoint save (torch.save of ~64 MB), then the process freezes just after it."""
    path = os.path.join(os.environ.get("TRAINGUARD_RUN_DIR", "."), f"hang_worker_state_{rank}.pt")
    torch.save({"state": torch.randn(16 * 1024 * 1024)}, path)
    os.unlink(path)
    os.kill(os.getpid(), signal.SIGSTOP)


def block_in_c() -> None:
    import ctypes

    ctypes.CDLL(None).pause()  # returns only on a caught signal: a C call that never returns


def spin_forever() -> None:
    n = 0
    while True:  # pure Python: holds the GIL, no I/O, no collective
        n += 1


def main() -> int:
    args = parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    faulty = args.fault != "none" and attempt() == args.fault_attempt and rank == args.fault_rank
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(32, 1))
    opt = torch.optim.SGD([w], lr=0.01)  # its step() marks step boundaries for trainguard's profiler
    for step in range(1, args.steps + 1):
        t0 = time.perf_counter()
        x = torch.randn(16, 32)
        opt.zero_grad()
        (x @ w).square().mean().backward()
        grad = w.grad
        left = args.step_time_ms / 1000 - (time.perf_counter() - t0)
        if left > 0:
            time.sleep(left)
        if faulty and step == args.fault_step:
            print(f"fault={args.fault} rank={rank} t={time.time():.6f}", flush=True)
            if args.fault == "stop":
                os.kill(os.getpid(), signal.SIGSTOP)
            elif args.fault == "sleep":
                time.sleep(3600)
            elif args.fault == "spin":
                spin_forever()
            elif args.fault == "mismatch":
                dist.broadcast(grad, src=rank)
            elif args.fault == "cblock":
                block_in_c()
        if args.fault == "savestop" and attempt() == args.fault_attempt and step == args.fault_step:
            if faulty:
                save_then_stop(rank)
            dist.barrier()
        dist.all_reduce(grad)
        grad /= world
        opt.step()
        print(
            f"step={step} rank={rank} t={time.time():.6f} loss={float(w.detach().square().sum()):.5f}",
            flush=True,
        )
        if step == args.ckpt_at:
            save_checkpoint(w.detach(), args.ckpt_pause, rank)
        if step == args.eval_at:
            evaluate(w.detach(), args.eval_seconds if args.eval_rank in (-1, rank) else 0.0)
    dist.barrier()
    dist.destroy_process_group()
    # Leave without interpreter teardown: under heavy load torch's gloo teardown at exit has
    # aborted a finished worker here ("terminate called without an active exception"); these
    # tests check trainguard, not torch's exit path.
    print(f"done rank={rank}", flush=True)
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
