"""Every GPU path of trainguard on a real NVIDIA GPU, one command.

    python bench/gpu.py [--only NAME,...] [--json FILE] [--work DIR]

Runs each scenario below that the machine has GPUs for (the others print "skip" with the reason),
one at a time, and prints one line per scenario: pass / fail / skip, what it measured, and where
its run directory is. Without CUDA every scenario skips and the exit status is 0; a failed
scenario makes it 1. The same scenarios are the tests in tests/gpu/ (skipped without a GPU).
``--cpu-dry-run`` runs the multi-rank scenarios on gloo and the CPU instead: a check of the kit
itself (its jobs, faults and verdict reading) on a machine without a GPU, before a GPU's minutes
are spent on it.

  nvml              NVML: devices, driver, health (ECC, retired pages, Xid), utilisation; the
                    pre-flight item gpu-check with --gpu require
  nodecheck         the node check's GEMM and collectives on the GPU (NCCL, one process)
  device-wait       a 1-rank job whose kernel spins the GPU for 30 s while the CPU waits in a stream
                    synchronise: no hang verdict may stop it (a long kernel is no proof); NVML's
                    utilisation meanwhile (what the seed's utilisation rule sees)
  flight-recorder   NCCL's Flight Recorder read live from a worker through its socket
                    (probes/flight_recorder.py): the NCCL entries and their states
  oom               CUDA out of memory on rank 0, diagnosed live (category cuda_oom, rank 0)
  checkpoint        bench/checkpoint.py with the model and Adam state on the GPU: the snapshot's
                    training stall against torch.save (goal <= 0.05 x)
  nodecheck-local   (2 GPUs) ``trainguard nodecheck --local N``: every GPU a simulated node, paired
                    NCCL groups (each simulated node sees its own GPU)
  sigstop           (2 GPUs) a SIGSTOPped rank in an NCCL job: hang verdict names it, restart, success
  sleep             (2 GPUs) a rank sleeping before its all-reduce: named, restarted, success
  mismatch          (2 GPUs) a rank that skipped an all-reduce: the hang report's sequence from
                    NCCL's Flight Recorder
  straggler         (2 GPUs) a rank slowed by a competing GEMM: straggler_detected names it
  recovery          (2 GPUs) bench/recovery.py: SIGKILL -> first step after the restart, with CUDA
                    and NCCL re-initialised, trainguard vs torchrun in the same run
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
JOB = REPO / "tests" / "gpu" / "scripts" / "gpu_job.py"
JOB_TIMEOUT_S = 300.0
# Small windows so that a verdict comes in seconds; the defaults are for real jobs.
HANG_FLAGS = ["--hang-period", "0.5", "--hang-step-slack", "3"]


@dataclass
class Result:
    name: str
    status: str  # pass / fail / skip
    detail: str
    data: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Scenario:
    name: str
    gpus: int  # GPUs it needs
    fn: Callable[[Kit], Result]
    dry: bool = False  # also runs on the CPU (gloo) in --cpu-dry-run: a check of the kit, not of a GPU path


def gpu_count() -> tuple[int, str]:
    """(CUDA devices, why none)."""
    try:
        import torch
    except ImportError as exc:
        return 0, f"torch not importable: {exc}"
    if not torch.cuda.is_available():
        return 0, f"no CUDA device (torch {torch.__version__}, CUDA build {torch.version.cuda or 'none'})"
    return torch.cuda.device_count(), ""


class Kit:
    def __init__(self, work: Path, ngpu: int, cpu: bool = False) -> None:
        self.work = work
        self.ngpu = ngpu
        self.cpu = cpu  # the dry run: the jobs on gloo and the CPU, to prove the kit itself

    def job(self, name: str, nproc: int, mode: str, *job_args: str, flags: tuple[str, ...] = (),
            during: Callable[[Path, subprocess.Popen], dict] | None = None) -> tuple[int, Path, str, dict]:
        """``trainguard run`` of gpu_job.py: (exit status, run dir, output tail, what ``during``
        returned, called while the job runs)."""
        run_dir = self.work / name
        cmd = [sys.executable, "-m", "trainguard", "run", "--standalone", "--nproc-per-node", str(nproc),
               "--max-restarts", "2", "--run-dir", str(run_dir), *flags, str(JOB), "--mode", mode, *job_args,
               *(["--cpu", "--width", "256"] if self.cpu else [])]  # fmt: skip
        log = open(self.work / f"{name}.log", "w+")  # noqa: SIM115 (read back below)
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        seen: dict = {}
        try:
            if during is not None:
                seen = during(run_dir, proc)
            rc = proc.wait(timeout=JOB_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            rc = -1
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            log.seek(0)
            tail = log.read()[-3000:]
            log.close()
        return rc, run_dir, tail, seen


def events(run_dir: Path, kind: str) -> list:
    from trainguard.events.store import read_all

    return read_all(run_dir, kinds=[kind]) if run_dir.exists() else []


def _verdict(name: str, rc: int, run_dir: Path, tail: str, checks: dict[str, bool], data: dict) -> Result:
    failed = [what for what, ok in checks.items() if not ok]
    if failed:
        return Result(name, "fail", f"{'; '.join(failed)} (exit {rc}; {run_dir}); output: ...{tail[-600:]}", data)
    return Result(name, "pass", ", ".join(checks), data)


# ---- scenarios ---------------------------------------------------------------------------------
def s_nvml(kit: Kit) -> Result:
    from trainguard.checks.items import CheckConfig, check_gpu
    from trainguard.probes import nvml

    if not nvml.available():
        return Result("nvml", "fail", f"NVML unavailable with a CUDA device present: {nvml.unavailable_reason()}")
    health = nvml.health() or []
    util = nvml.utilization(list(range(len(health))))
    item = check_gpu(CheckConfig(gpu_mode="require", nproc_per_node=kit.ngpu), dict(os.environ))
    data = {"driver": nvml.driver_version(), "gpus": [h.to_dict() for h in health], "utilization": util,
            "gpu_check": {"status": item.status, "detail": item.detail}}  # fmt: skip
    checks = {f"{len(health)} GPU(s) read": len(health) == kit.ngpu, "utilisation read": util is not None,
              f"gpu-check {item.status}: {item.detail}": item.status == "ok"}  # fmt: skip
    return _verdict("nvml", 0, Path("-"), "", checks, data)


def s_nodecheck(kit: Kit) -> Result:
    import torch.distributed as dist

    from trainguard.checks import bench as nc

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    cmd = [sys.executable, "-m", "trainguard.checks.bench", "--store-host", "127.0.0.1", "--store-port",
           str(store.port), "--rank", "0", "--world-size", "1", "--device", "cuda", "--backend", "nccl"]  # fmt: skip
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=JOB_TIMEOUT_S)
    line = next((ln for ln in reversed(p.stdout.splitlines()) if ln.startswith(nc.RESULT_PREFIX)), None)
    try:
        out = json.loads(line[len(nc.RESULT_PREFIX) :]) if line else None
    except ValueError:
        out = None
    if not isinstance(out, dict) or not out.get("ok"):
        return Result("nodecheck", "fail", f"exit {p.returncode}: {out or p.stderr[-800:]}")
    del store
    checks = {f"backend {out.get('backend')}": out.get("backend") == "nccl",
              f"device {out.get('device')}": str(out.get("device", "")).startswith("cuda"),
              f"GEMM measured: {json.dumps({k: v for k, v in out.items() if 'gemm' in k or 'tflops' in k})[:200]}":
                  any("tflops" in k or "gemm" in k for k in out)}  # fmt: skip
    return _verdict("nodecheck", p.returncode, Path("-"), p.stderr, checks, out)


def s_nodecheck_local(kit: Kit) -> Result:
    # Every GPU a simulated node of its own, in pairs over NCCL (the paired check of a multi-node job).
    p = subprocess.run([sys.executable, "-m", "trainguard", "nodecheck", "--local", str(kit.ngpu), "--json"],
                       capture_output=True, text=True, timeout=JOB_TIMEOUT_S)  # fmt: skip
    try:
        out = json.loads(p.stdout)
    except ValueError:
        return Result("nodecheck-local", "fail", f"exit {p.returncode}: {(p.stdout + p.stderr)[-800:]}")
    results = out.get("results", [])
    data = {"faulty": out.get("faulty"), "stragglers": out.get("stragglers"), "results": results}
    checks = {f"{kit.ngpu} simulated nodes, healthy (exit {p.returncode})": p.returncode == 0 and not out.get("faulty"),
              "every group's test ran": bool(results) and all(r.get("ok") for r in results)}  # fmt: skip
    return _verdict("nodecheck-local", p.returncode, Path("-"), p.stderr, checks, data)


def _sample_utilization(seconds: float, proc: subprocess.Popen, all_gpus: bool = False) -> list:
    """NVML's utilisation every 0.5 s for ``seconds`` (or until the job ends): of GPU 0, or of
    every GPU (a list per sample)."""
    from trainguard.probes import nvml

    n = (nvml.device_count() or 1) if all_gpus else 1
    samples: list = []
    end = time.monotonic() + seconds
    while time.monotonic() < end and proc.poll() is None:
        u = nvml.utilization(list(range(n)))
        if u:
            samples.append(u if all_gpus else u[0])
        time.sleep(0.5)
    return samples


def _output(kit: Kit, name: str) -> str:
    return (kit.work / f"{name}.log").read_text(errors="replace")


def _wait_output(kit: Kit, name: str, proc: subprocess.Popen, needle: str, timeout: float = 120.0) -> bool:
    """Wait until the job's output shows ``needle`` (the fault began); False if it ended or never did."""
    end = time.monotonic() + timeout
    while time.monotonic() < end and proc.poll() is None:
        if needle in _output(kit, name):
            return True
        time.sleep(0.2)
    return False


