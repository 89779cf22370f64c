"""Effective training time under chaos: one job for N minutes on three network-namespace
nodes (the fault matrix's test bed, chaos/testbed.py) under a seeded random fault schedule, run
twice with the same training script, model, schedule and seed:

  trainguard  `trainguard run` with its defaults (+ --max-restarts, which torchrun gets too), the
              checkpoint API every step (in-memory snapshots, persisted in the background)
  torchrun    what users do today: torchrun in a restart loop (a Python loop per node, as a shell
              `while true` would), `torch.save` every N steps (N so that its stall is 5 % of the
              step time, both measured at start), resuming from the latest file; gloo's timeouts,
              the process group's set by --timeout (stated: a rank hung on SIGSTOP ends there)

Faults (soak_accounting.KINDS): worker SIGKILL, SIGSTOP, sleep before the all-reduce, node kill,
network cut of a node, a straggler (a CPU load for STRAGGLER_S), the checkpoint dir's disk full
for DISK_FULL_S, and a node coming back. Injected with `trainguard chaos`'s code into the targets
of each run (trainguard's found from its run dir, torchrun's from its process tree).

Prints ETTR (steps trained × median healthy step time / wall time, soak_accounting.py says how),
its breakdown and every fault's outcome per run; writes a Chrome/Perfetto trace, a CSV of the step
rate and, where matplotlib is installed, a PNG plot. Exits 1 when a run made no step for --wedge-s
(that run is stopped). Everything it starts (namespaces, processes, mounts) is removed on exit and
on Ctrl-C.

    python bench/soak.py --minutes 20                       # root: network namespaces
    python bench/soak.py --minutes 3 --mean-interval-s 30 --tools trainguard
    python bench/soak.py --tools trainguard,trainguard-standby,torchrun   # + a row with a warm standby

The trainguard-standby row adds a fourth node started with `--standby` (it joins once the round of
three formed and takes a lost node's place, so the world stays 3); a fault the schedule names for a
node that is the spare by then hits the node holding its place (_in_place_of).
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import json
import math
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))
sys.path.insert(0, str(REPO / "bench"))

from soak_accounting import KINDS, Breakdown, Fault, Step, account, healthy_step, schedule  # noqa: E402

from trainguard.chaos import testbed  # noqa: E402
from trainguard.chaos.cli import ChaosError, add_arguments, inject_into  # noqa: E402
from trainguard.chaos.targets import Target, TargetError, nodes, resolve  # noqa: E402
from trainguard.probes import identity  # noqa: E402

EXAMPLE = REPO / "examples" / "train_mlp.py"
STEP = re.compile(r"\bstep=(\d+) rank=0 t=([\d.]+) .*\bworld=(\d+)")
RESUME = re.compile(r"\bresume step=\d+")
STRAGGLER_S, STRAGGLER_PCT = 60.0, 90.0
DISK_FULL_S = 30.0
BACK_S = 120.0  # a node back whose agent is still leaving: its agent is started when it has left, within this
LASTING_S = {"straggler": STRAGGLER_S, "disk-full": DISK_FULL_S}  # a stall that begins meanwhile is theirs
TOOLS = ("trainguard", "torchrun")
# Not a default row: trainguard with one warm standby node (a fourth namespace, `--standby`), which
# keeps the world at 3 nodes while one is down (the default row's largest loss is the shrunk world).
STANDBY_TOOL = "trainguard-standby"
NAMED = ("n1", "n2", "n3")  # the nodes the schedule names (soak_accounting.NODES)
SPARE_AFTER_S = 10.0  # standby row: a named node without workers this long into a fault's retries is the spare
STOP = threading.Event()  # Ctrl-C / SIGTERM: every run stops and cleans up


@dataclass
class Launcher:
    """One node's launcher (trainguard run, or torchrun in its restart loop)."""

    name: str
    cmd: list[str]
    env: dict[str, str]
    log: Path
    lines: list[tuple[float, str]]  # the run's (arrival time, line) of step and resume lines
    lock: threading.Lock
    proc: subprocess.Popen | None = None
    up: bool = True  # False while the node is "down" (killed): no restart loop brings it back
    back_until: float = 0.0  # the node came back: its launcher is started when it is not running
    starts: int = 0

    def start(self) -> None:
        self.starts += 1
        with open(self.log, "ab") as f:
            f.write(f"--- start {self.starts} at {time.time():.3f}\n".encode())
        self.proc = subprocess.Popen(self.cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=self.env,
                                     start_new_session=True)  # fmt: skip
        threading.Thread(target=self._read, args=(self.proc,), daemon=True).start()

    def _read(self, proc: subprocess.Popen) -> None:
        with open(self.log, "ab") as f:
            for raw in proc.stdout:  # type: ignore[union-attr]
                f.write(raw)
                line = raw.decode(errors="replace")
                if "step=" in line:
                    with self.lock:
                        self.lines.append((time.time(), line))

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self) -> None:
        self.up = False
        if self.proc is None:
            return
        procs = _tree(self.proc.pid)
        for p in procs:
            with contextlib.suppress(psutil.Error):
                p.terminate()
        _, alive = psutil.wait_procs(procs, timeout=15)
        for p in alive:
            with contextlib.suppress(psutil.Error):
                p.kill()
        psutil.wait_procs(alive, timeout=15)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=15)


