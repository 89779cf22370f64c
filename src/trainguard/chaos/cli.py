"""`trainguard chaos RUN_DIR FAULT --rank R | --node N`: rehearse a failure on a running job.

Faults: kill (a worker with --rank; the node's agent with --what agent; the node's whole process
tree with --what node), stop / cont (SIGSTOP / SIGCONT a rank or a node's workers), slow (a CPU
load of --percent sharing the rank's core for --duration s, as seed 004's chaos experiment),
fill-disk (fill --path up to --size MB or --leave-mb free, for --duration s, then delete it),
corrupt-ckpt (overwrite bytes in the middle of the newest trainguard.checkpoint step in
--ckpt-dir), hang (the rank blocks before its next collective, at its call site, while the others
wait in theirs; released after --duration s if given, else held until the job restarts the rank;
needs trainguard's worker hooks, rundir/chaos_hold.py), and for nodes in their own network namespace (test beds, chaos/testbed.py) net-cut
(link down), net-delay (tc netem; kernels without the netem qdisc get a clear error), net-loss
(tc netem, else a random-drop iptables rule: the same loss of outgoing packets), net-slow (a tc
tbf token bucket: a thin link at --rate-kbit, slow but not cut), nodecheck-kill (SIGKILL the
node-check process of --node, seed 004's faulty-machine drill; RUN_DIR/chaos/nodecheck-hold
holds the checks before they measure, rundir/chaos_hold.py).
Lasting faults are held by a detached process and reverted after --duration (bounded).
Every injection is recorded as a ``chaos_injected`` event on the target node, so reports join
cause and verdict.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import secrets
import shutil
import signal
import socket
import sqlite3
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil

from trainguard.chaos import background, event_db
from trainguard.chaos.targets import Target, TargetError, nodecheck_target, resolve
from trainguard.events import EventBus, EventStore
from trainguard.exitcodes import EXIT_USAGE
from trainguard.options import non_negative, positive, seconds
from trainguard.rundir import chaos_hold as hold
from trainguard.rundir.readers import NotARunDir, check_run_dir

FAULTS = ["kill", "stop", "cont", "slow", "hang", "fill-disk", "corrupt-ckpt", "net-cut", "net-delay", "net-loss",
          "net-slow", "nodecheck-kill"]  # fmt: skip


DEFAULT_DURATION_S = 30.0
TBF_MIN_BURST = 8 * 1514  # bytes: a few full Ethernet frames
TBF_LATENCY_MS = 500  # how long a packet may queue at the thin link before it is dropped
HOLD_ANSWER_S = 20.0  # the agent answers a hold request within a tick (0.2 s); generous for loaded machines


class ChaosError(Exception):
    pass


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir", help="the running job's run directory")
    p.add_argument("fault", choices=FAULTS)
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--rank", type=int, help="aim at this global rank (and its node)")
    where.add_argument("--node", help="aim at this node (its --node-name)")
    p.add_argument("--what", choices=["worker", "agent", "node"], default=None,
                   help="kill: the rank's worker (default with --rank), the node's agent, or the node's whole "
                        "process tree (default with --node)")  # fmt: skip
    p.add_argument("--duration", type=seconds, default=None,
                   help=f"seconds a lasting fault is held (default {DEFAULT_DURATION_S:g}; hang: until the job restarts the "
                        f"rank), at most {background.MAX_DURATION_S:g}")  # fmt: skip
    p.add_argument("--percent", type=positive, default=90.0, help="slow: CPU load in %% of the rank's core (default 90)")
    p.add_argument("--path", type=Path, help="fill-disk: a directory on the disk to fill")
    p.add_argument("--size-mb", type=positive, default=1024.0, help="fill-disk: write at most this much (default 1024)")
    p.add_argument("--leave-mb", type=non_negative, default=0.0, help="fill-disk: leave this much free (default 0: fill it)")
    p.add_argument("--ckpt-dir", type=Path,
                   help="corrupt-ckpt: the job's trainguard.checkpoint directory (default RUN_DIR/checkpoints)")
    p.add_argument("--delay-ms", type=positive, default=200.0, help="net-delay: added delay (default 200)")
    p.add_argument("--loss", type=positive, default=10.0, help="net-loss: packets lost in %% (default 10)")
    p.add_argument("--rate-kbit", type=positive, default=1000.0,
                   help="net-slow: the node's outgoing bandwidth in kbit/s (default 1000)")  # fmt: skip


def _signal(pids: list[int], sig: signal.Signals) -> list[int]:
    done = []
    for pid in pids:
        try:
            os.kill(pid, sig)
            done.append(pid)
        except ProcessLookupError:
            continue
    return done


def _kill(t: Target, what: str) -> dict[str, Any]:
    if what == "worker":
        if t.rank is None:
            raise ChaosError("kill --what worker needs --rank")
        pids = list(t.workers.values())
    elif what == "agent":
        if t.agent is None:
            raise ChaosError(f"node {t.node}'s agent is not running on this host")
        pids = [t.agent]
    else:
        pids = t.tree()
    return {"signal": "SIGKILL", "what": what, "pids": _signal(pids, signal.SIGKILL)}


def _slow(t: Target, args: argparse.Namespace, run_dir: Path, spec: dict[str, Any]) -> dict[str, Any]:
    pid = next(iter(t.workers.values()))
    cpu = psutil.Process(pid).cpu_num()
    spec.update(cpu=cpu, percent=min(args.percent, 100.0))
    return {"cpu": cpu, "percent": spec["percent"], "holder": background.start(spec, _log(run_dir, spec))}


def _hang(t: Target, args: argparse.Namespace, run_dir: Path, spec: dict[str, Any]) -> dict[str, Any]:
    """Ask the rank's agent to hold it (rundir/chaos_hold.py) and wait for its answer."""
    if t.rank is None:
        raise ChaosError("hang needs --rank")
    req = hold.HoldRequest(spec["id"], t.rank, t.workers[t.rank])
    hold.request(run_dir, req)
    deadline = time.monotonic() + HOLD_ANSWER_S
    while (answer := hold.answered(run_dir, t.rank, req.id)) is None:
        if time.monotonic() > deadline:
            hold.withdraw(run_dir, t.rank, req.id)
            hold.ack_path(run_dir, t.rank).unlink(missing_ok=True)  # a late answer
            raise ChaosError(f"node {t.node}'s agent did not answer the hold of rank {t.rank} within {HOLD_ANSWER_S:g}s")
        time.sleep(0.1)
    if not answer["held"]:
        hold.withdraw(run_dir, t.rank, req.id)
        raise ChaosError(f"cannot hang rank {t.rank}: {answer['why']}")
    detail: dict[str, Any] = {"pid": req.pid, "duration": args.duration}
    if args.duration is not None:  # a holder releases it; without one the hold ends with the worker
        spec.update(rank=t.rank)
        detail["holder"] = background.start(spec, _log(run_dir, spec))
    return detail


