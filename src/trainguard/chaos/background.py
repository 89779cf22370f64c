"""The part of a chaos injection that lasts: a CPU load, a filled disk, a network fault, a held rank, a
node whose node-check processes die — held
for a bounded time in a detached process, then reverted (``chaos_reverted`` event).

Run as ``python -m trainguard.chaos.background SPEC_JSON``; ``start`` does that. Every loop is
bounded by the spec's duration (at most ``MAX_DURATION_S``); SIGTERM reverts early.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from trainguard.rundir import chaos_hold as hold

MAX_DURATION_S = 3600.0
FILL_CHUNK = 16 << 20


def start(spec: dict[str, Any], log_path: Path) -> int:
    """Start the detached holder; its pid.

    The holder starts with SIGTERM blocked (a signal mask survives fork and exec) and unblocks it
    only once its handler is in place: a SIGTERM sent while its interpreter still imports stays
    pending instead of killing it by default, which would leave the fault in place unreverted."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    was = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    try:
        with open(log_path, "ab") as log:
            proc = subprocess.Popen(
                [sys.executable, "-m", "trainguard.chaos.background", json.dumps(spec)],
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            )  # fmt: skip
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, was)
    return proc.pid


class _Stop(Exception):
    pass


def _on_term(signum: int, frame: object) -> None:
    raise _Stop


def cpu_load(cpu: int | None, percent: float, until: float) -> None:
    """Busy ``percent`` of every 100 ms on ``cpu`` (the rank's core), until ``until``."""
    if cpu is not None:
        os.sched_setaffinity(0, {cpu})
    period, busy = 0.1, 0.1 * percent / 100
    while time.monotonic() < until:
        start = time.monotonic()
        while time.monotonic() - start < busy:
            pass
        time.sleep(max(0.0, period - (time.monotonic() - start)))


def fill_disk(path: Path, size: int, leave: int, until: float) -> int:
    """Write ``path`` until ``size`` bytes, or until only ``leave`` bytes are free (or the disk is
    full); hold until ``until``. Bytes written."""
    written = 0
    chunk = b"\0" * FILL_CHUNK
    with open(path, "wb") as f:
        while written < size:
            free = os.statvfs(path.parent).f_bavail * os.statvfs(path.parent).f_frsize
            n = min(FILL_CHUNK, size - written, max(0, free - leave))
            if n <= 0:
                break
            try:
                f.write(chunk[:n])
                f.flush()
                os.fsync(f.fileno())
            except OSError:  # ENOSPC: as full as it gets
                break
            written += n
    while time.monotonic() < until:
        time.sleep(min(0.5, max(0.0, until - time.monotonic())))
    return written


def kill_nodechecks(agent: int, agent_created: float, until: float) -> int:
    """SIGKILL every node-check process the agent starts, until ``until`` or the agent ends; how many."""
    import psutil

    from trainguard.chaos.targets import nodecheck_processes

    killed: set[int] = set()
    while time.monotonic() < until:
        try:
            if abs(psutil.Process(agent).create_time() - agent_created) > 0.05:
                break  # the pid is another process now
        except psutil.Error:
            break  # the agent ended: nothing more to kill
        for pid in nodecheck_processes(agent):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)  # each leads its own session
                killed.add(pid)
        time.sleep(0.1)
    return len(killed)


def _run(cmd: list[str]) -> None:
    subprocess.run(cmd, capture_output=True, timeout=30, check=False)


def main(spec: dict[str, Any]) -> None:

    signal.signal(signal.SIGTERM, _on_term)
    until = time.monotonic() + min(float(spec["duration"]), MAX_DURATION_S)
    fault, detail = spec["fault"], ""
    try:
        with contextlib.suppress(_Stop):
            # `start` handed SIGTERM down blocked: one sent meanwhile is delivered here, where it reverts.
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
            if fault == "slow":
                cpu_load(spec.get("cpu"), float(spec["percent"]), until)
            elif fault == "hang":  # the agent holds the rank while the request is there
                while time.monotonic() < until and hold.request_path(Path(spec["run_dir"]), spec["rank"]).exists():
                    time.sleep(min(0.5, max(0.0, until - time.monotonic())))
            elif fault == "nodecheck-kill":
                detail = f"{kill_nodechecks(int(spec['agent']), float(spec['agent_created']), until)} node-check process(es) killed"
            elif fault == "fill-disk":
                detail = f"{fill_disk(Path(spec['file']), int(spec['size']), int(spec['leave']), until)} bytes written"
            else:  # network faults: the change is made already, hold it
                while time.monotonic() < until:
                    time.sleep(min(0.5, max(0.0, until - time.monotonic())))
    finally:
        if fault == "fill-disk":
            with contextlib.suppress(OSError):
                os.unlink(spec["file"])
        for cmd in spec.get("revert", []):
            _run(cmd)
        # A hold that ended already (the rank was restarted) was reported by the agent.
        if fault != "hang" or hold.withdraw(Path(spec["run_dir"]), spec["rank"], spec["id"]):
            _reverted(spec, detail)


def _reverted(spec: dict[str, Any], detail: str) -> None:
    from trainguard.chaos import event_db
    from trainguard.events import EventBus, EventStore

    store = EventStore(event_db(spec["run_dir"]))
    try:
        EventBus(store, node=spec["node"]).emit(
            "chaos_reverted", f"chaos {spec['fault']} on {spec['node']} reverted {detail}".strip(),
            rank=spec.get("rank"), evidence={"fault": spec["fault"], "injection": spec["id"]},
        )  # fmt: skip
    finally:
        store.close()


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