def _tree(pid: int) -> list[psutil.Process]:
    try:
        p = psutil.Process(pid)
        return [p, *p.children(recursive=True)]
    except psutil.Error:
        return []


@dataclass
class Run:
    tool: str
    args: argparse.Namespace
    work: Path
    faults: list[Fault]
    ckpt_every: int = 1
    lines: list[tuple[float, str]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)
    launchers: dict[str, Launcher] = field(default_factory=dict)
    holders: dict[str, int] = field(default_factory=dict)  # node -> pid of its net-cut's holder
    shm: dict[str, Path] = field(default_factory=dict)  # node -> its own tmpfs dir for snapshots
    done: list[tuple[Fault, float, str]] = field(default_factory=list)  # (fault, injected at, note)
    hit: dict[str, str] = field(default_factory=dict)  # standby row: a node fault's named node -> the node it hit
    t0: float = 0.0
    t_end: float = 0.0
    wedged: str = ""

    @property
    def guarded(self) -> bool:
        return self.tool != "torchrun"

    @property
    def standby(self) -> int:
        return 1 if self.tool == STANDBY_TOOL else 0

    @property
    def run_dir(self) -> Path:
        return self.work / "run"

    @property
    def ckpt(self) -> Path:
        return self.work / "ckpt"

    def flag(self, node: str) -> Path:
        return self.work / "flags" / f"hang-{node}"


def _command(run: Run, node: testbed.Node, store: str) -> list[str]:
    name = f"n{node.index}"
    job = [str(EXAMPLE), "--steps", "100000000", "--step-time-ms", str(run.args.step_time_ms), "--hidden",
           str(run.args.hidden), "--hang-file", str(run.flag(name))]  # fmt: skip
    common = ["--nnodes", "2:3", "--nproc-per-node", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", store,
              "--rdzv-id", "soak", "--max-restarts", str(run.args.max_restarts)]  # fmt: skip
    if run.guarded:
        spare = ["--standby"] if node.index > len(NAMED) else []
        return [*node.exec_prefix(), sys.executable, "-m", "trainguard", "run", *common, "--run-dir", str(run.run_dir),
                "--node-name", name, "--ckpt-dir", str(run.ckpt), "--ckpt-shm-dir", str(run.shm[name]), *spare,
                *job, "--ckpt", "trainguard", "--ckpt-every", "1"]  # fmt: skip
    # torchrun decides whether it hosts the c10d store, and which address its workers' store has,
    # by its host name, which a namespace's address is not: it is told (trainguard finds out itself).
    host = ["--rdzv-conf", f"is_host={'true' if node.index == 1 else 'false'}", "--local-addr", node.addr]
    return [*node.exec_prefix(), sys.executable, "-m", "torch.distributed.run", *common, *host, *job, "--ckpt", "torch",
            "--ckpt-every", str(run.ckpt_every), "--ckpt-dir", str(run.ckpt), "--timeout-s", str(run.args.timeout)]  # fmt: skip


def _chaos(run: Run, t: Target, fault: str, *extra: str) -> dict:
    p = argparse.ArgumentParser()
    add_arguments(p)
    return inject_into(t, run.run_dir, p.parse_args([str(run.run_dir), fault, "--node", t.node, *extra]))