def s_device_wait(kit: Kit) -> Result:
    def during(run_dir: Path, proc: subprocess.Popen) -> dict:
        _wait_output(kit, "device-wait", proc, "device-wait at step")
        return {"utilization_during_wait": _sample_utilization(25.0, proc)}

    rc, run_dir, tail, seen = kit.job("device-wait", 1, "device-wait", "--seconds", "30", flags=tuple(HANG_FLAGS),
                                      during=during)  # fmt: skip
    detected = events(run_dir, "hang_detected")
    suspected = events(run_dir, "hang_suspected")
    util = seen.get("utilization_during_wait", [])
    data = {**seen, "hang_suspected": [e.message for e in suspected], "hang_detected": [e.message for e in detected]}
    checks = {"job succeeded": rc == 0, "no hang verdict (a long kernel is no proof)": not detected,
              f"NVML read the spinning GPU busy (median {_median(util)} %)": bool(util) and _median(util) >= 50}  # fmt: skip
    return _verdict("device-wait", rc, run_dir, tail, checks, data)


def s_flight_recorder(kit: Kit) -> Result:
    from trainguard.probes import flight_recorder

    def during(run_dir: Path, proc: subprocess.Popen) -> dict:
        _wait_output(kit, "flight-recorder", proc, "device-wait at step")
        socks = _sockets_of(proc.pid)
        views = {s: flight_recorder.read(0, s) for s in socks}
        live = [v for v in views.values() if v.groups]
        return {"sockets": socks, "views": {s: v.to_dict() for s, v in views.items()},
                "nccl_handler": any(flight_recorder.ask(s, "dump_nccl_trace_json") is not None for s in socks),
                "ok": bool(live)}  # fmt: skip

    rc, run_dir, tail, seen = kit.job("flight-recorder", 1, "device-wait", "--seconds", "10", during=during)
    checks = {"the worker's recorder answered while its rank waited on the GPU": bool(seen.get("ok")),
              **({} if kit.cpu else {"torch has NCCL's handler (dump_nccl_trace_json)": bool(seen.get("nccl_handler"))}),
              "job succeeded": rc == 0}  # fmt: skip
    return _verdict("flight-recorder", rc, run_dir, tail, checks, seen)


