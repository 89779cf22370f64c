"""`trainguard nodecheck`: GEMM + all-reduce + all-gather health check of nodes in paired groups.

On several machines, start it on every node (like torchrun's static rendezvous: node 0 hosts the
store at --master-addr:--master-port):

    trainguard nodecheck --nnodes 4 --node-rank $RANK --master-addr node0 --master-port 29400

On one machine, ``--local N`` simulates N nodes (one real benchmark process each), and
``--chaos NODE=fail|slow:<factor>`` injects a fault into one simulated node (a drill).

Exit code: 0 healthy, 1 a faulty node (or a failure that could not be located), 3 straggler(s).
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import os
import sys
import threading
from datetime import timedelta
from typing import Any

from trainguard.checks.bench import CHAOS_ENV, parse_chaos
from trainguard.checks.burn import format_burn
from trainguard.checks.nodecheck_run import NodeCheckConfig, NodeChecker
from trainguard.checks.sweep import format_sweep
from trainguard.cluster.stores import bound_store, can_connect
from trainguard.detect.nodecheck import Verdict
from trainguard.options import MAX_SECONDS, given, non_negative_int, number, port, positive, positive_int

EXIT_FAULTY, EXIT_STRAGGLER = 1, 3


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--nnodes", type=positive_int, default=1)
    p.add_argument("--node-rank", type=non_negative_int, default=0)
    p.add_argument("--master-addr", default="127.0.0.1", help="host of the coordination store (node 0)")
    p.add_argument("--master-port", type=port, default=29400)
    p.add_argument("--local", type=non_negative_int, default=0, metavar="N", help="simulate N nodes on this machine")
    p.add_argument("--chaos", action="append", default=[], metavar="NODE=MODE",
                   help="with --local: fault injection, MODE is fail, slow:<factor> or corrupt (a wrong --burn result) (repeatable)")  # fmt: skip
    add_check_arguments(p, prefix="")
    p.add_argument("--burn", type=number("seconds", maximum=MAX_SECONDS), default=0.0, metavar="SECONDS",
                   help="then a sustained GEMM load of SECONDS on every device, each result checked (as gpu-burn)")  # fmt: skip
    p.add_argument("--sweep", action="store_true",
                   help="then an nccl-tests-style all-reduce/all-gather message-size sweep (8 B doubling to --sweep-max-mb)")  # fmt: skip
    p.add_argument("--sweep-max-mb", type=positive, default=None, metavar="MIB",
                   help="largest sweep size in MiB, as nccl-tests' -e (default 64 on GPU, 8 on CPU)")  # fmt: skip
    p.add_argument("--json", action="store_true", help="print the verdict and measurements as JSON")


def add_check_arguments(p: Any, prefix: str = "node-check-") -> None:
    """Benchmark and verdict options (shared with `trainguard run --node-check`). Defaults: NodeCheckConfig."""
    d = NodeCheckConfig()
    p.add_argument(f"--{prefix}backend", choices=["auto", "gloo", "nccl"], default=None,
                   help=f"collective backend (default {d.backend}: nccl with CUDA, else gloo)")  # fmt: skip
    p.add_argument(f"--{prefix}timeout", type=number("seconds", maximum=MAX_SECONDS), default=None, metavar="SECONDS",
                   help=f"limit for one group test: process start, group setup, benchmark (default {d.timeout_s:g})")  # fmt: skip
    p.add_argument(f"--{prefix}gemm-n", type=positive_int, default=None, help="GEMM size (default: 4096 on GPU, 256 on CPU)")
    p.add_argument(f"--{prefix}coll-mb", type=positive, default=None, help="MB per collective (default: 64 GPU, 1 CPU)")
    p.add_argument(f"--{prefix}iters", type=positive_int, default=None, help=f"timed iterations per operation (default {d.iters})")
    p.add_argument(f"--{prefix}straggler-ratio", type=positive, default=None,
                   help=f"a straggler is at least this many times the median time, and beyond median + k*MAD "
                   f"(default {d.straggler_ratio:g})")  # fmt: skip
    p.add_argument(f"--{prefix}straggler-k", type=positive, default=None,
                   help=f"k of the median + k*MAD rule (default {d.straggler_k:g})")
    p.add_argument(f"--{prefix}procs", type=positive_int, default=None, metavar="N",
                   help="benchmark processes per node (default: one per GPU, one on a node without GPUs; "
                   "N on the CPU runs N gloo processes per node)")  # fmt: skip


# NodeCheckConfig field -> option name (after the prefix)
_CHECK_OPTIONS = {
    "backend": "backend",
    "timeout_s": "timeout",
    "gemm_n": "gemm_n",
    "coll_mb": "coll_mb",
    "iters": "iters",
    "straggler_ratio": "straggler_ratio",
    "straggler_k": "straggler_k",
    "procs": "procs",
}


def config_from(args: argparse.Namespace, prefix: str = "") -> NodeCheckConfig:
    a = prefix.replace("-", "_")
    # --burn/--sweep are `trainguard nodecheck`'s own (the run parser has none: getattr's default)
    extra = given(args, {"burn_s": "burn", "sweep": "sweep", "sweep_max_mb": "sweep_max_mb"})
    return NodeCheckConfig(**given(args, {field: a + name for field, name in _CHECK_OPTIONS.items()}), **extra)


def _chaos_map(specs: list[str], nnodes: int) -> dict[int, str]:
    out: dict[int, str] = {}
    for spec in specs:
        node, sep, mode = spec.partition("=")
        if not sep or not node.isdigit() or not 0 <= int(node) < nnodes:
            raise ValueError(f"--chaos {spec!r}: expected NODE=MODE with 0 <= NODE < {nnodes}")
        parse_chaos(mode)
        out[int(node)] = mode
    return out


def format_verdict(v: Verdict, metrics: dict[int, list[dict[str, Any]]]) -> list[str]:
    lines = []
    for r in v.results:
        status = "ok" if r.ok else f"failed ({r.error})"
        lines.append(f"nodecheck node {r.node} group {list(r.group)}: {status}")
    for node, runs in sorted(metrics.items()):
        for m in runs:
            lines.append(
                f"nodecheck node {node} group {m['group']}: gemm {m['gemm_s'] * 1e3:.2f} ms/op "
                f"({m['gemm_tflops']:.3f} TFLOP/s, n={m['gemm_n']}); "
                f"all-reduce {m['allreduce_s'] * 1e3:.2f} ms/op, algbw {m['allreduce_algbw_gbps']:.2f} GB/s, "
                f"busbw {m['allreduce_busbw_gbps']:.2f} GB/s; "
                f"all-gather {m['allgather_s'] * 1e3:.2f} ms/op, algbw {m['allgather_algbw_gbps']:.2f} GB/s, "
                f"busbw {m['allgather_busbw_gbps']:.2f} GB/s ({m['bytes'] / 1e6:.1f} MB, {m['backend']}, "
                f"{m.get('procs', 1)} process(es) per node, world {m['world_size']})"
            )
    lines += _extra_lines(metrics)
    for n, why in sorted(v.faulty.items()):
        lines.append(f"nodecheck verdict: node {n} is faulty: {why}")
    for n, why in sorted(v.stragglers.items()):
        lines.append(f"nodecheck verdict: node {n} is a straggler: {why}")
    if v.undetermined:
        lines.append(f"nodecheck verdict: {v.undetermined}")
    if v.healthy and not v.stragglers:
        lines.append(f"nodecheck verdict: all {len(v.nodes)} node(s) healthy")
    return lines


def _extra_lines(metrics: dict[int, list[dict[str, Any]]]) -> list[str]:
    """The burn and sweep reports of each node's tests."""
    lines = []
    for node, runs in sorted(metrics.items()):
        for m in runs:
            who = f"nodecheck node {node} group {m['group']}"
            if "burn" in m:
                lines += format_burn(who, m["burn"])
            if "sweep" in m:
                lines += format_sweep(who, m["sweep"], m["world_size"])
    return lines