def _target(run: Run, node: str, worker: bool) -> Target:
    """The node's agent and worker: trainguard's from its run dir (identity-checked), torchrun's
    from the launcher's process tree (the worker: the child running the training script)."""
    if run.guarded:
        t = resolve(run.run_dir, node=node)
        if not worker:
            return t
        rank = min(t.workers)
        return Target(node, rank, {rank: t.workers[rank]}, t.agent)
    launcher = run.launchers[node]
    if not launcher.running():
        raise TargetError(f"torchrun on {node} is not running")
    agent = launcher.proc.pid  # type: ignore[union-attr]  (`ip netns exec` execs torchrun)
    for p in _tree(agent)[1:]:
        with contextlib.suppress(psutil.Error):
            if p.status() != psutil.STATUS_ZOMBIE and str(EXAMPLE) in p.cmdline():
                rank = int(p.environ().get("RANK", "-1"))
                return Target(node, rank if worker else None, {rank: p.pid}, agent)
    raise TargetError(f"no live worker on {node}")


def _in_place_of(run: Run, node: str, late: bool) -> str:
    """The node that holds ``node``'s place in the job. Without a standby, ``node``. With one, the
    schedule's node may be the spare by now (it was lost, a standby took its place, and it came back
    as the new standby): a fault named for it hits the training node the schedule does not name
    (the promoted standby), so that both trainguard rows see the same faults acting on training.
    A node between two attempts trains nothing for a moment too: only ``late`` (after SPARE_AFTER_S
    of retries) is a node without workers taken for the spare."""
    if not run.standby:
        return node
    training = set()
    for name, state in nodes(run.run_dir).items():
        if state.pids and identity.why_not(state.identity, state.pids) is None:
            training.add(name)
    if node in training:
        return node
    if not late:
        raise TargetError(f"{node} trains nothing now (restarting, or the spare)")
    return next(iter(sorted(training - set(NAMED))), node)


def _node_back(run: Run, node: str) -> str:
    node = run.hit.pop(node, node)  # the standby row: the node its loss hit
    holder = run.holders.pop(node, None)
    if holder is not None:  # the cut's holder reverts it (link up) on SIGTERM
        with contextlib.suppress(psutil.Error):
            p = psutil.Process(holder)
            p.terminate()
            psutil.wait_procs([p], timeout=30)
    launcher = run.launchers[node]
    launcher.up = True
    if launcher.running():  # still in the job, or still giving up: started again once it ends
        launcher.back_until = time.time() + BACK_S
        return ("link up; " if holder else "") + "its launcher was still running"
    launcher.start()
    return ("link up; " if holder else "") + "launcher started again"


def _inject(run: Run, f: Fault, late: bool = False) -> str:
    if f.kind == "node-back":
        return _node_back(run, f.node)
    # the checkpoint disk is every node's: a fill named for a node that trains nothing now (back
    # from a cut, waiting beside a full round) is done from one that trains (soak 2026-11-29: skipped)
    node = _in_place_of(run, f.node, late or f.kind == "disk-full")
    instead = f" (in {f.node}'s place)" if node != f.node else ""
    if f.kind == "sleep-hang":
        run.flag(node).touch()
        return "hang file placed" + instead
    worker = f.kind in ("worker-kill", "sigstop", "straggler")
    t = _target(run, node, worker)
    if f.kind == "worker-kill":
        d = _chaos(run, t, "kill", "--what", "worker")
    elif f.kind == "sigstop":
        d = _chaos(run, t, "stop")
    elif f.kind == "straggler":
        d = _chaos(run, t, "slow", "--percent", f"{STRAGGLER_PCT:g}", "--duration", f"{STRAGGLER_S:g}")
    elif f.kind == "disk-full":
        d = _chaos(
            run, t, "fill-disk", "--path", str(run.ckpt), "--duration", f"{DISK_FULL_S:g}", "--size-mb", "64"
        )
    elif f.kind == "node-kill":
        run.launchers[node].up = False  # no restart loop brings a dead node back
        d = _chaos(run, t, "kill", "--what", "node")
    else:  # net-cut, held until the node comes back (bounded by the run's length)
        d = _chaos(run, t, "net-cut", "--duration", f"{run.args.minutes * 60 + 120:g}")
        run.holders[node] = d["holder"]
    if f.kind in ("node-kill", "net-cut"):
        run.hit[f.node] = node
    if f.kind == "disk-full":
        return "the checkpoint disk (a 48 MB tmpfs) filled"
    if "pids" in d and not d["pids"]:  # chaos skips a pid that is gone: say so, not "done"
        raise TargetError(f"no process signalled: {f.node}'s pids {sorted(t.workers.values())} are gone")
    return (f"rank {t.rank} on {node}" if t.rank is not None else f"{node}'s processes {d.get('pids', '')}".strip()) + instead


