"""The node check's sustained load test (``trainguard nodecheck --burn SECONDS``), after gpu-burn:
every benchmark process multiplies the same two matrices for SECONDS and compares each result with
its first one, element by element (a GPU that computes a wrong value is faulty even when it is
fast). Results are also compared across the node's processes by a checksum of the first result
(same seed, same inputs: the same device model computes the same matrix).

Per process it reports GFLOP/s per step over time; a drop from the first fifth to the last fifth
of the run shows throttling (heat, power cap) that a short check does not reach.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Any

THROTTLE_DROP = 0.10  # the last fifth at least 10 % below the first fifth: throttling
CHECKSUM_RTOL = 1e-3  # across processes: the same inputs on the same kind of device


@dataclass(frozen=True)
class Throttle:
    first_gflops: float
    last_gflops: float

    @property
    def drop(self) -> float:
        """Fraction of the first fifth's rate lost by the last fifth (negative: it sped up)."""
        return 1 - self.last_gflops / self.first_gflops if self.first_gflops > 0 else 0.0

    @property
    def throttled(self) -> bool:
        return self.drop >= THROTTLE_DROP


def throttle(step_s: list[float], gflop_per_step: float) -> Throttle:
    """GFLOP/s of the first and of the last fifth of the steps (``step_s``: seconds of each step,
    in time order; fewer than 5 steps: the first and the last). Work over time, not a median of
    rates: stalls count, as they do in training."""
    if not step_s:
        return Throttle(0.0, 0.0)
    fifth = max(1, len(step_s) // 5)

    def rate(steps: list[float]) -> float:
        return len(steps) * gflop_per_step / sum(steps) if sum(steps) > 0 else 0.0

    return Throttle(rate(step_s[:fifth]), rate(step_s[-fifth:]))


def checksum_outliers(checksums: list[float], rtol: float = CHECKSUM_RTOL) -> list[int]:
    """Indices of the checksums that differ from the majority value by more than ``rtol``
    (relative). The reference is the median: one bad device among several is named, not its
    healthy partners; with two that disagree, both are named (nobody can tell which one is right)."""
    if len(checksums) < 2:
        return []
    ref = statistics.median(checksums)
    if len(checksums) == 2:
        a, b = checksums
        return [] if _close(a, b, rtol) else [0, 1]
    return [i for i, c in enumerate(checksums) if not _close(c, ref, rtol)]


def _close(a: float, b: float, rtol: float) -> bool:
    return abs(a - b) <= rtol * max(abs(a), abs(b), 1e-30)


def burn_fault(per_process: list[dict[str, Any]]) -> str:
    """Why the node is faulty after its burn ("" when it is not): a process that found a wrong
    element, a process that reported no burn, or a checksum that disagrees with the others."""
    why = []
    for i, p in enumerate(per_process):
        if "burn_wrong" not in p:
            why.append(f"process {i} reported no burn result")
        elif p["burn_wrong"]:
            why.append(f"process {i} ({p.get('device')}): {p['burn_wrong']} wrong element(s) "
                       f"in {p['burn_iters']} matmuls")  # fmt: skip
    sums = [p.get("burn_checksum", 0.0) for p in per_process]
    for i in checksum_outliers(sums):
        why.append(f"process {i} ({per_process[i].get('device')}): result checksum {sums[i]:.6g} "
                   f"disagrees with the node's other processes")  # fmt: skip
    return "burn: " + "; ".join(why) if why else ""


def node_burn(per_process: list[dict[str, Any]]) -> dict[str, Any]:
    """The node's burn summary: the slowest process's sustained rate is the node's."""
    procs = []
    for p in per_process:
        t = throttle(p.get("burn_step_s", []), p.get("burn_gflop_per_step", 0.0))
        procs.append({"device": p.get("device"), "sustained_gflops": p.get("burn_sustained_gflops", 0.0),
                      "first_gflops": t.first_gflops, "last_gflops": t.last_gflops, "drop": t.drop,
                      "throttled": t.throttled, "wrong": p.get("burn_wrong"), "iters": p.get("burn_iters"),
                      "seconds": p.get("burn_seconds")})  # fmt: skip
    slowest = min(procs, key=lambda d: d["sustained_gflops"])
    return {"sustained_gflops": slowest["sustained_gflops"], "fault": burn_fault(per_process), "processes": procs}


def format_burn(who: str, burn: dict[str, Any]) -> list[str]:
    """One line per process; ``who`` names the node and its group ("nodecheck node 1 group [0, 1]")."""
    lines = []
    for i, p in enumerate(burn["processes"]):
        mark = " THROTTLED" if p["throttled"] else ""
        lines.append(f"{who} burn process {i} ({p['device']}): {p['iters']} matmuls in "
                     f"{p['seconds']:.1f} s, sustained {p['sustained_gflops']:.1f} GFLOP/s, first fifth "
                     f"{p['first_gflops']:.1f}, last fifth {p['last_gflops']:.1f} ({-p['drop']:+.0%}){mark}, "
                     f"wrong elements {p['wrong']}")  # fmt: skip
    return lines


# ------------------------------------------------------------------------------ the load (torch)


def run_burn(dev: Any, seconds: float, n: int, corrupt: bool = False) -> dict[str, Any]:
    """Multiply two fixed matrices on ``dev`` for ``seconds``; count result elements that differ
    from the first result. ``corrupt`` (chaos only) changes one element of one result."""
    import torch

    use_cuda = dev.type == "cuda"
    dtype = torch.float16 if use_cuda else torch.float32
    gen = torch.Generator().manual_seed(1234)  # the same inputs in every process: comparable checksums
    # Inputs in [0, 1): every element of the product is positive and about n/4 (fits fp16).
    a = torch.rand(n, n, generator=gen).to(dev, dtype)
    b = torch.rand(n, n, generator=gen).to(dev, dtype)
    ref = torch.matmul(a, b)
    checksum = float(ref.double().sum())
    batch = 10 if use_cuda else 1  # matmuls per timed step (a step syncs the device once)
    wrong = torch.zeros((), dtype=torch.int64, device=dev)
    steps: list[float] = []
    iters, t_start = 0, time.perf_counter()
    while time.perf_counter() - t_start < seconds:
        t0 = time.perf_counter()
        for _ in range(batch):
            c = torch.matmul(a, b)
            if corrupt and iters == 1:
                c[0, 0] += 1
            wrong += torch.ne(c, ref).sum()
            iters += 1
        if use_cuda:
            torch.cuda.synchronize(dev)
        steps.append(time.perf_counter() - t0)
    elapsed = time.perf_counter() - t_start
    return {"burn_n": n, "burn_iters": iters, "burn_seconds": elapsed, "burn_step_s": steps,
            "burn_gflop_per_step": batch * 2 * n**3 / 1e9,
            "burn_sustained_gflops": iters * 2 * n**3 / elapsed / 1e9 if elapsed > 0 else 0.0,
            "burn_wrong": int(wrong), "burn_checksum": checksum}  # fmt: skip