def _exit_code(v: Verdict, nodes: list[int]) -> int:
    if v.undetermined or any(n in v.faulty for n in nodes):
        return EXIT_FAULTY
    if any(n in v.stragglers for n in nodes):
        return EXIT_STRAGGLER
    return 0


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
        return True
    except ValueError:
        return False


def local_gpu_env(node: int, gpus: int, visible: str | None) -> dict[str, str]:
    """A simulated node's own GPU (``--local``): each benchmark process uses its first visible
    device, and NCCL refuses two ranks of one group on one GPU. Node i gets the i-th of the
    visible GPUs (``CUDA_VISIBLE_DEVICES`` when set, else all), round robin when there are fewer
    GPUs than nodes (then groups may share one: ``--backend gloo`` checks them)."""
    if gpus < 1:
        return {}
    ids = [d.strip() for d in visible.split(",") if d.strip()] if visible else [str(i) for i in range(gpus)]
    return {"CUDA_VISIBLE_DEVICES": ids[node % len(ids)]} if ids else {}


def _run_local(
    args: argparse.Namespace, cfg: NodeCheckConfig
) -> tuple[Verdict, dict[int, list[dict[str, Any]]]]:
    import torch
    from torch.distributed import TCPStore

    n = args.local
    chaos = _chaos_map(args.chaos, n)
    gpus = torch.cuda.device_count() if cfg.device != "cpu" else 0
    server = bound_store("127.0.0.1", timeout_s=60)  # loopback only (torch's would listen everywhere)
    checkers = []
    for i in range(n):
        c = NodeCheckConfig(
            **{
                **cfg.__dict__,
                "advertise_addr": "127.0.0.1",
                "env": {**({CHAOS_ENV: chaos[i]} if i in chaos else {}),
                        **local_gpu_env(i, gpus, os.environ.get("CUDA_VISIBLE_DEVICES"))},
            }
        )
        client = TCPStore("127.0.0.1", server.port, is_master=False, timeout=timedelta(seconds=60))
        checkers.append(NodeChecker(client, i, n, c))
    verdicts: dict[int, Verdict] = {}
    errors: list[str] = []

    def work(ch: NodeChecker) -> None:
        try:
            verdicts[ch.me] = ch.run()
        except Exception as exc:
            errors.append(f"node {ch.me}: {exc}")

    threads = [threading.Thread(target=work, args=(ch,), daemon=True) for ch in checkers]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors or 0 not in verdicts:
        raise RuntimeError("; ".join(errors) or "node check did not finish")
    return verdicts[0], {ch.me: ch.metrics for ch in checkers}