def _inject_retrying(run: Run, f: Fault) -> tuple[float, str]:
    """A target may be between two workers (a restart): try again for a while, then skip. Returns
    when the attempt that landed began (wall clock) and what it did: a fault retargeted after
    SPARE_AFTER_S of retries lands that much after it was due, and its stall is matched to the
    time it landed (soak 2026-11-29: a SIGSTOP 10 s late had its stall counted as a false kill)."""
    start = time.monotonic()
    end = start + 15
    while True:
        tried = time.time()
        try:
            return tried, _inject(run, f, late=time.monotonic() > start + SPARE_AFTER_S)
        except (TargetError, ChaosError, psutil.Error, OSError) as exc:
            if time.monotonic() > end or STOP.is_set():
                return tried, f"skipped: {exc}"
            time.sleep(0.5)


def _progress(run: Run) -> tuple[int, float]:
    """The highest step rank 0 printed, and when it arrived."""
    best, when = 0, run.t0
    with run.lock:
        for t, line in run.lines:
            m = STEP.search(line)
            if m and int(m[1]) > best:
                best, when = int(m[1]), t
    return best, when


def _supervise(run: Run, deadline: float) -> None:
    """Inject the faults when due; keep torchrun's restart loops going; stop at a wedge."""
    pending = list(run.faults)
    seen, last_new, checked = 0, run.t0, 0.0
    while time.time() < deadline and not STOP.is_set():
        now = time.time()
        while pending and now >= run.t0 + pending[0].at:
            f = pending.pop(0)
            run.done.append((f, *_inject_retrying(run, f)))
        for la in run.launchers.values():  # torchrun's restart loops; a node back whose agent was leaving
            if la.up and not la.running() and (not run.guarded or now < la.back_until):
                la.back_until = 0.0
                la.start()
        if now - checked > 5:
            checked = now
            best, when = _progress(run)
            if best > seen:
                seen, last_new = best, when
            if now - last_new > run.args.wedge_s:
                run.wedged = f"no new step for {now - last_new:.0f} s (last step {seen})"
                return
        time.sleep(0.5)


def execute(run: Run) -> Run:
    if STOP.is_set():  # interrupted before this run's turn
        run.t0 = run.t_end = time.time()
        return run
    run.work.mkdir(parents=True)
    run.ckpt.mkdir()
    (run.work / "flags").mkdir()
    # The checkpoint dir on a small disk of its own: disk-full never fills the machine's.
    subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=48m", f"tgsoak-{run.tool}", str(run.ckpt)], check=True
    )
    bed = None
    try:
        bed = testbed.Testbed(len(NAMED) + run.standby)
        store = f"{bed.nodes[0].addr}:29400"
        for node in bed.nodes:
            name = f"n{node.index}"
            # Each node's own tmpfs for snapshots, as real nodes have (bench/faults.py says why).
            run.shm[name] = Path(tempfile.mkdtemp(prefix=f"tgsoak-{run.tool}-{name}-", dir="/dev/shm"))
            env = {**os.environ, "GLOO_SOCKET_IFNAME": node.ifname}
            if (
                run.tool == "torchrun"
            ):  # the workaround torchrun needs to restart a gloo job (bench/recovery.py)
                env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
            run.launchers[name] = Launcher(
                name, _command(run, node, store), env, run.work / f"{name}.out", run.lines, run.lock
            )
        run.t0 = time.time()
        for la in run.launchers.values():
            la.start()
            if la.name == "n1":
                time.sleep(1.0)  # n1 hosts the rendezvous store: let it bind first
        _supervise(run, run.t0 + run.args.minutes * 60)
        run.t_end = time.time()
    finally:
        run.t_end = run.t_end or time.time()
        _cleanup(run, bed)
    return run


