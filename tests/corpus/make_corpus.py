"""Regenerate the real-run cases of the diagnosis corpus.

    python tests/corpus/make_corpus.py [CASE...]      # default: all real-run cases

Each case runs fault_job.py for real (2 gloo ranks on 127.0.0.1) and writes into
tests/corpus/<category>/<case>/:
- rank-<r>.log: the workers' stdout+stderr, one line per line, in trainguard's per-rank format
  ``2026-11-21T09:30:01.123456 [rank1]: <text>`` (what `trainguard run` writes),
  or torchrun.log: the raw console output of a real `torchrun --tee 3` run;
- failures.json: how each worker ended (exitcode, signal), as the agent reports it;
- expected.json: the verdict the case stands for (written from the case table below, never from
  the diagnosis output).
The hand-written cases (from documented NCCL/CUDA/platform log formats, no GPU here) live next to
these and are not touched.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from datetime import datetime
from pathlib import Path

HERE = Path(__file__).resolve().parent
JOB = HERE / "fault_job.py"
DEADLINE_S = 90


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _pump(pipe, path: Path, rank: int, seen: list[str]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for raw in iter(pipe.readline, b""):
            text = raw.rstrip(b"\r\n").decode("utf-8", errors="replace")
            seen.append(text)
            f.write(f"{datetime.now().strftime('%Y-%m-%dT%H:%M:%S.%f')} [rank{rank}]: {text}\n")
            f.flush()


def run_ranks(out: Path, mode: str, ranks: list[int], world: int = 2, extra: list[str] | None = None,
              stop_when=None) -> dict[int, dict]:  # fmt: skip
    """Start the given ranks of a `world`-rank job; return failure info per failed rank."""
    port = _free_port()
    procs, pumps, seen = {}, [], {r: [] for r in ranks}
    for r in ranks:
        env = {**os.environ, "RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": str(world),
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "PYTHONUNBUFFERED": "1",
               "OMP_NUM_THREADS": "1"}  # fmt: skip
        p = subprocess.Popen([sys.executable, str(JOB), "--mode", mode, *(extra or [])], env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
        procs[r] = p
        t = threading.Thread(target=_pump, args=(p.stdout, out / f"rank-{r}.log", r, seen[r]), daemon=True)
        t.start()
        pumps.append(t)
    deadline = time.monotonic() + DEADLINE_S
    stopped = False
    try:
        while any(p.poll() is None for p in procs.values()) and time.monotonic() < deadline:
            if stop_when is not None and not stopped and stop_when(seen):
                for p in procs.values():  # stopped from outside, as a hang detector would
                    if p.poll() is None:
                        os.killpg(p.pid, signal.SIGTERM)
                stopped = True
            time.sleep(0.05)
    finally:
        for p in procs.values():
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()
        for t in pumps:
            t.join(timeout=10)
    failures = {}
    for r, p in procs.items():
        if p.returncode != 0:
            sig = signal.Signals(-p.returncode).name if p.returncode < 0 else None
            failures[r] = {"local_rank": r, "pid": p.pid, "exitcode": p.returncode, "signal": sig}
    return failures


def run_torchrun(out: Path, mode: str) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "--tee", "3",
           str(JOB), "--mode", mode]  # fmt: skip
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    with open(out / "torchrun.log", "wb") as f:
        p = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            p.wait(timeout=DEADLINE_S)
        finally:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()


def _after_step(step: int):
    def check(seen: dict[int, list[str]]) -> bool:
        return all(any(f"step={step} " in line for line in lines) for lines in seen.values())

    return check


# case -> (category dir, how to run, expected verdict)
CASES = {
    "exception": ("python_exception", lambda o: run_ranks(o, "exception", [0, 1]),
                  {"category": "python_exception", "rank": 1, "line_contains": "ValueError: bad sample"}),
    "exception_torchrun": ("python_exception", lambda o: run_torchrun(o, "exception"),
                           {"category": "python_exception", "rank": 1, "line_contains": "ValueError"}),
    "gloo_timeout": ("nccl_timeout", lambda o: run_ranks(o, "timeout", [0, 1]),
                     {"category": "nccl_timeout", "rank": 0, "findings": ["suspect_ranks"], "line_contains": "Timed out"}),
    # SIGKILLed by the test, not by the OOM killer: "killed from outside", never host_oom (issue 12)
    "sigkill": ("killed_external", lambda o: run_ranks(o, "sigkill", [0, 1]),
                {"category": "killed_external", "rank": 1, "confidence": "low"}),
    "sigkill_torchrun": ("killed_external", lambda o: run_torchrun(o, "sigkill"),
                         {"category": "killed_external", "rank": 1, "line_contains": "exitcode: -9"}),
    "memory_error": ("host_oom", lambda o: run_ranks(o, "hostoom", [0, 1]),
                     {"category": "host_oom", "rank": 1, "line_contains": "MemoryError"}),
    "enospc": ("disk_full_or_io", lambda o: run_ranks(o, "diskfull", [0, 1]),
               {"category": "disk_full_or_io", "rank": 1, "line_contains": "No space left on device"}),
    "worker_killed": ("dataloader", lambda o: run_ranks(o, "dataloader", [0, 1]),
                      {"category": "dataloader", "rank": 1, "line_contains": "DataLoader worker"}),
    "sigsegv": ("segfault", lambda o: run_ranks(o, "segfault", [0, 1]),
                {"category": "segfault", "rank": 1, "line_contains": "Segmentation fault"}),
    "loss_nan": ("nan_loss", lambda o: run_ranks(o, "nan", [0, 1]),
                 {"category": "nan_loss", "rank": 1, "line_contains": "loss=nan"}),
    "store_unreachable": ("rendezvous_failure", lambda o: run_ranks(o, "rendezvous", [1]),
                          {"category": "rendezvous_failure", "rank": 1}),
    "stopped_while_hung": ("hang_no_error", lambda o: run_ranks(o, "hang", [0, 1], stop_when=_after_step(3)),
                           {"category": "hang_no_error"}),
    "step_time_x4": ("slowdown", lambda o: run_ranks(o, "slowdown", [0, 1], extra=["--steps", "45"]),
                     {"category": "slowdown"}),
    "clean_run": ("healthy", lambda o: run_ranks(o, "healthy", [0, 1], extra=["--steps", "20"]),
                  {"category": "healthy"}),
}  # fmt: skip


def make(name: str) -> Path:
    cat, run, expected = CASES[name]
    out = HERE / cat / name
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    failures = run(out)
    if failures:
        (out / "failures.json").write_text(
            json.dumps({str(k): v for k, v in failures.items()}, indent=1) + "\n"
        )
    (out / "expected.json").write_text(
        json.dumps({"source": "real run (make_corpus.py)", **expected}, indent=1) + "\n"
    )
    return out


def main(argv: list[str]) -> int:
    names = argv or list(CASES)
    unknown = [n for n in names if n not in CASES]
    if unknown:
        print(f"unknown case(s): {', '.join(unknown)}; known: {', '.join(CASES)}", file=sys.stderr)
        return 2
    for n in names:
        t0 = time.monotonic()
        out = make(n)
        print(f"{n}: {out.relative_to(HERE)} ({time.monotonic() - t0:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