def _fill_disk(args: argparse.Namespace, run_dir: Path, spec: dict[str, Any]) -> dict[str, Any]:
    if args.path is None or not args.path.is_dir():
        raise ChaosError("fill-disk needs --path, an existing directory on the disk to fill")
    spec.update(file=str(args.path / f".trainguard-chaos-fill-{spec['id']}"), size=int(args.size_mb * (1 << 20)),
                leave=int(args.leave_mb * (1 << 20)))  # fmt: skip
    return {"file": spec["file"], "size": spec["size"], "holder": background.start(spec, _log(run_dir, spec))}


def _corrupt(ckpt_dir: Path, t: Target) -> dict[str, Any]:
    from trainguard.checkpoint import disk

    rank = t.rank if t.rank is not None else min(t.workers)
    steps = disk.list_steps(ckpt_dir, rank)
    if not steps:
        raise ChaosError(f"no checkpoint of rank {rank} in {ckpt_dir} (give --ckpt-dir)")
    path = disk.step_dir(ckpt_dir, steps[0]) / disk.data_name(rank)
    size = path.stat().st_size
    n = min(4096, max(1, size // 4))
    with open(path, "r+b") as f:  # in place: the file keeps its name and size, its bytes are wrong
        f.seek(size // 2)
        f.write(secrets.token_bytes(n))
    return {"file": str(path), "step": steps[0], "bytes": n}


def _netns_of(pid: int) -> tuple[str, str]:
    """The named network namespace a process runs in, and its interface (not lo)."""
    ino = os.stat(f"/proc/{pid}/ns/net").st_ino
    names = os.listdir("/run/netns") if os.path.isdir("/run/netns") else []
    name = next((n for n in names if os.stat(f"/run/netns/{n}").st_ino == ino), None)
    if name is None:
        raise ChaosError("network faults need the node in its own network namespace (a test bed); "
                         "this node shares the host's network")  # fmt: skip
    out = subprocess.run(["ip", "netns", "exec", name, "ip", "-o", "link"], capture_output=True, text=True, timeout=30)
    devs = [ln.split(":")[1].strip().split("@")[0] for ln in out.stdout.splitlines() if ":" in ln]
    dev = next((d for d in devs if d != "lo"), None)
    if dev is None:
        raise ChaosError(f"namespace {name} has no network interface besides lo")
    return name, dev


def _apply(cmd: list[str]) -> str | None:
    """Run one change; None when it worked, else its first error line."""
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    if done.returncode == 0:
        return None
    return done.stderr.strip().splitlines()[0] if done.stderr.strip() else f"exit {done.returncode}"


def _no_netem(why: str) -> bool:
    return any(w in why.lower() for w in ("netem", "unknown", "not found"))


def _tbf(rate_kbit: float) -> list[str]:
    """A thin link: token bucket at ``rate_kbit``. The bucket holds at least a few full frames (a
    smaller one would drop every full-size packet: dead, not slow) and the queue TBF_LATENCY_MS of
    traffic, so packets wait rather than drop."""
    burst = max(TBF_MIN_BURST, int(rate_kbit * 1000 / 8 / 100))  # >= rate/HZ at HZ=100
    return ["root", "tbf", "rate", f"{rate_kbit:g}kbit", "burst", str(burst), "latency", f"{TBF_LATENCY_MS}ms"]


def _loss_rule(dev: str, loss: float, injection: str) -> list[str]:
    """An iptables rule that drops ``loss`` %% of the node's outgoing packets at random (what
    netem's loss does, for kernels without netem), named by the injection so its revert deletes
    exactly this rule."""
    return ["OUTPUT", "-o", dev, "-m", "statistic", "--mode", "random", "--probability", f"{loss / 100:.4f}",
            "-m", "comment", "--comment", f"trainguard-chaos-{injection}", "-j", "DROP"]  # fmt: skip


def _net(fault: str, args: argparse.Namespace, t: Target, run_dir: Path, spec: dict[str, Any]) -> dict[str, Any]:
    if fault == "net-loss" and args.loss > 100:
        raise ChaosError(f"--loss is a percentage: at most 100, got {args.loss:g}")
    pid = t.agent or next(iter(t.workers.values()))
    ns, dev = _netns_of(pid)
    inside = ["ip", "netns", "exec", ns]
    tc = [*inside, "tc", "qdisc"]
    if fault == "net-cut":
        change, revert = [*inside, "ip", "link", "set", dev, "down"], [*inside, "ip", "link", "set", dev, "up"]
    elif fault == "net-slow":
        change, revert = [*tc, "add", "dev", dev, *_tbf(args.rate_kbit)], [*tc, "del", "dev", dev, "root"]
    else:
        netem = ["delay", f"{args.delay_ms:g}ms"] if fault == "net-delay" else ["loss", f"{args.loss:g}%"]
        change, revert = [*tc, "add", "dev", dev, "root", "netem", *netem], [*tc, "del", "dev", dev, "root"]
    how = {"net-cut": "link down", "net-slow": "tbf"}.get(fault, "netem")
    why = _apply(change)
    if why is not None and fault == "net-loss" and _no_netem(why):
        if shutil.which("iptables") is None:
            raise ChaosError(f"net-loss needs the netem qdisc or iptables; this host has neither ({why})")
        rule = _loss_rule(dev, args.loss, spec["id"])
        change, revert, how = [*inside, "iptables", "-A", *rule], [*inside, "iptables", "-D", *rule], "iptables"
        why = _apply(change)
    if why is not None:
        if fault in ("net-delay", "net-loss") and _no_netem(why):
            raise ChaosError(f"{fault} needs the netem qdisc, which this kernel lacks ({why})")
        raise ChaosError(f"{' '.join(change)}: {why}")
    spec["revert"] = [revert]
    return {"netns": ns, "dev": dev, "how": how, "holder": background.start(spec, _log(run_dir, spec))}


def _log(run_dir: Path, spec: dict[str, Any]) -> Path:
    return run_dir / "chaos" / f"{spec['id']}.log"


def inject(run_dir: Path, args: argparse.Namespace) -> tuple[Target, dict[str, Any]]:
    if args.fault == "nodecheck-kill":  # before the workers start: no job_started names them yet
        return _nodecheck_kill(run_dir, args)
    t = resolve(run_dir, rank=args.rank, node=args.node)
    return t, inject_into(t, run_dir, args)


def _nodecheck_kill(run_dir: Path, args: argparse.Namespace) -> tuple[Target, dict[str, Any]]:
    """SIGKILL the node's node-check process now, and every one its agent starts for --duration
    seconds (a detached holder): the node fails each test of the check, as a faulty machine would,
    not only the first (the check pairs a failed node again with a healthy one)."""
    if args.node is None:
        raise ChaosError("nodecheck-kill needs --node")
    t = nodecheck_target(run_dir, args.node)
    spec = _spec(args, run_dir, t.node)
    killed = None
    if t.pid is not None:
        with contextlib.suppress(ProcessLookupError):  # it ended meanwhile: the holder takes the next
            os.killpg(t.pid, signal.SIGKILL)  # it leads its own session (nodecheck_run: start_new_session)
            killed = t.pid
    spec.update(agent=t.agent, agent_created=t.agent_created)
    holder = background.start(spec, _log(run_dir, spec))
    return Target(t.node, None, {}, t.agent), {"signal": "SIGKILL", "what": "node-check process", "pid": killed,
                                              "holder": holder, "duration": spec["duration"]}  # fmt: skip


def _spec(args: argparse.Namespace, run_dir: Path, node: str) -> dict[str, Any]:
    """What the detached holder of a lasting fault is told."""
    return {"id": f"{int(time.time())}-{secrets.token_hex(3)}", "fault": args.fault, "run_dir": str(run_dir),
            "node": node, "duration": min(args.duration or DEFAULT_DURATION_S, background.MAX_DURATION_S)}  # fmt: skip


def inject_into(t: Target, run_dir: Path, args: argparse.Namespace) -> dict[str, Any]:
    """Inject ``args.fault`` into a target already found (bench/soak.py finds torchrun's workers
    itself: a torchrun job has no run dir to resolve them from); its details."""
    fault = args.fault
    spec = _spec(args, run_dir, t.node)
    if fault == "kill":
        return _kill(t, args.what or ("worker" if t.rank is not None else "node"))
    if fault in ("stop", "cont"):
        sig = signal.SIGSTOP if fault == "stop" else signal.SIGCONT
        return {"signal": sig.name, "pids": _signal(list(t.workers.values()), sig)}
    if fault == "hang":
        return _hang(t, args, run_dir, spec)
    if fault == "slow":
        return {**_slow(t, args, run_dir, spec), "duration": spec["duration"]}
    if fault == "fill-disk":
        return {**_fill_disk(args, run_dir, spec), "duration": spec["duration"]}
    if fault == "corrupt-ckpt":
        return _corrupt(args.ckpt_dir or run_dir / "checkpoints", t)
    return {**_net(fault, args, t, run_dir, spec), "duration": spec["duration"]}


def main(args: argparse.Namespace) -> int:
    logging.getLogger("trainguard").addHandler(logging.NullHandler())  # the event is printed below, once
    try:
        run_dir = check_run_dir(args.run_dir)
        t, detail = inject(run_dir, args)
    except (NotARunDir, TargetError, ChaosError) as exc:
        print(f"trainguard chaos: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    where = f"rank {t.rank} on node {t.node}" if t.rank is not None else f"node {t.node}"
    message = f"chaos {args.fault} injected into {where}"
    print(message + "".join(f"; {k}={v}" for k, v in detail.items()))
    try:
        store = EventStore(event_db(run_dir))
    except (sqlite3.Error, OSError) as exc:  # injected all the same: say that it is not on record
        print(f"trainguard chaos: warning: not recorded in {event_db(run_dir)}: {exc}", file=sys.stderr)
        return 0
    try:
        EventBus(store, node=t.node).emit(
            "chaos_injected", message, severity="warning", rank=t.rank,
            evidence={"fault": args.fault, "by": socket.gethostname(), **detail},
        )  # fmt: skip
    finally:
        store.close()
    return 0