def _cleanup(run: Run, bed: testbed.Testbed | None) -> None:
    for la in run.launchers.values():
        la.stop()
    for node in list(run.holders):
        with contextlib.suppress(psutil.Error):
            psutil.Process(run.holders.pop(node)).terminate()
    # Chaos holders (straggler load, disk fill) revert on SIGTERM; each is bounded anyway.
    for p in psutil.process_iter(["cmdline"]):
        with contextlib.suppress(psutil.Error, TypeError):
            if "trainguard.chaos.background" in " ".join(p.info["cmdline"]) and str(run.run_dir) in " ".join(
                p.info["cmdline"]
            ):
                p.terminate()
    time.sleep(1.0)
    subprocess.run(["umount", "-l", str(run.ckpt)], capture_output=True, check=False)
    if bed is not None:
        bed.close()
    for shm in run.shm.values():
        shutil.rmtree(shm, ignore_errors=True)


@dataclass
class Result:
    run: Run
    steps: list[Step]
    h: float
    bd: Breakdown
    outcomes: list[str]


def analyse(run: Run) -> Result:
    steps, restarts = [], []
    with run.lock:
        lines = list(run.lines)
    for when, line in lines:
        if m := STEP.search(line):
            steps.append(Step(float(m[2]), int(m[1]), int(m[3])))
        elif RESUME.search(line):
            restarts.append(when)
    steps.sort(key=lambda s: s.t)
    h = healthy_step(steps, 3)
    injected = [
        (at, at + LASTING_S.get(f.kind, 0.0)) for f, at, note in run.done if not note.startswith("skipped")
    ]
    bd = account(run.t0, run.t_end, steps, sorted(restarts), injected, h)
    return Result(run, steps, h, bd, [_outcome(run, f, at, note, steps, bd, h) for f, at, note in run.done])


def _outcome(run: Run, f: Fault, at: float, note: str, steps: list[Step], bd: Breakdown, h: float) -> str:
    head = f"{f.at:7.1f}s {f.kind:<11} {f.node}  "
    if note.startswith("skipped"):
        return head + note
    stall = next(((a, b) for a, b, cause in bd.stalls if cause == "fault" and a - 2.0 <= at <= b), None)
    earlier = [g for g, g_at, _ in run.done if stall and g_at < at and g_at >= stall[0] - 2.0]
    if earlier:  # the job was down already
        return head + f"during the stall after the {earlier[0].kind} at {earlier[0].at:.1f}s ({note})"
    before = max((s.step for s in steps if s.t <= at), default=0)
    after = [s for s in steps if s.t > at]
    if not after:
        return head + f"no step after it ({note})"
    world = after[-1].world
    if stall is None:
        window = [s.t for s in after if s.t <= at + 30]
        gaps = [b - a for a, b in zip(window, window[1:], strict=False)]
        slow = statistics.median(gaps) / h if gaps and h else 0.0
        return head + f"no stall; steps x{slow:.2f} the healthy time in the next 30 s ({note})"
    resumed = next((s for s in after if s.t >= stall[1]), None)
    redone = max(0, before - resumed.step + 1) if resumed else 0
    again = next((s.t for s in after if s.step > before), None)
    trained = f"training new steps {again - at:.1f} s after" if again else "no new step after it"
    world = resumed.world if resumed else world
    return (
        head + f"stall {stall[1] - stall[0]:.1f} s; {trained}; {redone} steps redone; world {world} ({note})"
    )


def report(res: Result) -> None:
    bd, run = res.bd, res.run
    print(f"\n== {run.tool}: ETTR {bd.ettr:.3f}  ({bd.steps} new steps x {res.h * 1000:.1f} ms healthy step "
          f"/ {bd.wall:.0f} s wall){'  WEDGED: ' + run.wedged if run.wedged else ''}")  # fmt: skip
    for name, secs in bd.parts().items():
        print(f"   {name:<13} {secs:8.1f} s  {secs / bd.wall * 100 if bd.wall else 0:5.1f} %")
    print(f"   {'(sum)':<13} {sum(bd.parts().values()):8.1f} s  = wall {bd.wall:.1f} s")
    print("   faults:")
    for line in res.outcomes:
        print(f"   {line}")


