"""`tgdemo-train`: a console script that trains (gloo, CPU) with no trainguard code in it.

Its DataLoader workers (forked, and spawned with `--loaders fork,spawn`) report what
instrumentation they carry, so the test can check that only the trainer owns the rank's ring.
Prints `step=<n> rank=<r> t=<t>`. (A rank killed while a spawn-context DataLoader runs leaves its
named semaphores in /dev/shm: multiprocessing's resource tracker dies with it. Hence fork only
where a test kills a rank.)
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, Dataset


class Batches(Dataset):
    def __len__(self) -> int:
        return 1 << 20

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.randn(8, generator=torch.Generator().manual_seed(i))


def report(tag: str) -> None:
    spans = sys.modules.get("trainguard.worker.spans")
    rec = spans.recorder() if spans else None
    state = "none" if rec is None else ("ring" if rec.writer.path else "private")
    print(f"instrumentation {tag} pid={os.getpid()} recorder={state}", flush=True)


def worker_init(_: int) -> None:
    report(f"dataloader-{torch.utils.data.get_worker_info().dataset.context}")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--step-time-ms", type=float, default=20)
    p.add_argument("--hang-rank", type=int, default=-1, help="this rank hangs at --hang-step on the first attempt")
    p.add_argument("--hang-step", type=int, default=-1)
    p.add_argument("--loaders", default="fork", help="DataLoader worker start methods, comma-separated")
    args = p.parse_args()
    rank = int(os.environ["RANK"])
    attempt = int(os.environ.get("TRAINGUARD_RESTART_COUNT", "0"))
    print(f"user sitecustomize ran: {os.environ.get('TGDEMO_USER_SITE', 'no')}", flush=True)
    dist.init_process_group("gloo")
    model = nn.parallel.DistributedDataParallel(nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    loaders = []
    for context in args.loaders.split(","):
        data = Batches()
        data.context = context
        loaders.append(iter(DataLoader(data, batch_size=4, num_workers=1, worker_init_fn=worker_init,
                                       multiprocessing_context=context)))  # fmt: skip
    for step in range(1, args.steps + 1):
        if rank == args.hang_rank and step == args.hang_step and attempt == 0:
            print(f"hanging at step={step} rank={rank}", flush=True)
            # One sleep past --hang-detect-time while the others wait in the all-reduce: the proof
            # the hang watch acts on (a loop of short sleeps is only a suspicion until that window).
            time.sleep(3600)
        t0 = time.perf_counter()
        x = next(loaders[step % len(loaders)])
        opt.zero_grad()
        model(x).sum().backward()
        opt.step()
        time.sleep(max(0.0, args.step_time_ms / 1000 - (time.perf_counter() - t0)))
        print(f"step={step} rank={rank} t={time.time():.3f}", flush=True)
        if step == 1:
            report("trainer")
    del loaders, x
    gc.collect()  # DataLoader workers stopped, their queues' semaphores unlinked (os._exit skips that)
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)  # skip gloo's teardown race under load (see tests/tgtest.py's jobs)


if __name__ == "__main__":
    main()
