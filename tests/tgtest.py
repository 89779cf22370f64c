"""Shared helpers for tests that run real trainguard jobs: start, wait for conditions, clean up."""

from __future__ import annotations

import importlib.util
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import psutil

from trainguard.events import Event
from trainguard.events.store import read_all

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "train_mlp.py"
SCRIPTS = Path(__file__).resolve().parent / "scripts"


def bench_module(name: str):
    """``bench/<name>.py`` imported as module ``name`` (registered first: its dataclasses look
    their module up by name)."""
    spec = importlib.util.spec_from_file_location(name, REPO / "bench" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)  # type: ignore[union-attr]
    return mod


def require(problem: str | None) -> None:
    """A tool or package the test needs that .ci/run installs: in CI (``CI`` set) its absence is a
    failure; elsewhere (a fresh machine without the Debian packages) the test is skipped with the
    reason. ``problem``: why it cannot run here, None when it can."""
    if problem is None:
        return
    import pytest

    if os.environ.get("CI"):
        pytest.fail(f"{problem} (.ci/run installs it; in CI this test must run)")
    pytest.skip(problem)


@contextmanager
def tmpfs(mnt: Path, size: str) -> Iterator[Path]:
    """A real filesystem of ``size`` (tmpfs, owner-only) mounted at ``mnt`` for the test, unmounted
    after it. Mounting needs root: CI runs as root, so there a failed mount fails the test."""
    mnt.mkdir(exist_ok=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(mnt)],
                          capture_output=True, text=True)
    require(None if done.returncode == 0 else f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False, capture_output=True)


def missing_tools(*names: str) -> str | None:
    """Which of these executables are not on PATH, said as a reason (None: all are)."""
    import shutil

    gone = [n for n in names if shutil.which(n) is None]
    return f"{', '.join(gone)} not installed" if gone else None


DEADLINE = 180.0  # generous: these machines are shared and noisy


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def trainguard_cmd(*args: str | os.PathLike) -> list[str]:
    return [sys.executable, "-m", "trainguard", *map(str, args)]


class Job:
    """A `trainguard ...` process in its own session, killed with everything it started on exit."""

    def __init__(self, args: list, log_path: Path, env: dict[str, str] | None = None, prefix: list[str] | None = None) -> None:
        self.log_path = log_path
        self._log = open(log_path, "wb")  # noqa: SIM115
        full_env = dict(os.environ)
        full_env.update(env or {})
        self.proc = subprocess.Popen(
            [*(prefix or []), *trainguard_cmd(*args)], stdout=self._log, stderr=subprocess.STDOUT, env=full_env, start_new_session=True
        )

    def wait(self, timeout: float = DEADLINE) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"job did not finish in {timeout}s; output:\n{self.output()}") from None

    def output(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")

    def kill(self) -> None:
        # SIGTERM first, as a user would: the agent stops its workers and removes its shared memory.
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass
        kill_tree(self.proc.pid)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pass
        self._log.close()


def kill_tree(pid: int) -> None:
    try:
        parent = psutil.Process(pid)
        procs = [parent, *parent.children(recursive=True)]
    except psutil.NoSuchProcess:
        procs = []
    for p in procs:
        try:
            p.send_signal(signal.SIGCONT)
            p.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(procs, timeout=10)


def wait_for(cond: Callable[[], object], timeout: float = DEADLINE, what: str = "condition", every: float = 0.1):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        got = cond()
        if got:
            return got
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def events(run_dir: Path, kind: str | None = None) -> list[Event]:
    """Every node's events of a run (or of one .db file), in time order."""
    return read_all(run_dir, kinds=[kind] if kind else None)


def wait_event(run_dir: Path, kind: str, timeout: float = DEADLINE, pred: Callable[[Event], bool] = lambda e: True) -> Event:
    return wait_for(lambda: next((e for e in events(run_dir, kind) if pred(e)), None), timeout, f"event {kind}")


def rank_log(run_dir: Path, attempt: int, rank: int) -> Path:
    return run_dir / "logs" / f"attempt-{attempt}" / f"rank-{rank}.log"


def wait_log(path: Path, needle: str, timeout: float = DEADLINE) -> str:
    def found() -> str | None:
        if not path.exists():
            return None
        for line in path.read_text(errors="replace").splitlines():
            if needle in line:
                return line
        return None

    return wait_for(found, timeout, f"{needle!r} in {path}")


def processes_of(run_dir: Path) -> list[psutil.Process]:
    """Live processes that belong to a run (their environment or command line names its run dir)."""
    mine = []
    needle = str(run_dir)
    for p in psutil.process_iter(["pid", "cmdline"]):
        try:
            if p.pid == os.getpid():
                continue
            if any(needle in part for part in (p.info["cmdline"] or [])):
                mine.append(p)
                continue
            if p.environ().get("TRAINGUARD_RUN_DIR", "").startswith(needle):
                mine.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return with_descendants(mine)


def with_descendants(procs: list[psutil.Process]) -> list[psutil.Process]:
    """The processes and all their children (pre-started workers set their env in-process, so
    only ancestry ties them to a run)."""
    seen = {p.pid: p for p in procs}
    for p in procs:
        try:
            for c in p.children(recursive=True):
                seen.setdefault(c.pid, c)
        except psutil.NoSuchProcess:
            continue
    return [p for p in seen.values() if p.pid != os.getpid()]


def alive(procs: list[psutil.Process]) -> list[psutil.Process]:
    """Those still running (is_running also checks the pid was not reused)."""
    return [p for p in procs if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
