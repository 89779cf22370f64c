"""Scan throughput of `trainguard diagnose` on >= 1 GB of multi-rank logs (generated in a temp dir).

    python bench/diagnose.py [--gb 1.0] [--ranks 8] [--repeat 3]

Prints the median wall time and MB/s of diagnose_paths (single-threaded: MB/s is per core, CPU
seconds are shown too), the same for the pure-`re` prefilter on a slice, and the peer measured in
the same run on the same files: GNU `grep -F -c -f <the rules' keywords>`. Goal: >= 200 MB/s per
core. The temp dir is removed at the end, whatever happens.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from trainguard.diagnose import diagnose_paths
from trainguard.diagnose.prefilter import _hs
from trainguard.diagnose.rules import builtin_rules


def _block(rank: int, start_step: int, n: int) -> bytes:
    """n steps of realistic per-rank output: step lines, Megatron-style lines, some NCCL INFO chatter."""
    out = []
    t = 1763717400.0 + start_step * 1.2
    for i in range(n):
        s = start_step + i
        ts = f"2026-11-21T{9 + s // 3000 % 12:02d}:{s // 50 % 60:02d}:{s % 60:02d}.{(s * 7919) % 1000000:06d}"
        out.append(
            f"{ts} [rank{rank}]: step={s} rank={rank} t={t + i * 1.2:.3f} loss={2.5 - (s % 1000) / 1e4:.4f} lr=2.9e-04 grad_norm=0.{s % 97:02d}"
        )
        out.append(
            f"{ts} [rank{rank}]:  iteration {s:>8}/  500000 | consumed samples: {s * 512:>10} | elapsed time per iteration (ms): 1201.{s % 10} | learning rate: 2.999E-04 | global batch size:   512 | lm loss: 2.4{s % 10}E+00 | loss scale: 1.0 |"
        )
        if s % 50 == 0:
            out.append(
                f"{ts} [rank{rank}]: node-{rank // 4}:{4000 + rank}:{4100 + rank} [{rank % 4}] NCCL INFO comm 0x5581 rank {rank} nranks 8 cudaDev {rank % 4} busId 3b000 - Init COMPLETE"
            )
        if s % 200 == 0:
            out.append(
                f"{ts} [rank{rank}]: [2026-11-21 09:30:01,123] [INFO] [logging.py:96:log_dist] [Rank {rank}] step={s}, skipped=0, lr=[0.00029], mom=[(0.9, 0.95)]"
            )
    return ("\n".join(out) + "\n").encode()


def generate(root: Path, gb: float, ranks: int) -> int:
    per_rank = int(gb * 1e9 / ranks) + 1
    total = 0
    for r in range(ranks):
        path = root / f"rank-{r}.log"
        written, step = 0, 1
        with open(path, "wb") as f:
            while written < per_rank:
                b = _block(r, step, 2000)
                f.write(b)
                written += len(b)
                step += 2000
            if r == 5:
                f.write(
                    b"2026-11-21T21:59:59.000001 [rank5]: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.50 GiB.\n"
                )
            else:
                f.write(
                    f"2026-11-21T22:09:59.000001 [rank{r}]: [Rank {r}] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=9, OpType=ALLREDUCE) ran for 600088 milliseconds before timing out.\n".encode()
                )
        total += path.stat().st_size
    return total


def timed(fn, repeat: int) -> tuple[float, float, object]:
    walls, cpus, out = [], [], None
    for _ in range(repeat):
        w0, c0 = time.perf_counter(), time.process_time()
        out = fn()
        walls.append(time.perf_counter() - w0)
        cpus.append(time.process_time() - c0)
    return statistics.median(walls), statistics.median(cpus), out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gb", type=float, default=1.0)
    ap.add_argument("--ranks", type=int, default=8)
    ap.add_argument("--repeat", type=int, default=3)
    a = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="tg-bench-diagnose-"))
    try:
        t0 = time.perf_counter()
        size = generate(root, a.gb, a.ranks)
        mb = size / 1e6
        print(f"generated {mb:.0f} MB in {a.ranks} rank logs ({time.perf_counter() - t0:.1f} s) under {root}")
        diagnose_paths([root / "rank-0.log"])  # warm: rules compiled, files in the page cache
        wall, cpu, res = timed(lambda: diagnose_paths([root]), a.repeat)
        assert res["category"] == "cuda_oom" and res["first_failure"]["rank"] == 5, res["summary"]
        engine = res["stats"]["prefilter"]
        print(f"trainguard diagnose ({engine} prefilter): median {wall:.2f} s wall, {cpu:.2f} s CPU -> "
              f"{mb / wall:.0f} MB/s wall, {mb / cpu:.0f} MB/s per core   [verdict: {res['category']} rank 5]")  # fmt: skip
        if engine != "re":
            part = sorted(root.glob("rank-*.log"))[:1]
            pmb = sum(p.stat().st_size for p in part) / 1e6
            w2, c2, _ = timed(lambda: diagnose_paths(part, engine="re"), 1)
            print(
                f"  same, pure-re prefilter (no hyperscan) on {pmb:.0f} MB: {pmb / w2:.0f} MB/s wall, {pmb / c2:.0f} MB/s per core"
            )
        elif _hs is None:
            print("  (hyperscan not installed: pip install 'trainguard[fast]' for the fast prefilter)")
        kw = root / "keywords.txt"
        kw.write_text("\n".join(builtin_rules().keywords()) + "\n")
        files = [str(p) for p in sorted(root.glob("rank-*.log"))]
        if shutil.which("grep"):
            # stdout to a pipe, not /dev/null: GNU grep treats output to /dev/null like -q and stops at the
            # first match, which would time where the first keyword sits rather than the scan
            gw, _, _ = timed(lambda: subprocess.run(["grep", "-F", "-c", "-f", str(kw), *files], capture_output=True,
                                                    env={**os.environ, "LC_ALL": "C"}), a.repeat)  # fmt: skip
            print(f"peer: GNU grep -F -c -f keywords (same files): median {gw:.2f} s -> {mb / gw:.0f} MB/s")
            print(f"ratio trainguard/grep throughput: {gw / wall:.2f}")
        goal = mb / cpu >= 200
        print(f"goal >= 200 MB/s per core: {'met' if goal else 'NOT met'}")
        return 0
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
