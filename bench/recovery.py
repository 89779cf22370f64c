"""Recovery after a worker SIGKILL, and cold start: trainguard vs torchrun, measured in the same run.

Recovery: SIGKILL rank 1 while the job trains, then time from the kill to the first step completed
after the restart (the worker's own `t=` stamp). Kills follow a schedule of delays after the
previous recovery (its first step): settled kills (5 s after), and back-to-back ones 0.5 s and 2 s
after — failures cluster, and a kill soon after a restart is the one that finds spares unready.

Cold start (--cold N): launch -> first completed step, N launches of each tool, alternating.

Several nodes (--nodes N): N launchers on loopback, one worker each, a c10d rendezvous hosted by
the first; rank 1 (on the second node) is killed and rank 0's steps are timed. A worker failure
on one node is then a restart of every node's workers through a new rendezvous round.

torchrun runs with the workaround it needs to restart a gloo job at all
(TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: without it the restarted ranks read the dead rank's stale
address from the reused store and hang).

    python bench/recovery.py --kills 10 --cold 5
    python bench/recovery.py --kills 10 --tools trainguard --prestart spawn   # spawned spares instead of the zygote
    python bench/recovery.py --kills 8 --nodes 3                              # three nodes on loopback
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import socket
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
SCHEDULE = (5.0, 0.5, 5.0, 2.0)  # seconds after the previous recovery, cycled
TOOLS = ("torchrun", "trainguard")


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
    """torchrun's live worker process of `rank` (its environment's RANK): a direct child of the
    agent (a worker's own children inherit RANK too)."""
    deadline = time.time() + 120
    while time.time() < deadline:
        try:
            return _worker_pid(launcher, rank, exclude)
        except LookupError:
            time.sleep(0.05)  # between a stop and the restart
    raise LookupError(f"no live worker of rank {rank}")


def _worker_pid(launcher: psutil.Process, rank: int, exclude: set[int]) -> int:
    for p in launcher.children(recursive=False):
        try:
            if p.pid in exclude:
                continue
            env = p.environ()
            if env.get("RANK") == str(rank) and "train_mlp.py" in " ".join(p.cmdline()):
                return p.pid
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    raise LookupError


def trainguard_pids(run_dir: Path, attempt: int, rank: str = "1") -> dict[str, int]:
    """The workers of ``attempt`` (every node's, merged), once the node of ``rank`` started its own."""
    from trainguard.events.store import read_all

    deadline = time.time() + 120
    while time.time() < deadline:
        pids = {r: int(p) for e in read_all(run_dir, kinds=["job_started"]) if e.evidence.get("attempt") == attempt
                for r, p in e.evidence["pids"].items()}  # fmt: skip
        if rank in pids:
            return pids
        time.sleep(0.05)
    raise LookupError(f"no worker of rank {rank} in attempt {attempt}")


def command(name: str, workdir: Path, steps: int, restarts: int, prestart: str, node: int = 1, nodes: int = 1,
            port: int = 0) -> tuple[list[str], dict[str, str], Path]:
    """One launcher: the only one (``nodes`` 1, standalone), or node ``node`` of ``nodes`` on loopback."""
    job = [str(EXAMPLE), "--steps", str(steps), "--step-time-ms", "50", "--ckpt-every", "5",
           "--ckpt-dir", str(workdir / f"ckpt-{name}")]  # fmt: skip
    env = dict(os.environ)
    run_dir = workdir / f"run-{name}"
    if nodes == 1:
        where = ["--standalone", "--nproc-per-node", "2"]
    else:
        where = ["--nnodes", str(nodes), "--nproc-per-node", "1", "--rdzv-backend", "c10d",
                 "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", f"bench-recovery-{name}",
                 "--rdzv-conf", f"is_host={'true' if node == 1 else 'false'}",
                 *(["--local-addr", "127.0.0.1"] if name == "torchrun" else ["--node-name", f"n{node}"])]  # fmt: skip
    if name == "torchrun":
        env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
        cmd = [sys.executable, "-m", "torch.distributed.run", *where, "--max-restarts", str(restarts), *job]
    else:
        # --restart-loop-attempts 0: back-to-back kills before a new snapshot are, to the guard, a
        # restart loop (the same signal, no step passed); this bench makes them on purpose.
        cmd = [sys.executable, "-m", "trainguard", "run", *where, "--max-restarts", str(restarts),
               "--restart-loop-attempts", "0", "--run-dir", str(run_dir), "--prestart-workers", prestart, *job]  # fmt: skip
    return cmd, env, run_dir


def stop(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        pass
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


# ---- memory ------------------------------------------------------------------------------------
def _rollup(pid: int) -> dict[str, int]:
    """kB values of /proc/PID/smaps_rollup (Rss, Pss, Private_Dirty ...)."""
    out = {}
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                parts = line.split()
                if len(parts) >= 3 and parts[-1] == "kB":
                    out[parts[0].rstrip(":")] = int(parts[1])
    except OSError:
        pass
    return out


def memory_report(launcher: psutil.Process, workers: set[int]) -> str:
    """RSS/PSS of the zygote, the spares (forked or spawned) and the workers, MB."""
    rows: dict[str, list[dict[str, int]]] = {"zygote": [], "spares": [], "workers": []}
    for p in launcher.children(recursive=True):
        try:
            cmd = " ".join(p.cmdline())
        except psutil.Error:
            continue
        if p.pid in workers:
            rows["workers"].append(_rollup(p.pid))
        elif "--zygote" in cmd and p.ppid() == launcher.pid:
            rows["zygote"].append(_rollup(p.pid))
        elif "worker_main" in cmd:
            rows["spares"].append(_rollup(p.pid))
    parts = []
    for what, rs in rows.items():
        if rs:
            rss = sum(r.get("Rss", 0) for r in rs) / 1024
            pss = sum(r.get("Pss", 0) for r in rs) / 1024
            parts.append(f"{what} x{len(rs)}: RSS {rss:.0f} MB, PSS {pss:.0f} MB")
    return "; ".join(parts)


# ---- recovery ----------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as sk:
        sk.bind(("127.0.0.1", 0))
        return sk.getsockname()[1]


def measure_recovery(name: str, kills: int, workdir: Path, prestart: str, nodes: int = 1) -> list[tuple[float, float]]:
    """(delay after the previous recovery, kill -> first step) per kill."""
    port = free_port()
    procs = []
    try:
        for node in range(1, nodes + 1):
            cmd, env, run_dir = command(name, workdir, 1_000_000, kills, prestart, node, nodes, port)
            out = subprocess.PIPE if node == 1 else subprocess.DEVNULL  # rank 0's steps are timed
            procs.append(subprocess.Popen(cmd, stdout=out, stderr=subprocess.DEVNULL, env=env, start_new_session=True))
        out = Output(procs[0])
        # rank 1: on the second node, or beside rank 0 on the only one
        launcher = psutil.Process(procs[1 if nodes > 1 else 0].pid)
        times: list[tuple[float, float]] = []
        dead: set[int] = set()
        pos, m = out.wait(lambda ln: STEP.search(ln), 0)
        recovered = time.time()
        for k in range(kills):
            delay = SCHEDULE[k % len(SCHEDULE)]
            if name == "trainguard":
                pids = trainguard_pids(run_dir, k)
                pid = pids["1"]
                if k == 0:
                    time.sleep(3.0)  # spares settle; the memory they take is what a job pays
                    print(f"  {name:<10} memory: {memory_report(launcher, set(pids.values()))}", flush=True)
            else:
                pid = worker_pid(launcher, 1, dead)
            time.sleep(max(0.0, recovered + delay - time.time()))
            dead.add(pid)
            t_kill = time.time()
            os.kill(pid, signal.SIGKILL)
            pos, _ = out.wait(lambda ln: "resume step=" in ln, pos + 1)  # the restarted job, not a step in flight
            pos, m = out.wait(lambda ln, t=t_kill: (mm := STEP.search(ln)) and float(mm.group(3)) > t and mm, pos + 1)
            recovered = float(m.group(3))  # type: ignore[union-attr]
            times.append((delay, recovered - t_kill))
            print(f"  {name:<10} kill {k + 1:>2} ({delay:>3.1f} s after the previous recovery): "
                  f"first step {times[-1][1]:.2f} s after SIGKILL", flush=True)  # fmt: skip
    finally:
        for proc in procs:
            stop(proc)
    return times


# ---- cold start --------------------------------------------------------------------------------
def measure_cold(name: str, workdir: Path, prestart: str, i: int) -> float:
    d = workdir / f"cold-{name}-{i}"
    d.mkdir()
    cmd, env, _ = command(name, d, 3, 0, prestart)
    t0 = time.time()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env, start_new_session=True)
    out = Output(proc)
    try:
        _, m = out.wait(lambda ln: STEP.search(ln), 0)
        return float(m.group(3)) - t0  # type: ignore[union-attr]
    finally:
        stop(proc)


def summary(label: str, results: dict[str, list[float]]) -> None:
    print(f"\n{label}")
    for k, v in results.items():
        print(f"  {k:<10} median {statistics.median(v):6.2f} s   max {max(v):6.2f} s   (all: {', '.join(f'{x:.2f}' for x in v)})")
    if len(results) == 2:
        tg, tr = statistics.median(results["trainguard"]), statistics.median(results["torchrun"])
        print(f"  ratio trainguard/torchrun: median {tg / tr:.2f}, max {max(results['trainguard']) / tr:.2f} of torchrun's median")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kills", type=int, default=10, help="kills per tool (0: no recovery measurement)")
    ap.add_argument("--cold", type=int, default=0, help="cold starts per tool (alternating)")
    ap.add_argument("--tools", default=",".join(TOOLS), help="comma-separated: torchrun,trainguard")
    ap.add_argument("--nodes", type=int, default=1, help="launchers (nodes) on loopback, one worker each (default 1: "
                    "one launcher, two workers)")
    ap.add_argument("--prestart", default="on", choices=["on", "spawn", "off"], help="trainguard's --prestart-workers")
    args = ap.parse_args()
    tools = [t for t in args.tools.split(",") if t]
    print(f"load average at start: {os.getloadavg()[0]:.2f} ({os.cpu_count()} CPUs)", flush=True)
    with tempfile.TemporaryDirectory(prefix="tg-bench-recovery-") as d:
        cold: dict[str, list[float]] = {t: [] for t in tools}
        for i in range(args.cold):
            for t in tools if i % 2 == 0 else tools[::-1]:
                cold[t].append(measure_cold(t, Path(d), args.prestart, i))
                print(f"  {t:<10} cold start {i + 1}: first step {cold[t][-1]:.2f} s after launch", flush=True)
        rec = {t: measure_recovery(t, args.kills, Path(d), args.prestart, args.nodes) for t in tools} if args.kills else {}
    if rec:
        summary(f"SIGKILL of rank 1 -> first completed step after restart, {args.kills} kills "
                f"(delays after the previous recovery {', '.join(f'{s:g}' for s in SCHEDULE)} s, cycled; "
                f"{'2 workers' if args.nodes == 1 else f'{args.nodes} nodes on loopback, one worker each'}, gloo, CPU)",
                {t: [x for _, x in v] for t, v in rec.items()})  # fmt: skip
        for t, v in rec.items():
            b2b = [x for delay, x in v if delay < 5.0]
            if b2b:
                print(f"  {t:<10} back-to-back kills only: median {statistics.median(b2b):.2f} s, max {max(b2b):.2f} s")
    if args.cold:
        summary(f"launch -> first completed step, {args.cold} cold starts each", cold)
    print(f"load average at end: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
