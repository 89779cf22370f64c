"""A small DDP training job for trying trainguard (gloo on CPU, NCCL when CUDA is present).

Runs unchanged under torchrun or `trainguard run`:

    trainguard run --standalone --nproc-per-node 2 examples/train_mlp.py --steps 200 --ckpt-every 20

Prints `resume step=<n>` on start (0 when fresh) and `step=<n> rank=<r> t=<unix time>` per step.
"""

from __future__ import annotations

import argparse
import atexit
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--step-time-ms", type=float, default=0.0, help="pad each step's compute to about M ms")
    p.add_argument("--ckpt-every", type=int, default=0, help="save a checkpoint every K steps (0: never)")
    p.add_argument("--ckpt-dir", default=None, help="default: $TRAINGUARD_RUN_DIR/ckpt or ./ckpt")
    p.add_argument("--ckpt", choices=["torch", "trainguard"], default="torch", help="checkpoint backend")
    p.add_argument("--fsdp", action="store_true",
                   help="shard the model with FSDP2 (fully_shard) instead of DDP: each rank holds only its shards; "
                        "needs --ckpt trainguard, which reshards them when the world size changes")
    p.add_argument("--slow-rank", type=int, default=-1, help="this rank's compute takes --slow-factor times longer")
    p.add_argument("--slow-factor", type=float, default=1.0)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--batch", type=int, default=32)
    # Fault injection for tests and demos.
    p.add_argument("--fail-rank", type=int, default=-1, help="rank that fails (see --fail-step)")
    p.add_argument("--fail-step", type=int, default=-1, help="step at which --fail-rank fails")
    p.add_argument(
        "--fail-mode",
        choices=["raise", "zerodiv", "exit", "exit0", "kill", "hang", "stop", "loop", "abort-at-exit"],
        default="raise",
        help="hang: sleep forever before the all-reduce; stop: SIGSTOP itself; loop: an endless busy loop; exit0: "
        "leave with exit code 0 (early); abort-at-exit: train to the end, then abort in the interpreter's teardown",
    )
    p.add_argument("--fail-always", action="store_true", help="fail on every attempt (default: first only)")
    p.add_argument("--hang-file", default=None,
                   help="when this file appears, the rank that sees it first takes it and sleeps before its next "
                        "all-reduce (bench/soak.py's sleep-before-collective hang; bounded at 1 h)")  # fmt: skip
    p.add_argument("--timeout-s", type=float, default=None, help="the process group's timeout (default: torch's)")
    return p.parse_args()


class MLP(nn.Module):
    def __init__(self, hidden: int, pad_s: float) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, 1))
        self.pad_s = pad_s

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t0 = time.perf_counter()
        y = self.net(x)
        # Pad the local compute part of the step (before DDP's gradient all-reduce).
        left = self.pad_s - (time.perf_counter() - t0)
        if left > 0:
            time.sleep(left)
        return y


def ckpt_path(args: argparse.Namespace) -> Path:
    base = args.ckpt_dir or os.path.join(os.environ.get("TRAINGUARD_RUN_DIR", "."), "ckpt")
    return Path(base) / "train_mlp.pt"


def save_torch(path: Path, model: nn.Module, opt: torch.optim.Optimizer, step: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    torch.save({"model": model.state_dict(), "optim": opt.state_dict(), "step": step}, tmp)
    os.replace(tmp, path)  # atomic: a kill mid-save leaves the previous checkpoint intact


def load_torch(path: Path, model: nn.Module, opt: torch.optim.Optimizer, device: torch.device) -> int:
    if not path.exists():
        return 0
    state = torch.load(path, map_location=device, weights_only=True)
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["optim"])
    return int(state["step"])


