"""The node-check benchmark: one process per GPU of a node (one per node on the CPU, or
``--local-world-size`` gloo processes), joined with its group's in one process group.

Run as ``python -m trainguard.checks.bench --store-host H --store-port P --rank R --world-size W
--local-rank L``: R and W count processes across the group's nodes; the process uses GPU L. It
times a GEMM on its GPU, an all-reduce and an all-gather across every process (every GPU of the
group's nodes) and prints one JSON line (``NODECHECK {...}``); the node's coordinator
(``nodecheck_run``) takes the slowest of its processes as the node's times.

Units (nccl-tests definitions; DLRover once added milliseconds per matmul to the total seconds of
20 all-reduces and reported 51 GB/s where about 1 GB/s was real — here every time is the median
seconds of ONE operation and every bandwidth is bytes / that time):

- ``gemm_s``: seconds per (n x n) @ (n x n) matmul; ``gemm_tflops`` = 2 n^3 / gemm_s / 1e12.
- all-reduce of S bytes: ``algbw`` = S / t, ``busbw`` = algbw * 2 (W-1) / W.
- all-gather with S bytes of output (S/W from each rank): ``algbw`` = S / t, ``busbw`` = algbw * (W-1) / W.
- bandwidths in GB/s (1 GB = 1e9 bytes).

Fault injection (for tests and drills only; never set in production):
``TRAINGUARD_CHAOS_NODECHECK=fail`` makes this process die right after joining the group (as if the
node broke); ``slow:<factor>`` makes every timed operation take about <factor> times longer; ``corrupt`` changes
one element of one burn result (``--burn``: a GPU that computes a wrong value).
``--hold-file PATH``: while PATH exists, wait with the group up before measuring (at most
``--timeout``), so that a drill can aim at this process (``trainguard chaos nodecheck-kill``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from trainguard.checks.burn import run_burn
from trainguard.checks.sweep import algbw_busbw, run_sweep

__all__ = ["algbw_busbw", "main", "parse_chaos", "run"]

CHAOS_ENV = "TRAINGUARD_CHAOS_NODECHECK"
RESULT_PREFIX = "NODECHECK "
READY_LINE = "NODECHECK_READY"
CHAOS_EXIT_CODE = 17


def parse_chaos(value: str | None) -> tuple[str, float]:
    """'' -> ('', 1); 'fail' -> ('fail', 1); 'corrupt' -> ('corrupt', 1); 'slow:4' -> ('slow', 4.0). Bad values raise ValueError."""
    value = (value or "").strip()
    if not value:
        return "", 1.0
    if value in ("fail", "corrupt"):
        return value, 1.0
    if value.startswith("slow:"):
        factor = float(value.split(":", 1)[1])
        if factor < 1:
            raise ValueError(f"{CHAOS_ENV}=slow:<factor> needs factor >= 1, got {factor}")
        return "slow", factor
    raise ValueError(f"{CHAOS_ENV} must be 'fail', 'corrupt' or 'slow:<factor>', got {value!r}")


def _time_ops(
    fn: Callable[[], None], sync: Callable[[], None], warmup: int, iters: int, slow: float
) -> float:
    """Median seconds of one call of ``fn`` (each op timed alone, device synchronised)."""
    for _ in range(warmup):
        fn()
    sync()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        sync()
        dt = time.perf_counter() - t0
        if slow > 1:  # chaos: stretch this op to about `slow` times its real duration
            time.sleep(dt * (slow - 1))
            dt = time.perf_counter() - t0
        times.append(dt)
    return statistics.median(times)


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    mode, factor = parse_chaos(os.environ.get(CHAOS_ENV))
    use_cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    backend = args.backend if args.backend != "auto" else ("nccl" if use_cuda else "gloo")
    if use_cuda:
        torch.cuda.set_device(args.local_rank)
        dev = torch.device("cuda", args.local_rank)

        def sync() -> None:
            torch.cuda.synchronize(dev)
    else:
        torch.set_num_threads(args.threads)
        dev = torch.device("cpu")

        def sync() -> None:
            pass

    store = dist.TCPStore(
        args.store_host, args.store_port, is_master=False, timeout=timedelta(seconds=args.timeout)
    )
    dist.init_process_group(
        backend,
        store=dist.PrefixStore("nodecheck", store),
        rank=args.rank,
        world_size=args.world_size,
        timeout=timedelta(seconds=args.timeout),
    )
    if mode == "fail":
        print(f"chaos: {CHAOS_ENV}=fail, the check process dies now", file=sys.stderr, flush=True)
        os._exit(CHAOS_EXIT_CODE)
    if args.hold_file:
        _held(args.hold_file, args.timeout)
    world = args.world_size
    out: dict[str, Any] = {"backend": backend, "device": str(dev), "world_size": world, "rank": args.rank,
                           "local_rank": args.local_rank}
    if args.sync:
        # Torch is imported and the group is up: wait until every group of the wave is, so that
        # no pair measures while another one still starts (start-up noise would look like a
        # straggler). The coordinator writes one line to stdin; EOF also starts.
        print(READY_LINE, flush=True)
        sys.stdin.readline()

    out.update(_gemm(args, dev, factor))
    out.update(_collectives(args, dev, sync, world, factor))
    if args.burn > 0:
        n = args.gemm_n or (4096 if use_cuda else 256)
        out.update(run_burn(dev, args.burn, n, corrupt=mode == "corrupt"))
    if args.sweep:
        max_bytes = int((args.sweep_max_mb or (64.0 if use_cuda else 8.0)) * 2**20)
        out.update(run_sweep(dev, world, max_bytes, lambda fn: _time_ops(fn, sync, 1, args.iters, factor)))
    dist.barrier()
    dist.destroy_process_group()
    return out


def _held(path: str, limit_s: float) -> None:
    """Wait while ``path`` exists (a drill's hold), at most ``limit_s`` seconds."""
    end = time.monotonic() + limit_s
    while os.path.lexists(path) and time.monotonic() < end:
        time.sleep(0.1)


def _gemm(args: argparse.Namespace, dev: Any, factor: float) -> dict[str, Any]:
    """GEMM timing on this process's device (its GPU, or the CPU)."""
    import torch

    use_cuda = dev.type == "cuda"
    n = args.gemm_n or (4096 if use_cuda else 256)
    dtype = torch.float16 if use_cuda else torch.float32
    a = torch.randn(n, n, device=dev, dtype=dtype)
    b = torch.randn(n, n, device=dev, dtype=dtype)

    def sync() -> None:
        if use_cuda:
            torch.cuda.synchronize(dev)

    gemm_s = _time_ops(lambda: torch.matmul(a, b), sync, args.warmup, args.iters, factor)
    return {"gemm_n": n, "gemm_s": gemm_s, "gemm_tflops": 2 * n**3 / gemm_s / 1e12}


def _collectives(args: argparse.Namespace, dev: Any, sync: Any, world: int, factor: float) -> dict[str, Any]:
    """All-reduce and all-gather timings over S bytes of float32, with their bandwidths."""
    import torch
    import torch.distributed as dist

    coll_mb = args.coll_mb or (64.0 if dev.type == "cuda" else 1.0)
    nbytes = max(4 * world, int(coll_mb * 1e6) // (4 * world) * 4 * world)
    x = torch.ones(nbytes // 4, device=dev, dtype=torch.float32)
    dist.barrier()
    out: dict[str, Any] = {"bytes": nbytes}
    out["allreduce_s"] = _time_ops(lambda: dist.all_reduce(x), sync, args.warmup, args.iters, factor)
    out["allreduce_algbw_gbps"], out["allreduce_busbw_gbps"] = algbw_busbw(
        "all_reduce", nbytes, out["allreduce_s"], world
    )
    chunk = x[: nbytes // 4 // world].clone()
    parts = [torch.empty_like(chunk) for _ in range(world)]
    dist.barrier()
    out["allgather_s"] = _time_ops(
        lambda: dist.all_gather(parts, chunk), sync, args.warmup, args.iters, factor
    )
    out["allgather_algbw_gbps"], out["allgather_busbw_gbps"] = algbw_busbw(
        "all_gather", nbytes, out["allgather_s"], world
    )
    return out



def make_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m trainguard.checks.bench", description=__doc__.split("\n")[0])
    p.add_argument("--store-host", required=True)
    p.add_argument("--store-port", type=int, required=True)
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world-size", type=int, required=True)
    p.add_argument("--local-rank", type=int, default=0, help="this process's GPU on its node")
    p.add_argument("--backend", choices=["auto", "gloo", "nccl"], default="auto")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument("--gemm-n", type=int, default=0, help="matrix size (0: 4096 on GPU, 256 on CPU)")
    p.add_argument(
        "--coll-mb", type=float, default=0.0, help="MB (1e6 bytes) per collective (0: 64 on GPU, 1 on CPU)"
    )
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--threads", type=int, default=1, help="CPU threads for the CPU GEMM")
    p.add_argument("--timeout", type=float, default=60.0, help="seconds for store and collectives")
    p.add_argument("--hold-file", default=None, help="wait while this file exists before measuring (drills)")
    p.add_argument("--burn", type=float, default=0.0, help="seconds of sustained GEMM load after the check (0: none)")
    p.add_argument("--sweep", action="store_true", help="all-reduce/all-gather message-size sweep after the check")
    p.add_argument("--sweep-max-mb", type=float, default=0.0,
                   help="largest sweep size in MiB, as nccl-tests' -e 64M (0: 64 on GPU, 8 on CPU)")  # fmt: skip
    p.add_argument("--sync", action="store_true", help="print NODECHECK_READY, then wait for a line on stdin")
    return p


def main(argv: list[str] | None = None) -> int:
    args = make_parser().parse_args(argv)
    try:
        parse_chaos(os.environ.get(CHAOS_ENV))
        result = {"ok": True, **run(args)}
        code = 0
    except Exception as exc:
        result = {"ok": False, "error": f"{type(exc).__name__}: {str(exc)[:400]}"}
        code = 1
    print(RESULT_PREFIX + json.dumps(result), flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
