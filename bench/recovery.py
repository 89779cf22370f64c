"""Recovery time after a worker SIGKILL: trainguard vs torchrun, measured in the same run.

For each of N kills: SIGKILL rank 1 while the job trains, then time from the kill to the first
step completed after the restart (the worker's own `t=` stamp). torchrun runs with the workaround
it needs to restart a gloo job at all (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: without it the
restarted ranks read the dead rank's stale address from the reused store and hang).

    python bench/recovery.py --kills 5
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "train_mlp.py"
STEP = re.compile(r"step=(\d+) rank=(\d+) t=([\d.]+)")


class Output:
    """Lines of a launcher's stdout with arrival order, read on a thread."""

    def __init__(self, proc: subprocess.Popen) -> None:
        self.lines: list[str] = []
        self.cond = threading.Condition()
        threading.Thread(target=self._read, args=(proc,), daemon=True).start()

    def _read(self, proc: subprocess.Popen) -> None:
        for raw in proc.stdout:  # type: ignore[union-attr]
            with self.cond:
                self.lines.append(raw.decode(errors="replace"))
                self.cond.notify_all()

    def wait(self, pred, start: int, timeout: float = 120) -> tuple[int, re.Match | str]:
        end = time.monotonic() + timeout
        i = start
        with self.cond:
            while True:
                while i < len(self.lines):
                    got = pred(self.lines[i])
                    if got:
                        return i, got
                    i += 1
                left = end - time.monotonic()
                if left <= 0:
                    raise TimeoutError("no matching output line")
                self.cond.wait(left)


def worker_pid(launcher: psutil.Process, rank: int, exclude: set[int]) -> int:
    """The live process whose output says it is `rank` (env RANK, or trainguard's pid events)."""
    for p in launcher.children(recursive=True):
        try:
            if p.pid in exclude:
                continue
            env = p.environ()
            if env.get("RANK") == str(rank) and "train_mlp.py" in " ".join(p.cmdline()):
                return p.pid
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    raise LookupError


def trainguard_pid(run_dir: Path, rank: int, attempt: int) -> int:
    from trainguard.events.store import read_all

    for e in read_all(run_dir, kinds=["job_started"]):
        if e.evidence.get("attempt") == attempt:
            return int(e.evidence["pids"][str(rank)])
    raise LookupError


def measure(name: str, kills: int, workdir: Path) -> list[float]:
    steps = 100000
    job = [str(EXAMPLE), "--steps", str(steps), "--step-time-ms", "50", "--ckpt-every", "5",
           "--ckpt-dir", str(workdir / f"ckpt-{name}")]
    env = dict(os.environ)
    run_dir = workdir / f"run-{name}"
    if name == "torchrun":
        env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               "--max-restarts", str(kills), *job]
    else:
        cmd = [sys.executable, "-m", "trainguard", "run", "--standalone", "--nproc-per-node", "2",
               "--max-restarts", str(kills), "--run-dir", str(run_dir), *job]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env, start_new_session=True)
    out = Output(proc)
    launcher = psutil.Process(proc.pid)
    times = []
    try:
        pos, dead = 0, set()
        pos, _ = out.wait(lambda ln: "resume step=" in ln, pos)
        for k in range(kills):
            # let the (re)started job train a little first
            for _ in range(8):
                pos, _ = out.wait(lambda ln: STEP.search(ln), pos + 1)
            pid = trainguard_pid(run_dir, 1, k) if name == "trainguard" else worker_pid(launcher, 1, dead)
            dead.add(pid)
            t_kill = time.time()
            os.kill(pid, signal.SIGKILL)
            pos, _ = out.wait(lambda ln: "resume step=" in ln, pos + 1)
            pos, m = out.wait(lambda ln, t=t_kill: (mm := STEP.search(ln)) and float(mm.group(3)) > t and mm, pos + 1)
            times.append(float(m.group(3)) - t_kill)  # type: ignore[union-attr]
            print(f"  {name:<10} kill {k + 1}: first step {times[-1]:.2f} s after SIGKILL", flush=True)
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kills", type=int, default=5)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="tg-bench-recovery-") as d:
        results = {name: measure(name, args.kills, Path(d)) for name in ("torchrun", "trainguard")}
    med = {k: statistics.median(v) for k, v in results.items()}
    print(f"\nSIGKILL of rank 1 -> first completed step after restart, median of {args.kills} kills (2 workers, gloo, CPU)")
    for k, v in med.items():
        print(f"  {k:<10} {v:6.2f} s   (all: {', '.join(f'{x:.2f}' for x in results[k])})")
    print(f"  ratio trainguard/torchrun: {med['trainguard'] / med['torchrun']:.2f}")


if __name__ == "__main__":
    main()