def _rates(res: Result, bin_s: float = 5.0) -> list[tuple[float, float]]:
    """New steps per second in bins of ``bin_s`` from the run's start."""
    n = max(1, math.ceil(res.bd.wall / bin_s))
    counts = [0] * n
    best = 0
    for s in res.steps:
        if s.step > best:
            best = s.step
            i = int((s.t - res.run.t0) / bin_s)
            if 0 <= i < n:
                counts[i] += 1
    return [(i * bin_s, c / bin_s) for i, c in enumerate(counts)]


def write_outputs(results: list[Result], out: Path) -> list[str]:
    out.mkdir(parents=True, exist_ok=True)
    events: list[dict] = []
    with open(out / "soak-rate.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["tool", "t_s", "steps_per_s"])
        for pid, res in enumerate(results, 1):
            t0 = res.run.t0
            events.append({"ph": "M", "name": "process_name", "pid": pid, "args": {"name": res.run.tool}})
            for t, rate in _rates(res):
                w.writerow([res.run.tool, f"{t:g}", f"{rate:.2f}"])
                events.append(
                    {"ph": "C", "name": "steps/s", "pid": pid, "ts": t * 1e6, "args": {"steps/s": rate}}
                )
            for a, b, cause in res.bd.stalls:
                events.append({"ph": "X", "name": f"stall ({cause})", "pid": pid, "tid": 1, "ts": (a - t0) * 1e6,
                               "dur": (b - a) * 1e6})  # fmt: skip
            for fault, at, note in res.run.done:
                events.append({"ph": "i", "s": "p", "name": f"{fault.kind} {fault.node}", "pid": pid, "tid": 1,
                               "ts": (at - t0) * 1e6, "args": {"note": note}})  # fmt: skip
    (out / "soak-trace.json").write_text(json.dumps({"traceEvents": events}))
    written = [str(out / "soak-trace.json"), str(out / "soak-rate.csv")]
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no PNG plot (the trace and the CSV have the same data)")
        return written
    fig, axes = plt.subplots(len(results), 1, figsize=(12, 3.2 * len(results)), sharex=True, squeeze=False)
    for ax, res in zip(axes[:, 0], results, strict=True):
        xs, ys = zip(*_rates(res), strict=True) if res.steps else ((0,), (0,))
        ax.step(xs, ys, where="post")
        for fault, at, _ in res.run.done:
            ax.axvline(at - res.run.t0, color="red", alpha=0.4)
            ax.text(at - res.run.t0, ax.get_ylim()[1] * 0.9, fault.kind, rotation=90, fontsize=7, va="top")
        ax.set_title(f"{res.run.tool}: ETTR {res.bd.ettr:.3f}")
        ax.set_ylabel("new steps/s")
    axes[-1, 0].set_xlabel("seconds since launch")
    fig.tight_layout()
    fig.savefig(out / "soak.png", dpi=100)
    return [*written, str(out / "soak.png")]


def _ckpt_every(args: argparse.Namespace, work: Path) -> int:
    """torch.save every N steps, N so that its stall is 5 % of the step time, both measured here at
    start: the save of the job's model + optimizer (median of 10), the step as one process trains it
    (padded, without the all-reduce: a lower bound, so N errs towards saving less often)."""
    import torch

    sys.path.insert(0, str(EXAMPLE.parent))
    import train_mlp

    model = train_mlp.MLP(args.hidden, args.step_time_ms / 1000)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    saves, stepping = [], []
    for i in range(10):
        x = torch.randn(32, 16)
        t = time.perf_counter()
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), x.sum(1, keepdim=True)).backward()
        opt.step()
        stepping.append(time.perf_counter() - t)
        t = time.perf_counter()
        train_mlp.save_torch(work / "probe.pt", model, opt, i)
        saves.append(time.perf_counter() - t)
    save, step = statistics.median(saves), statistics.median(stepping)
    n = max(1, math.ceil(save / (0.05 * step)))
    print(
        f"torchrun row: torch.save {save * 1000:.1f} ms, step {step * 1000:.1f} ms -> torch.save every {n} steps"
    )
    return n


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--minutes", type=float, default=20.0)
    p.add_argument(
        "--seed", type=int, default=8, help="default 8: the first seed whose 20 min draw every kind of fault"
    )
    p.add_argument(
        "--mean-interval-s", type=float, default=120.0, help="mean time between faults (default 120)"
    )
    p.add_argument("--kinds", default=",".join(KINDS),
                   help=f"draw only these faults (default: all of {','.join(KINDS)}); to look at one kind's cost alone")
    p.add_argument("--timeout", type=float, default=120.0,
                   help="torchrun row: the process group's timeout in s (default 120; gloo's own is 1800)")  # fmt: skip
    p.add_argument("--wedge-s", type=float, default=300.0, help="a run with no new step this long is wedged")
    p.add_argument("--tools", default=",".join(TOOLS),
                   help=f"rows, from {', '.join((*TOOLS, STANDBY_TOOL))} (default: {','.join(TOOLS)})")
    p.add_argument(
        "--parallel",
        action="store_true",
        help="run the rows side by side (default: one after the other, undisturbed)",
    )
    p.add_argument("--step-time-ms", type=float, default=100.0)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument(
        "--max-restarts", type=int, default=100, help="both rows (torchrun's and trainguard's default: 0)"
    )
    p.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "soak")
    p.add_argument("--work", type=Path, default=None,
                   help="keep the runs' dirs (run dir, logs) here, a new directory (default: a temp dir, removed)")
    args = p.parse_args()
    tools = [t for t in args.tools.split(",") if t]
    if why := testbed.available() or ([t for t in tools if t not in (*TOOLS, STANDBY_TOOL)] and f"unknown tools {tools}"):
        print(f"soak.py: error: {why}", file=sys.stderr)
        return 2
    kinds = tuple(k for k in args.kinds.split(",") if k)
    if not kinds or set(kinds) - set(KINDS):
        print(f"soak.py: error: --kinds: give some of {', '.join(KINDS)}", file=sys.stderr)
        return 2
    if args.minutes <= 0 or args.mean_interval_s <= 0 or args.timeout <= 0:
        print("soak.py: error: --minutes, --mean-interval-s and --timeout must be positive", file=sys.stderr)
        return 2
    if args.work is not None:
        try:
            args.work.mkdir(parents=True)
        except OSError as exc:
            print(f"soak.py: error: --work {args.work}: {exc.strerror or exc} (give a new directory)", file=sys.stderr)
            return 2
    faults = schedule(args.seed, args.minutes, args.mean_interval_s, kinds)
    print(f"soak: {args.minutes:g} min, seed {args.seed}, one fault per {args.mean_interval_s:g} s on average: "
          f"{len(faults)} faults; rows {', '.join(tools)} {'side by side' if args.parallel else 'one after the other'}; "
          f"torchrun's process group timeout {args.timeout:g} s; wedged after {args.wedge_s:g} s without a step")  # fmt: skip
    for f in faults:
        print(f"  {f.at:7.1f}s {f.kind:<11} {f.node}")
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    keep = args.work is not None
    with contextlib.nullcontext(str(args.work)) if keep else tempfile.TemporaryDirectory(prefix="tgsoak-") as tmp:
        work = Path(tmp)
        every = _ckpt_every(args, work) if "torchrun" in tools else 1
        runs = [Run(t, args, work / t, faults, ckpt_every=every) for t in tools]
        with ThreadPoolExecutor(max_workers=len(runs) if args.parallel else 1) as pool:
            futures = [pool.submit(execute, r) for r in runs]
            try:
                while not all(f.done() for f in futures):
                    time.sleep(0.5)
            except KeyboardInterrupt:
                STOP.set()
                print("soak: interrupted; stopping the runs and cleaning up", file=sys.stderr)
            results = [analyse(f.result()) for f in futures]
    for res in results:
        report(res)
    print()
    for res in results:
        print(f"{res.run.tool:<18} ETTR {res.bd.ettr:.3f}  new steps {res.bd.steps}  healthy step {res.h * 1000:.1f} ms"
              f"  wall {res.bd.wall:.0f} s{'  WEDGED' if res.run.wedged else ''}")  # fmt: skip
    print("wrote " + ", ".join(write_outputs(results, args.out)))
    return 1 if STOP.is_set() or any(r.run.wedged for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