def shard(model: MLP, device: torch.device):
    """FSDP2: every Linear and the whole model sharded over all ranks (one mesh dimension)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    for layer in model.net:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return mesh, model


def get_state(model: nn.Module, opt: torch.optim.Optimizer, step: int, sharded: bool) -> dict:
    if not sharded:
        return {"model": model.state_dict(), "optim": opt.state_dict(), "step": step}
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, opt)  # DTensor shards: this rank's part only
    return {"model": msd, "optim": osd, "step": step}


def put_state(model: nn.Module, opt: torch.optim.Optimizer, state: dict, sharded: bool) -> None:
    if not sharded:
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optim"])
        return
    from torch.distributed.checkpoint.state_dict import set_state_dict

    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])


def maybe_fail(args: argparse.Namespace, rank: int, step: int) -> None:
    if rank != args.fail_rank or step != args.fail_step:
        return
    if not args.fail_always and int(os.environ.get("TRAINGUARD_RESTART_COUNT", os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))) > 0:
        return
    print(f"injecting failure ({args.fail_mode}) at step={step} rank={rank}", flush=True)
    if args.fail_mode == "zerodiv":
        print(1 / 0)
    elif args.fail_mode == "exit":
        os._exit(3)
    elif args.fail_mode == "exit0":
        sys.exit(0)
    elif args.fail_mode == "abort-at-exit":  # what torch's gloo teardown does under load
        def abort() -> None:
            print("terminate called without an active exception", file=sys.stderr, flush=True)
            os.abort()

        atexit.register(abort)
        return
    elif args.fail_mode == "kill":
        os.kill(os.getpid(), 9)
    elif args.fail_mode == "hang":
        while True:  # the other ranks now wait in the gradient all-reduce
            time.sleep(60)
    elif args.fail_mode == "stop":
        os.kill(os.getpid(), 19)
        return
    elif args.fail_mode == "loop":
        n = 0
        while True:  # busy on CPU: looks like long work until --hang-detect-time
            n += 1
    raise RuntimeError(f"injected failure at step {step} on rank {rank}")


def maybe_hang(hang_file: str | None) -> None:
    """Take the hang file (so that a restarted worker does not hang again) and sleep: the other
    ranks wait in the gradient all-reduce. Bounded, as every injected fault."""
    if hang_file is None:
        return
    try:
        os.unlink(hang_file)
    except OSError:  # not there, or another rank took it
        return
    print(f"injecting failure (hang-file) rank={dist.get_rank()}", flush=True)
    time.sleep(3600)


def main() -> None:
    args = parse_args()
    use_cuda = torch.cuda.is_available()
    timeout = {} if args.timeout_s is None else {"timeout": timedelta(seconds=args.timeout_s)}
    dist.init_process_group("nccl" if use_cuda else "gloo", **timeout)
    rank = dist.get_rank()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device(f"cuda:{local_rank}" if use_cuda else "cpu")
    if use_cuda:
        torch.cuda.set_device(device)

    pad_s = args.step_time_ms / 1000.0
    if rank == args.slow_rank:
        pad_s *= args.slow_factor
    torch.manual_seed(0)
    model = MLP(args.hidden, pad_s).to(device)
    mesh = None
    if args.fsdp:
        if args.ckpt != "trainguard":
            sys.exit("--fsdp needs --ckpt trainguard")
        mesh, ddp = shard(model, device)
    else:
        ddp = DDP(model, device_ids=[local_rank] if use_cuda else None)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)

    ckpt = None
    if args.ckpt == "trainguard":
        from trainguard import checkpoint as ckpt

        state = ckpt.load_latest(mesh=mesh)
        start = 0
        if state is not None:
            put_state(model, opt, state, args.fsdp)
            start = int(state["step"])
    else:
        start = load_torch(ckpt_path(args), model, opt, device)
    print(f"resume step={start}", flush=True)

    gen = torch.Generator().manual_seed(1234 + rank)
    for step in range(start + 1, args.steps + 1):
        maybe_fail(args, rank, step)
        maybe_hang(args.hang_file)
        x = torch.randn(args.batch, 16, generator=gen).to(device)
        y = x.sum(dim=1, keepdim=True).to(device)
        opt.zero_grad(set_to_none=True)
        loss = nn.functional.mse_loss(ddp(x), y)
        loss.backward()
        opt.step()
        print(f"step={step} rank={rank} t={time.time():.3f} loss={loss.item():.4f} world={dist.get_world_size()}", flush=True)
        if args.ckpt_every and step % args.ckpt_every == 0:
            state = get_state(model, opt, step, args.fsdp)
            if ckpt is not None:
                ckpt.save(state, step)
            elif rank == 0:
                save_torch(ckpt_path(args), model, opt, step)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