def _sockets_of(agent_pid: int) -> list[str]:
    """The Flight Recorder sockets of this agent's workers (named after the agent's pid)."""
    from trainguard.worker.ring import shm_dir

    return sorted(str(p) for p in Path(shm_dir()).glob(f"trainguard-{agent_pid}-*-a*-r0.fr"))


def s_oom(kit: Kit) -> Result:
    rc, run_dir, tail, _ = kit.job("oom", 1, "oom", "--rank", "0", "--at", "5")
    diag = events(run_dir, "diagnosis")
    first = diag[0] if diag else None
    cat = first.evidence.get("category") if first else None
    data = {"diagnosis": first.message if first else None, "category": cat, "rank": first.rank if first else None}
    checks = {f"diagnosed live as {cat}": cat == "cuda_oom", "first failing rank 0": bool(first) and first.rank == 0}
    return _verdict("oom", rc, run_dir, tail, checks, data)


def s_checkpoint(kit: Kit) -> Result:
    out = kit.work / "checkpoint.json"
    cmd = [sys.executable, str(REPO / "bench" / "checkpoint.py"), "--device", "cuda", "--state-mb", "1024",
           "--pairs", "3", "--repeats", "2", "--replication-rounds", "0", "--dir", str(kit.work), "--json", str(out)]  # fmt: skip
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=2 * JOB_TIMEOUT_S)
    if p.returncode != 0 or not out.exists():
        return Result("checkpoint", "fail", f"exit {p.returncode}: {(p.stdout + p.stderr)[-800:]}")
    numbers = json.loads(out.read_text())
    tg = numbers.get("backends", {}).get("trainguard", {})
    ratio, timed = tg.get("accounted_ratio"), tg.get("ratio")
    data = {"trainguard": tg, "copy_floor_ratio": numbers.get("copy_floor_ratio"), "stdout": p.stdout[-2000:]}
    checks = {f"stall <= 0.05 x torch.save (accounted {ratio}, timed {timed})": ratio is not None and ratio <= 0.05}
    return _verdict("checkpoint", p.returncode, Path("-"), p.stdout, checks, data)


