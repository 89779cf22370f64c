"""Training stall of ``trainguard.checkpoint.save`` vs a synchronous ``torch.save`` of the same state.

    python bench/checkpoint.py [--state-mb 128] [--every 5] [--pairs 4] [--repeats 4] [--json FILE]
                               [--replication-rounds 4] [--replication-only] [--train-threads N]

One process trains an MLP with Adam on CPU (``--device cuda``: on the GPU; model + optimizer state
of about --state-mb MB) and
checkpoints with each backend in turn, rounds interleaved so that machine noise hits all alike:

- torch.save:  ``torch.save(state, tmp); os.replace(tmp, path)`` on the training thread;
- trainguard:  ``trainguard.checkpoint.save(state, step)`` as it runs by default (the copy into
               shared memory inside the call), with the checkpoint monitor persisting in a separate
               process, as the agent does under ``trainguard run``;
- tg overlap:  the same with ``overlap=True`` (``--ckpt-overlap``): the CPU copy runs on an
               idle-priority helper thread during the next forward/backward (the optimizer step
               waits for it).

Paired measurement, robust to the drift of a shared machine: each save is preceded by a control
window of --every steps without one and followed by the steps until its checkpoint is on disk (at
least --every); the stall of that save is the time the call blocked plus what those steps took
beyond the control window's pace: what the copy, an overlapped copy waited for, and the
background persist competing for CPU and disk cost the training. The time from the save until the
checkpoint is on disk (the persist latency) and the agent's CPU time for it are recorded too.
Medians over all pairs.

That timed stall needs the after-window (as long as the idle-priority persist takes: over a hundred
steps here) priced against a short control window; on a shared 2-core VM its noise (printed: the
interquartile range, over a second) is a hundred times the effect. So the same saves are also
accounted, which is low-noise: the call, + the time the training thread waited to finish an
overlapped copy (``Checkpointer.finish_wait_s``), + the CPU the persist and the copy helper took
from the training threads, read as their run-queue wait (/proc/<tid>/schedstat) beyond the control
window's per step. Memory-bandwidth contention is not in the accounted figure.

It prints, per backend, the stall per save and the ratio to torch.save; the steps lost per
failure when each backend may spend 5 % of the training time on checkpoints; and at this run's
save interval the steps lost when a process fails (the in-memory snapshot survives) and when the
node is lost (only what the agent had persisted: the persist latency adds to it). Then buddy
replication (``--ckpt-replicas``): the bytes it sends per step, the CPU its sending and receiving
take per snapshot, and the median step time with and without it, in rounds of the same run
ordered off, on, on, off, ... (one sender process, started and stopped between rounds), and the
steps lost with it when the node is lost (a snapshot's lag until its buddy holds it, instead of
the persist latency); ``--replication-only`` measures just that (a shorter run). Last, the copy
floor: the state's bytes copied once into shared memory, alone; on a machine whose training keeps
every core and the memory bus busy, no snapshot that copies the state stalls less than that.

``--train-threads N`` gives the training N intra-op threads (torch.set_num_threads) instead of one
per core: fewer than the cores leaves CPU to the agent's threads, as on a GPU node whose training
process mostly waits for its GPU (the default keeps every core busy, the worst case for the
agent's background work).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

TG = "trainguard"
OVERLAP = "tg overlap"
BACKENDS = ("torch.save", TG, OVERLAP)


def agent_main(run_dir: str, ckpt_dir: str, shm_root: str) -> None:
    """Stand-in agent: the checkpoint monitor in its own process until stdin closes."""
    from trainguard.monitors.checkpoint import CheckpointMonitor

    mon = CheckpointMonitor(ckpt_dir=ckpt_dir, keep=2, shm_root=shm_root)
    print(json.dumps(mon.worker_env(Path(run_dir))), flush=True)
    sys.stdin.read()
    mon.close()


def replicate_main(shm_dir: str, buddy_root: str) -> None:
    """Stand-in for the agent's replication: a Replicator sending the snapshots in ``shm_dir``
    (at the agent's background priority) to a ReplicaServer on loopback. Commands on stdin, each
    answered "ok": "on" starts the sender, "off" stops it (after the transfer in flight: its cost
    stays in the "on" rounds); at EOF its stats as JSON. The buddy receives on this machine too (on
    a job it is another node's agent): the cost measured here includes the receiving side's CPU, a
    pessimistic figure."""
    from trainguard.checkpoint.replica import Buddy, ReplicaServer, Replicator

    key = os.urandom(32)
    server = ReplicaServer(Path(buddy_root), "127.0.0.1", key)
    rep = Replicator(Path(shm_dir), "bench", key, lambda *a, **k: None)
    rep.set_buddies([Buddy("buddy", server.addr, server.port)])
    cpu0 = sum(os.times()[:2])
    print("ready", flush=True)
    for line in sys.stdin:
        if line.strip() == "on":
            rep.start()
        else:
            rep.stop()
        print("ok", flush=True)
    rep.stop()
    server.close()
    out = rep.stats.to_json()
    out["cpu_s"] = sum(os.times()[:2]) - cpu0  # sender and receiver together: a low-noise measure of the work
    print(json.dumps(out), flush=True)


def replication_cost(rounds: int, steps: int, every: int, model, opt, step_fn, ckpt, shm_root: Path,
                     step: int) -> tuple[dict, int]:
    """Step times (the save steps included) with buddy replication off and on, in rounds of
    ``steps`` steps saving every ``every``, ordered off, on, on, off, ... (drift on a shared
    machine hits both alike): what replicating costs training, same run."""
    times: dict[str, list[float]] = {"off": [], "on": []}
    cpu = {"off": 0.0, "on": 0.0}  # the training process's own CPU seconds (cache and memory-bus contention show here)
    buddy = Path(tempfile.mkdtemp(prefix="tg-bench-buddy-", dir=shm_root))
    rep = subprocess.Popen([sys.executable, __file__, "--replicate", str(ckpt.shm_dir), str(buddy)],
                           stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert rep.stdin is not None and rep.stdout is not None and rep.stdout.readline().strip() == "ready"
    for r in range(2 * rounds):
        mode = ("off", "on", "on", "off")[r % 4]
        rep.stdin.write(mode + "\n")
        rep.stdin.flush()
        assert rep.stdout.readline().strip() == "ok"
        cpu0 = sum(os.times()[:2])
        for _ in range(steps):
            t0 = time.perf_counter()
            step_fn()
            step += 1
            if step % every == 0:
                ckpt.save({"model": model.state_dict(), "optim": opt.state_dict(), "step": step}, step)
            times[mode].append(time.perf_counter() - t0)
        cpu[mode] += sum(os.times()[:2]) - cpu0
    out, _ = rep.communicate(timeout=300)
    st = json.loads(out.strip().splitlines()[-1])
    snaps = max(1, st["snapshots"])
    off, on = statistics.median(times["off"]), statistics.median(times["on"])
    return {"step_off_ms": off * 1e3, "step_on_ms": on * 1e3, "ratio": on / off,
            "iqr_off_ms": _iqr(times["off"]) * 1e3, "iqr_on_ms": _iqr(times["on"]) * 1e3,
            "bytes_per_step": st["bytes"] / (rounds * steps), "bytes_per_snapshot": st["bytes"] / snaps,
            "cpu_ms_per_snapshot": 1e3 * st["cpu_s"] / snaps, "train_cpu_ratio": cpu["on"] / max(cpu["off"], 1e-9),
            "lag_s": st["median_lag_s"], "every": every, "rounds": rounds, "steps": steps}, step


def print_replication(rep: dict, step_s: float) -> None:
    print(f"\nbuddy replication (--ckpt-replicas 1), saving every {rep['every']} steps, {rep['rounds']} rounds of "
          f"{rep['steps']} steps each way (off, on, on, off, ...):")
    print(f"  bytes sent per step: {rep['bytes_per_step'] / 1e6:.1f} MB ({rep['bytes_per_snapshot'] / 1e6:.1f} MB per snapshot); "
          f"CPU of sending and receiving: {rep['cpu_ms_per_snapshot']:.1f} ms per snapshot")
    print(f"  median step (save steps included): without {rep['step_off_ms']:.1f} ms (IQR {rep['iqr_off_ms']:.1f}), "
          f"with {rep['step_on_ms']:.1f} ms (IQR {rep['iqr_on_ms']:.1f}): ratio {rep['ratio']:.3f} (goal <= 1.05)")
    print(f"  the training process's own CPU time, with / without: {rep['train_cpu_ratio']:.3f} (what sharing the caches "
          "and the memory bus costs it; the CPU the replication takes from it on a full machine is not in it)")
    if rep["lag_s"] is not None:
        lag = rep["lag_s"] / step_s
        every = rep["every"]
        rep["lag_steps"] = lag
        print(f"  node lost, with replication: {every / 2 + lag:.1f}, {every + math.ceil(lag)} steps (average, worst): "
              f"a snapshot is at its buddy {lag:.1f} steps after its save, median; saving every step: <= {1 + math.ceil(lag)}")


def build(state_mb: float, device: str = "cpu"):
    import torch
    from torch import nn

    # Adam keeps two moments per parameter: state bytes ~= 3 x 4 bytes x params.
    width = 1024
    layers = max(1, round(state_mb * 1e6 / (12 * width * width)))
    torch.manual_seed(0)
    model = nn.Sequential(*[m for _ in range(layers) for m in (nn.Linear(width, width), nn.ReLU())]).to(device)
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    x = torch.randn(32, width, device=device)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        model(x).square().mean().backward()
        opt.step()
        sync()  # a step ends when the GPU is done with it: the stall is then training time lost

    step()  # creates the optimizer state
    return model, opt, step


def state_bytes(state) -> int:
    return sum(t.numel() * t.element_size() for t in _tensors(state))


def _tensors(state) -> list:
    """The tensors ``save`` copies, as it finds them."""
    from trainguard.checkpoint.format import flatten

    return flatten(state)[1]


def window(step_fn, n: int) -> list[float]:
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        step_fn()
        times.append(time.perf_counter() - t0)
    return times


def runq_wait_s() -> float:
    """Seconds this process's training threads (the main thread, torch's intra-op pool) waited
    for a CPU while runnable (/proc/<tid>/schedstat): the CPU that other work took from training,
    the persist and the copy helper included. trainguard's own threads (the idle-priority copy
    helper waits by design) are left out."""
    own = {t.native_id for t in threading.enumerate() if t.name.startswith("trainguard-")}
    total = 0
    for tid in os.listdir("/proc/self/task"):
        if int(tid) in own:
            continue
        try:
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                total += int(f.read().split()[1])
        except (OSError, ValueError, IndexError):  # a thread that ended meanwhile
            continue
    return total / 1e9


def copy_floor_s(state, shm_root: Path, repeats: int = 9) -> float:
    """The state's bytes copied once into a prefaulted shared-memory buffer with torch's parallel
    copy (as ``save`` copies), median of ``repeats``: the memory bandwidth's floor under the stall
    of any snapshot that copies the state on this machine, whichever thread or process copies."""
    import mmap

    import torch

    srcs = [t.detach().reshape(-1).view(torch.uint8) for t in _tensors(state)]
    total = sum(t.numel() for t in srcs)
    path = shm_root / "copy-floor"
    with open(path, "w+b") as f:
        f.truncate(total)
        mm = mmap.mmap(f.fileno(), total)
    try:
        dst = torch.frombuffer(mm, dtype=torch.uint8)
        dst.fill_(0)  # fault the pages in: a slot is reused from the second save on
        times = []
        for _ in range(repeats):
            t0, off = time.perf_counter(), 0
            for t in srcs:
                dst[off : off + t.numel()].copy_(t)
                off += t.numel()
            times.append(time.perf_counter() - t0)
        del dst
        return statistics.median(times)
    finally:
        mm.close()
        path.unlink()


def cpu_seconds(pid: int) -> float:
    import psutil

    t = psutil.Process(pid).cpu_times()
    return t.user + t.system


def run(backend: str, pairs: int, every: int, model, opt, step_fn, ckpt, torch_path: Path, ckpt_dir: Path,
        step: int, agent_pid: int) -> tuple[dict[str, list[float]], int]:
    """``pairs`` x (control window, save, window after it, wait for the disk). Returns per pair the
    control window's step times, the save call, the extra time of the window after it, and (for
    trainguard) the seconds from the save until the checkpoint was on disk and the CPU seconds the
    agent spent persisting it (a low-noise measure of what the persist costs)."""
    import torch

    from trainguard.checkpoint import disk

    out: dict[str, list[float]] = {"steps": [], "call": [], "extra": [], "persist": [], "agent_cpu": [],
                                   "waited": [], "taken": []}  # fmt: skip
    for _ in range(pairs):
        cpu0 = cpu_seconds(agent_pid)
        q0 = runq_wait_s()
        control = window(step_fn, every)
        q_control = runq_wait_s() - q0
        step += every
        state = {"model": model.state_dict(), "optim": opt.state_dict(), "step": step}
        t0 = time.perf_counter()
        if backend == "torch.save":
            tmp = torch_path.with_suffix(".tmp")
            torch.save(state, tmp)
            os.replace(tmp, torch_path)
        else:
            ckpt.save(state, step, overlap=backend == OVERLAP)
        call = time.perf_counter() - t0
        q1, waited0 = runq_wait_s(), ckpt.finish_wait_s
        after = window(step_fn, every)
        if backend != "torch.save":
            # Train on until the checkpoint is on disk: all of the persist's cost counts.
            while step not in disk.list_steps(ckpt_dir, 0):
                if time.perf_counter() - t0 > 600:
                    raise SystemExit(f"bench: step {step} was not persisted within 600 s")
                after.extend(window(step_fn, 1))
            out["persist"].append(time.perf_counter() - t0)
            out["agent_cpu"].append(cpu_seconds(agent_pid) - cpu0)
        step += len(after)
        out["steps"].extend(control)
        out["call"].append(call)
        out["extra"].append(sum(after) - len(after) * sum(control) / len(control))
        # What the save cost the training threads after the call, accounted rather than timed:
        # the time the optimizer step waited for an overlapped copy, and the CPU the persist (and
        # the helper) took from them beyond the control window's run-queue wait per step.
        out["waited"].append(ckpt.finish_wait_s - waited0)
        out["taken"].append(max(0.0, (runq_wait_s() - q1) - len(after) * q_control / len(control)))
    return out, step


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--state-mb", type=float, default=128)
    p.add_argument("--every", type=int, default=5, help="steps per window (a save every 2 windows)")
    p.add_argument("--pairs", type=int, default=4, help="saves per backend per round")
    p.add_argument("--repeats", type=int, default=4, help="interleaved rounds")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                   help="where the model and its Adam state live (cuda: the snapshot copies device to host)")
    p.add_argument("--dir", default=None, help="where checkpoints go (default: a temp dir on the current disk)")
    p.add_argument("--json", default=None, help="also write the numbers to this file")
    p.add_argument("--replication-rounds", type=int, default=4,
                   help="rounds each way (off, on) of the replication cost; 0: not measured")
    p.add_argument("--train-threads", type=int, default=0,
                   help="the training's intra-op threads (default: torch's, one per core)")
    p.add_argument("--replication-only", action="store_true",
                   help="measure only the replication cost (skips the backends' rounds: a bounded, quicker run)")
    p.add_argument("--agent", nargs=3, metavar=("RUN_DIR", "CKPT_DIR", "SHM_ROOT"), help=argparse.SUPPRESS)
    p.add_argument("--replicate", nargs=2, metavar=("SHM_DIR", "BUDDY_ROOT"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.agent:
        agent_main(*args.agent)
        return 0
    if args.replicate:
        replicate_main(*args.replicate)
        return 0

    import torch

    from trainguard.checkpoint import disk
    from trainguard.checkpoint.client import Checkpointer

    base = Path(tempfile.mkdtemp(prefix="tg-bench-ckpt-", dir=args.dir or "."))
    shm_root = Path(tempfile.mkdtemp(prefix="tg-bench-ckpt-", dir="/dev/shm" if Path("/dev/shm").is_dir() else None))
    agent = subprocess.Popen([sys.executable, __file__, "--agent", str(base / "run"), str(base / "ckpt"), str(shm_root)],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    ckpt = None
    try:
        env = json.loads(agent.stdout.readline())
        ckpt_dir = Path(env["TRAINGUARD_CKPT_DIR"])
        ckpt = Checkpointer(Path(env["TRAINGUARD_CKPT_SHM_DIR"]), ckpt_dir, 0, 1)
        if args.train_threads > 0:
            torch.set_num_threads(args.train_threads)
        model, opt, step_fn = build(args.state_mb, args.device)
        nbytes = state_bytes({"model": model.state_dict(), "optim": opt.state_dict()})
        print(f"state {nbytes / 1e6:.0f} MB (model + Adam), torch {torch.__version__}, "
              f"{torch.get_num_threads()} threads, checkpoints in {base}")
        step = 0
        if args.replication_only:
            for step in (1, 2, 3):  # warm-up: the first saves allocate the shm slots
                ckpt.save({"model": model.state_dict(), "optim": opt.state_dict(), "step": step}, step)
            step_s = statistics.median(window(step_fn, 20))
            rep, step = replication_cost(max(1, args.replication_rounds), 4 * args.every, 2 * args.every, model, opt,
                                         step_fn, ckpt, shm_root, step)
            print_replication(rep, step_s)
            if args.json:
                Path(args.json).write_text(json.dumps({"step_ms": step_s * 1e3, "replication": rep}, indent=1))
            return 0
        for b in BACKENDS:  # warm-up: first saves allocate the shm slots and the files
            _, step = run(b, 1, 2, model, opt, step_fn, ckpt, base / "torch.pt", ckpt_dir, step, agent.pid)
        got: dict[str, dict[str, list[float]]] = {b: {} for b in BACKENDS}
        for r in range(args.repeats):
            order = BACKENDS[r % 3 :] + BACKENDS[: r % 3]
            for b in order:
                out, step = run(b, args.pairs, args.every, model, opt, step_fn, ckpt, base / "torch.pt", ckpt_dir, step,
                                agent.pid)
                for k, v in out.items():
                    got[b].setdefault(k, []).extend(v)
        step_s = statistics.median(s for b in BACKENDS for s in got[b]["steps"])
        print(f"median step {step_s * 1e3:.1f} ms; {args.repeats} rounds x {args.pairs} saves per backend, "
              f"windows of {args.every} steps\n")
        print(f"{'backend':<11} {'save call':>10} {'+ after-window':>15} {'= stall':>9} {'ratio':>6}   "
              f"{'5 % budget: save every':>22} {'lost/failure':>13}")
        out = {"step_ms": step_s * 1e3, "every": args.every, "backends": {}, "raw": got}
        stall_ts = None
        for b in BACKENDS:
            call, extra = statistics.median(got[b]["call"]), statistics.median(got[b]["extra"])
            stall = call + extra
            stall_ts = stall_ts or stall
            # With 5 % of training time for checkpoints: save every N steps; a failure at a random
            # moment loses N/2 steps on average (worst case N).
            n = max(1, math.ceil(stall / (0.05 * step_s)))
            print(f"{b:<11} {call * 1e3:>7.1f} ms {extra * 1e3:>12.1f} ms {stall * 1e3:>6.1f} ms {stall / stall_ts:>6.3f}   "
                  f"{n:>22d} {n / 2:>6.1f} (max {n})")
            out["backends"][b] = {"call_ms": call * 1e3, "extra_ms": extra * 1e3, "stall_ms": stall * 1e3,
                                  "ratio": stall / stall_ts, "budget_every": n,
                                  "extra_iqr_ms": _iqr(got[b]["extra"]) * 1e3}
            if got[b]["persist"]:
                out["backends"][b]["persist_s"] = statistics.median(got[b]["persist"])
                out["backends"][b]["agent_cpu_ms"] = statistics.median(got[b]["agent_cpu"]) * 1e3
        print("\nthe same saves, accounted: the call, + the time the training thread waited for an overlapped")
        print("copy, + the CPU the persist and the copy helper took from training's threads (run-queue wait")
        print("beyond the control window's, /proc schedstat); memory-bandwidth contention is not in it")
        print(f"{'backend':<11} {'save call':>10} {'+ waited':>9} {'+ CPU taken':>12} {'= stall':>9} {'ratio':>6} {'IQR':>8}")
        call_ts = None
        for b in BACKENDS:
            per_save = [c + w + t for c, w, t in zip(got[b]["call"], got[b]["waited"], got[b]["taken"], strict=True)]
            call, waited, taken = (statistics.median(got[b][k]) for k in ("call", "waited", "taken"))
            stall = statistics.median(per_save)
            call_ts = call_ts or stall
            print(f"{b:<11} {call * 1e3:>7.1f} ms {waited * 1e3:>6.1f} ms {taken * 1e3:>9.1f} ms {stall * 1e3:>6.1f} ms "
                  f"{stall / call_ts:>6.3f} {_iqr(per_save) * 1e3:>5.1f} ms")
            out["backends"][b].update({"waited_ms": waited * 1e3, "taken_ms": taken * 1e3,
                                       "accounted_stall_ms": stall * 1e3, "accounted_ratio": stall / call_ts})
        print()
        for b in (TG, OVERLAP):
            r, a = out["backends"][b]["ratio"], out["backends"][b]["accounted_ratio"]
            print(f"ratio {b} / torch.save (median stall per save): timed {r:.3f}, accounted {a:.3f} "
                  f"({100 * a:.1f} %; goal <= 5 %)")
        floor = copy_floor_s({"model": model.state_dict(), "optim": opt.state_dict()}, shm_root)
        out["copy_floor_ms"], out["copy_floor_ratio"] = floor * 1e3, floor / call_ts
        print(f"copy floor: the state copied once into shared memory (torch's parallel copy) takes {floor * 1e3:.1f} ms "
              f"= {floor / call_ts:.3f} x torch.save: with training keeping the cores and memory busy, the floor "
              "under any snapshot that copies the state here")
        every = 2 * args.every
        print(f"\nsteps lost per failure when saving every {every} steps (average, worst):")
        print(f"  process failure (the in-memory snapshot survives): {every / 2:.1f}, {every}")
        for b in (TG, OVERLAP):
            lat = statistics.median(got[b]["persist"]) / step_s  # steps from a save until it is on disk
            out["backends"][b]["persist_steps"] = lat
            print(f"  node lost, {b}: {every / 2 + lat:.1f}, {every + math.ceil(lat)} "
                  f"(a checkpoint is on disk {lat:.1f} steps after its save, median)")
        if args.replication_rounds > 0:
            rep, step = replication_cost(args.replication_rounds, 4 * every, every, model, opt, step_fn, ckpt, shm_root, step)
            print_replication(rep, step_s)
            out["replication"] = rep
        for b in (TG, OVERLAP):
            print(f"agent CPU per persisted checkpoint, {b}: {out['backends'][b]['agent_cpu_ms']:.1f} ms (median)")
        print("noise: interquartile range of the after-window extra: "
              + ", ".join(f"{b} {out['backends'][b]['extra_iqr_ms']:.1f} ms" for b in BACKENDS))
        if args.json:
            Path(args.json).write_text(json.dumps(out, indent=1))
    finally:
        if ckpt is not None:
            ckpt.close()
        agent.stdin.close()
        agent.wait(timeout=300)
        disk.remove_tree(base)
        disk.remove_tree(shm_root)
    return 0


def _iqr(xs: list[float]) -> float:
    if len(xs) < 2:  # --pairs 1 --repeats 1: one save, no spread to speak of
        return 0.0
    q = statistics.quantiles(xs, n=4)
    return q[2] - q[0]


if __name__ == "__main__":
    sys.exit(main())
