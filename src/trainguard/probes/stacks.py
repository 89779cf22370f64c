"""Python stacks of running workers through py-spy (`py-spy dump --json`), without touching them.

By default py-spy pauses a process for a few milliseconds with ptrace to read a consistent stack;
that fails on a process that is already stopped (SIGSTOP) and touches a worker that may be healthy.
We read with ``--nonblocking`` first (memory reads only, the worker is never paused: a hung
worker's stack does not change anyway) and fall back to a pausing read only when a busy worker's
stack came out torn. Every call has a timeout and runs as a subprocess, so a wedged py-spy cannot
wedge the caller.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainguard.probes.proc import read_state


@dataclass(frozen=True)
class Frame:
    name: str
    filename: str
    line: int

    def __str__(self) -> str:
        return f"{self.name} ({self.filename}:{self.line})"


@dataclass(frozen=True)
class ThreadStack:
    thread_id: int
    name: str
    active: bool  # py-spy's view: running (not idle/waiting)
    owns_gil: bool
    frames: tuple[Frame, ...]  # innermost first, as py-spy prints them
    os_tid: int = 0  # the kernel task (/proc/<pid>/task/<os_tid>); 0 when py-spy did not say


@dataclass
class StackDump:
    rank: int
    pid: int
    state: str  # /proc state letter when dumped ("" = process gone)
    threads: list[ThreadStack] = field(default_factory=list)
    error: str | None = None
    nonblocking: bool = False

    def main_thread(self) -> ThreadStack | None:
        for t in self.threads:
            if t.name == "MainThread":
                return t
        return self.threads[0] if self.threads else None


def pyspy_path() -> str | None:
    """py-spy from PATH, or the one installed beside this Python (a venv not on PATH)."""
    found = shutil.which("py-spy")
    if found:
        return found
    beside = Path(sys.executable).with_name("py-spy")
    return str(beside) if beside.exists() and os.access(beside, os.X_OK) else None


def parse_pyspy_json(text: str) -> list[ThreadStack]:
    """Threads from `py-spy dump --json` output. Raises ValueError on anything else."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"py-spy output is not JSON: {exc}") from None
    if not isinstance(data, list):
        raise ValueError("py-spy JSON is not a list of threads")
    threads = []
    for t in data:
        if not isinstance(t, dict):
            continue
        frames = tuple(
            Frame(str(f.get("name", "?")), str(f.get("filename", "?")), int(f.get("line") or 0))
            for f in t.get("frames") or []
            if isinstance(f, dict)
        )
        threads.append(
            ThreadStack(
                thread_id=int(t.get("thread_id") or 0),
                name=str(t.get("thread_name") or ""),
                active=bool(t.get("active")),
                owns_gil=bool(t.get("owns_gil")),
                frames=frames,
                os_tid=int(t.get("os_thread_id") or 0),
            )
        )
    return threads


def _run_pyspy(exe: str, pid: int, nonblocking: bool, timeout: float) -> tuple[list[ThreadStack] | None, str | None]:
    cmd = [exe, "dump", "--pid", str(pid), "--json"]
    if nonblocking:
        cmd.append("--nonblocking")
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        return None, f"py-spy timed out after {timeout:g}s"
    except OSError as exc:
        return None, f"py-spy could not run: {exc}"
    if out.returncode != 0:
        lines = [ln for ln in (out.stderr or out.stdout).splitlines() if ln.strip()]
        # The first lines say what failed; the rest is py-spy's own backtrace.
        return None, " / ".join(lines[:3]) or f"py-spy exit code {out.returncode}"
    try:
        return parse_pyspy_json(out.stdout), None
    except ValueError as exc:
        return None, str(exc)


def dump_stack(rank: int, pid: int, timeout: float = 10.0, exe: str | None = None) -> StackDump:
    """One worker's stacks. Never raises: failures are in ``StackDump.error``."""
    state = read_state(pid)
    dump = StackDump(rank=rank, pid=pid, state=state)
    if not state:
        dump.error = "process is gone"
        return dump
    exe = exe or pyspy_path()
    if exe is None:
        dump.error = "py-spy is not installed"
        return dump
    # Non-blocking first: it only reads the worker's memory and never pauses it, so a dump cannot
    # disturb a job that turns out to be healthy (or one in the middle of exiting). A hung worker's
    # stack does not move, so the read is consistent where it matters.
    threads, error = _run_pyspy(exe, pid, nonblocking=True, timeout=timeout)
    dump.nonblocking = True
    if threads is None and state not in ("T", "t"):
        # A torn read of a busy worker: pause it for the few milliseconds of a consistent read.
        retry, error2 = _run_pyspy(exe, pid, nonblocking=False, timeout=timeout)
        if retry is not None:
            threads, error, dump.nonblocking = retry, None, False
        else:
            error = f"{error}; blocking: {error2}"
        dump.state = read_state(pid) or state
    dump.threads = threads or []
    dump.error = error
    return dump


def dump_all(pids: dict[int, int], timeout: float = 10.0) -> dict[int, StackDump]:
    """global rank -> stacks, dumped in parallel (a hung job's workers all at about the same moment)."""
    if not pids:
        return {}
    exe = pyspy_path()
    with ThreadPoolExecutor(max_workers=min(16, len(pids)), thread_name_prefix="trainguard-pyspy") as pool:
        futures = {rank: pool.submit(dump_stack, rank, pid, timeout, exe) for rank, pid in pids.items()}
        return {rank: fut.result() for rank, fut in sorted(futures.items())}


def to_dict(dump: StackDump) -> dict[str, Any]:
    """JSON-friendly form for events (frames as 'name (file:line)' strings, innermost first)."""
    return {
        "rank": dump.rank,
        "pid": dump.pid,
        "state": dump.state,
        "error": dump.error,
        "nonblocking": dump.nonblocking,
        "threads": [
            {"name": t.name, "active": t.active, "owns_gil": t.owns_gil, "frames": [str(f) for f in t.frames]}
            for t in dump.threads
        ],
    }


def format_dict(d: dict[str, Any], where: str = "") -> list[str]:
    """Readable lines for one rank's dump in ``to_dict`` form (innermost frame first)."""
    state = d.get("state") or "gone"
    how = ", read without pausing it" if d.get("nonblocking") else ""
    lines = [f"=== rank {d.get('rank')} ({where}pid {d.get('pid')}, state {state}{how}) ==="]
    if d.get("error"):
        lines.append(f"  stack unavailable: {d['error']}")
    for t in d.get("threads") or []:
        flags = ", ".join(f for f, on in (("active", t.get("active")), ("holds GIL", t.get("owns_gil"))) if on) or "idle"
        lines.append(f"  Thread {t.get('name') or '?'} ({flags}):")
        lines += [f"      {fr}" for fr in t.get("frames") or []]
    return lines
