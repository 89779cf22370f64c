"""The node check's message-size sweep (``trainguard nodecheck --sweep``), after nccl-tests:
all-reduce and all-gather of float32 from 8 bytes up to ``--sweep-max-mb``, doubling, with the
nccl-tests columns (size in bytes, count, type, time in us, algbw and busbw in GB/s).

Size is the bytes of the whole buffer (all-gather: its output, ``count`` elements from each of the
W ranks, as nccl-tests prints it); time is the median of one operation (the rest of the node check
uses medians too). A node's row per size is its slowest process's; the largest size's times
enter the verdict (the straggler rule), small sizes show latency, large ones bandwidth.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

MIN_BYTES = 8
OPS = ("all_reduce", "all_gather")


def algbw_busbw(op: str, nbytes: int, seconds: float, world: int) -> tuple[float, float]:
    """(algbw, busbw) in GB/s for one operation on ``nbytes`` that took ``seconds`` (nccl-tests:
    all-reduce busbw = algbw * 2 (W-1) / W, all-gather busbw = algbw * (W-1) / W)."""
    if seconds <= 0:
        return 0.0, 0.0
    alg = nbytes / seconds / 1e9
    factor = {"all_reduce": 2 * (world - 1) / world, "all_gather": (world - 1) / world}[op]
    return alg, alg * factor


def sweep_sizes(max_bytes: int, min_bytes: int = MIN_BYTES) -> list[int]:
    """min_bytes, 2*min_bytes, ... up to max_bytes (at least the first size)."""
    sizes = [min_bytes]
    while sizes[-1] * 2 <= max_bytes:
        sizes.append(sizes[-1] * 2)
    return sizes


def op_count(op: str, size: int, world: int) -> tuple[int, int]:
    """(count, bytes): elements per rank and the buffer's real size for a nominal ``size`` of
    float32 (all-gather: a multiple of 4*world, at least one element from each rank)."""
    if op == "all_gather":
        count = max(1, size // 4 // world)
        return count, count * 4 * world
    count = max(1, size // 4)
    return count, count * 4


def table_row(op: str, nbytes: int, count: int, seconds: float, world: int) -> dict[str, Any]:
    alg, bus = algbw_busbw(op, nbytes, seconds, world)
    return {"size": nbytes, "count": count, "type": "float", "time_us": seconds * 1e6, "algbw": alg, "busbw": bus}


def slowest_rows(tables: list[list[dict[str, Any]]], op: str, world: int) -> list[dict[str, Any]]:
    """The node's table: per size, the slowest process's time (its bandwidths recomputed)."""
    rows = []
    for same_size in zip(*tables, strict=True):
        t = max(r["time_us"] for r in same_size) / 1e6
        r0 = same_size[0]
        rows.append(table_row(op, r0["size"], r0["count"], t, world))
    return rows


def format_table(title: str, rows: list[dict[str, Any]]) -> list[str]:
    lines = [title, f"{'size':>12} {'count':>12} {'type':>6} {'time':>10} {'algbw':>8} {'busbw':>8}",
             f"{'(B)':>12} {'(elements)':>12} {'':>6} {'(us)':>10} {'(GB/s)':>8} {'(GB/s)':>8}"]  # fmt: skip
    for r in rows:
        lines.append(f"{r['size']:>12} {r['count']:>12} {r['type']:>6} {r['time_us']:>10.1f} "
                     f"{r['algbw']:>8.3f} {r['busbw']:>8.3f}")  # fmt: skip
    return lines


def node_sweep(per_process: list[dict[str, Any]], world: int) -> dict[str, list[dict[str, Any]]]:
    """The node's sweep tables per op (slowest process per size)."""
    return {op: slowest_rows([p["sweep"][op] for p in per_process], op, world) for op in OPS}


def largest_times(sweep: dict[str, list[dict[str, Any]]]) -> tuple[float, float]:
    """(all-reduce s, all-gather s) at the largest size: what the verdict judges."""
    return sweep["all_reduce"][-1]["time_us"] / 1e6, sweep["all_gather"][-1]["time_us"] / 1e6


def format_sweep(who: str, sweep: dict[str, list[dict[str, Any]]], world: int) -> list[str]:
    """A table per op; ``who`` names the node and its group ("nodecheck node 1 group [0, 1]")."""
    lines = []
    for op in OPS:
        lines += format_table(f"{who} sweep {op} (world {world}, slowest process per size):", sweep[op])
        last = sweep[op][-1]
        lines.append(f"{who} sweep {op}: busbw {last['busbw']:.3f} GB/s at {last['size']} B (verdict)")
    return lines


# ------------------------------------------------------------------------------ measuring (torch)


def run_sweep(dev: Any, world: int, max_bytes: int, timed: Callable[[Callable[[], None]], float]) -> dict[str, Any]:
    """Each op at each size; ``timed(fn)`` gives the median seconds of one call of ``fn``."""
    import torch
    import torch.distributed as dist

    out: dict[str, list[dict[str, Any]]] = {op: [] for op in OPS}
    for size in sweep_sizes(max_bytes):
        count, nbytes = op_count("all_reduce", size, world)
        x = torch.ones(count, device=dev, dtype=torch.float32)
        dist.barrier()
        out["all_reduce"].append(table_row("all_reduce", nbytes, count, timed(lambda x=x: dist.all_reduce(x)), world))
        count, nbytes = op_count("all_gather", size, world)
        chunk = torch.ones(count, device=dev, dtype=torch.float32)
        parts = [torch.empty_like(chunk) for _ in range(world)]
        dist.barrier()
        t = timed(lambda parts=parts, chunk=chunk: dist.all_gather(parts, chunk))
        out["all_gather"].append(table_row("all_gather", nbytes, count, t, world))
    return {"sweep": out, "sweep_max_bytes": max_bytes}