def _hang_case(kit: Kit, name: str, mode: str, *job_args: str, flags: tuple[str, ...] = ()
               ) -> tuple[int, Path, str, list, list, dict]:  # fmt: skip
    def during(run_dir: Path, proc: subprocess.Popen) -> dict:
        # NVML's view of the hung job (what the seed's utilisation rule sees), until the verdict.
        if kit.cpu or not _wait_output(kit, name, proc, f"{mode} at step"):
            return {}
        samples = []
        end = time.monotonic() + 60
        while time.monotonic() < end and proc.poll() is None and "[hang_detected]" not in _output(kit, name):
            samples += _sample_utilization(0.5, proc, all_gpus=True)
        return {"utilization_while_hung": samples}

    rc, run_dir, tail, seen = kit.job(name, 2, mode, "--rank", "1", *job_args, flags=(*HANG_FLAGS, *flags),
                                      during=during)  # fmt: skip
    return rc, run_dir, tail, events(run_dir, "hang_detected"), events(run_dir, "job_succeeded"), seen


def s_sigstop(kit: Kit) -> Result:
    rc, run_dir, tail, hangs, ok, seen = _hang_case(kit, "sigstop", "sigstop")
    data = {**seen, "hang_detected": [e.message for e in hangs]}
    checks = {"hang detected": bool(hangs), "culprit rank 1": bool(hangs) and hangs[0].evidence.get("culprit") == 1,
              "restarted and succeeded": rc == 0 and bool(ok)}  # fmt: skip
    return _verdict("sigstop", rc, run_dir, tail, checks, data)


def s_sleep(kit: Kit) -> Result:
    # A sleep is proof only of its own length: one that outlasts the seed's window (--hang-detect-time,
    # 0.5 min here) is judged at once; a shorter one would only be suspected.
    rc, run_dir, tail, hangs, ok, seen = _hang_case(kit, "sleep", "sleep", "--seconds", "600",
                                                    flags=("--hang-detect-time", "0.5"))  # fmt: skip
    suspected = events(run_dir, "hang_suspected")
    data = {**seen, "hang_suspected": [e.message for e in suspected], "hang_detected": [e.message for e in hangs]}
    checks = {"hang detected": bool(hangs), "culprit rank 1": bool(hangs) and hangs[0].evidence.get("culprit") == 1,
              "restarted and succeeded": rc == 0 and bool(ok)}  # fmt: skip
    return _verdict("sleep", rc, run_dir, tail, checks, data)


def s_mismatch(kit: Kit) -> Result:
    rc, run_dir, tail, hangs, ok, seen = _hang_case(kit, "mismatch", "skip")
    seq = hangs[0].evidence.get("sequence", {}) if hangs else {}
    flight = hangs[0].evidence.get("flight_recorder", {}) if hangs else {}
    data = {**seen, "sequence": seq, "flight_recorder": flight, "hang_detected": [e.message for e in hangs]}
    lines = seq.get("lines", [])
    checks = {"hang detected": bool(hangs), "every rank's Flight Recorder read": len(flight) == 2,
              "the sequence comes from the Flight Recorder": bool(lines) and lines[0].startswith("torch Flight Recorder"),
              f"out of sequence: {seq.get('out_of_sequence')}": seq.get("out_of_sequence") == [1],
              "restarted and succeeded": rc == 0 and bool(ok)}  # fmt: skip
    return _verdict("mismatch", rc, run_dir, tail, checks, data)