def _run_node(
    args: argparse.Namespace, cfg: NodeCheckConfig
) -> tuple[Verdict, dict[int, list[dict[str, Any]]]]:
    from torch.distributed import TCPStore

    cfg.peer_host = args.master_addr
    timeout_s = max(60.0, cfg.timeout_s)
    if args.node_rank != 0:  # node 0's store must answer within --timeout, not torch's minute of retries
        _wait_reachable(args.master_addr, args.master_port, cfg.timeout_s)
    if args.node_rank == 0 and _is_ip(args.master_addr):  # listen on that address only
        store = bound_store(args.master_addr, args.master_port, timeout_s=timeout_s)
    else:  # a host name may resolve here to another address than the others reach: torch's store
        store = TCPStore(
            args.master_addr,
            args.master_port,
            world_size=args.nnodes,
            is_master=args.node_rank == 0,
            wait_for_workers=False,
            timeout=timedelta(seconds=timeout_s),
        )
    checker = NodeChecker(store, args.node_rank, args.nnodes, cfg)
    v = checker.run()
    # Node 0 hosts the store: stay until every node has read the last wave.
    store.add("trainguard/nodecheck/done", 1)
    if args.node_rank == 0:
        _wait_count(store, args.nnodes, cfg)
    return v, {args.node_rank: checker.metrics}


def _wait_reachable(addr: str, port_: int, timeout_s: float) -> None:
    """Return once addr:port accepts a TCP connection; OSError after ``timeout_s`` (one line, and
    none of the C++ retry messages torch's store client prints while it waits)."""
    import time

    deadline = time.monotonic() + timeout_s
    while True:
        why = can_connect(addr, port_, max(0.1, min(2.0, deadline - time.monotonic())))
        if why is None:
            return
        if time.monotonic() >= deadline:
            raise OSError(f"not reachable within {timeout_s:g} s ({why})")
        time.sleep(min(0.5, max(0.0, deadline - time.monotonic())))


def _wait_count(store: Any, n: int, cfg: NodeCheckConfig) -> None:
    import time

    deadline = time.monotonic() + cfg.timeout_s
    while store.add("trainguard/nodecheck/done", 0) < n and time.monotonic() < deadline:
        time.sleep(0.05)


def main(args: argparse.Namespace) -> int:
    cfg = config_from(args)
    try:
        if args.sweep_max_mb is not None and not args.sweep:
            raise ValueError("--sweep-max-mb needs --sweep")
        if args.local:
            if args.local < 1:
                raise ValueError("--local needs N >= 1")
            verdict, metrics = _run_local(args, cfg)
            mine = verdict.nodes
        else:
            if args.chaos:
                raise ValueError("--chaos works with --local; on real nodes set TRAINGUARD_CHAOS_NODECHECK")
            if not 0 <= args.node_rank < args.nnodes:
                raise ValueError(f"--node-rank must be in [0, {args.nnodes})")
            verdict, metrics = _run_node(args, cfg)
            mine = [args.node_rank]
    except ValueError as exc:
        print(f"trainguard nodecheck: error: {exc}", file=sys.stderr)
        return 2
    except (RuntimeError, OSError) as exc:  # the store could not be hosted or reached
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        where = f"{args.master_addr}:{args.master_port}"
        print(f"trainguard nodecheck: error: coordination store at {where} failed: {first}", file=sys.stderr)
        return EXIT_FAULTY
    if args.json:
        d = verdict.to_dict()
        d["measurements"] = {str(k): v for k, v in metrics.items()}
        print(json.dumps(d, indent=2))
    else:
        for line in format_verdict(verdict, metrics):
            print(line)
    return _exit_code(verdict, mine)