def s_straggler(kit: Kit) -> Result:
    rc, run_dir, tail, _ = kit.job("straggler", 2, "slow", "--rank", "1", "--steps", "200",
                                   flags=("--straggler-window", "20", "--straggler-windows", "2"))  # fmt: skip
    found = events(run_dir, "straggler_detected")
    data = {"straggler_detected": [e.message for e in found]}
    checks = {"straggler detected": bool(found), "rank 1 named": bool(found) and found[0].rank == 1, "job succeeded": rc == 0}
    return _verdict("straggler", rc, run_dir, tail, checks, data)


def s_recovery(kit: Kit) -> Result:
    p = subprocess.run([sys.executable, str(REPO / "bench" / "recovery.py"), "--kills", "4"],
                       capture_output=True, text=True, timeout=2 * JOB_TIMEOUT_S)  # fmt: skip
    medians = dict(re.findall(r"^\s*(trainguard|torchrun)\s+median ([0-9.]+) s", p.stdout, re.M))
    data = {"medians_s": medians, "stdout": p.stdout[-2000:]}
    checks = {f"both tools measured {medians}": p.returncode == 0 and len(medians) == 2}
    return _verdict("recovery", p.returncode, Path("-"), p.stdout + p.stderr, checks, data)


def _median(xs: list[float]) -> float:
    return sorted(xs)[len(xs) // 2] if xs else 0.0


SCENARIOS = [
    Scenario("nvml", 1, s_nvml),
    Scenario("nodecheck", 1, s_nodecheck),
    Scenario("device-wait", 1, s_device_wait),
    Scenario("flight-recorder", 1, s_flight_recorder, dry=True),
    Scenario("oom", 1, s_oom),
    Scenario("checkpoint", 1, s_checkpoint),
    Scenario("nodecheck-local", 2, s_nodecheck_local),
    Scenario("sigstop", 2, s_sigstop, dry=True),
    Scenario("sleep", 2, s_sleep, dry=True),
    Scenario("mismatch", 2, s_mismatch, dry=True),
    Scenario("straggler", 2, s_straggler, dry=True),
    Scenario("recovery", 2, s_recovery),
]


def run_one(sc: Scenario, work: Path, ngpu: int, why_none: str, cpu: bool = False) -> Result:
    if cpu and not sc.dry:
        return Result(sc.name, "skip", "a GPU path only (no CPU dry run)")
    if ngpu < sc.gpus and not cpu:
        return Result(sc.name, "skip", why_none or f"needs {sc.gpus} GPUs, {ngpu} here")
    d = work / sc.name
    d.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    try:
        r = sc.fn(Kit(d, ngpu, cpu))
    except Exception as exc:  # one scenario's crash is its failure, not the kit's
        r = Result(sc.name, "fail", f"{type(exc).__name__}: {exc}")
    r.data["seconds"] = round(time.monotonic() - t0, 1)
    return r


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", default="", help="comma-separated scenario names (default: all)")
    ap.add_argument("--json", default=None, help="also write every result to this file")
    ap.add_argument("--work", default=None, help="where run directories go (default: a new temp dir)")
    ap.add_argument("--cpu-dry-run", action="store_true",
                    help="run the multi-rank scenarios on gloo and the CPU: checks the kit, not a GPU")
    args = ap.parse_args(argv)
    names = [n for n in args.only.split(",") if n]
    unknown = set(names) - {s.name for s in SCENARIOS}
    if unknown:
        ap.error(f"unknown scenario(s) {', '.join(sorted(unknown))}; known: {', '.join(s.name for s in SCENARIOS)}")
    ngpu, why = gpu_count()
    work = Path(args.work or tempfile.mkdtemp(prefix="tg-bench-gpu-"))
    gpu_names = _gpu_names() if ngpu else []
    print(f"GPUs: {ngpu} {gpu_names or why}; work dir {work}", flush=True)
    results = []
    for sc in SCENARIOS:
        if names and sc.name not in names:
            continue
        r = run_one(sc, work, ngpu, why, args.cpu_dry_run)
        results.append(r)
        print(f"{r.name:<16} {r.status:<4} {r.data.get('seconds', 0):>6.1f}s  {r.detail}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"gpus": gpu_names, "results": [asdict(r) for r in results]}, indent=1,
                                              default=str))  # fmt: skip
    if args.work is None and all(r.status == "skip" for r in results):
        shutil.rmtree(work, ignore_errors=True)  # nothing ran: nothing to look at
    return 1 if any(r.status == "fail" for r in results) else 0


def _gpu_names() -> list[str]:
    import torch

    return [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]


if __name__ == "__main__":
    sys.exit(main())
