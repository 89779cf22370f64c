"""Pre-started worker processes: torch is imported before a worker is needed.

A restart then costs a fork-free hand-over (write one JSON line) instead of a fresh interpreter
importing torch — most of the 2–4 s a plain torchrun restart takes. Spare processes are spawned
from one long-lived thread: they use PR_SET_PDEATHSIG, which fires when the *thread* that forked
them exits, so they must not be created from short-lived threads.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import subprocess
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from trainguard.launch.logs import RankLog, start_pumps

log = logging.getLogger(__name__)


@dataclass
class WorkerProcess:
    proc: subprocess.Popen
    output: RankLog
    prestarted: bool
    pumps: list[threading.Thread] = field(default_factory=list)

    def assign(self, spec: dict) -> None:
        if not self.prestarted:
            return
        assert self.proc.stdin is not None
        self.proc.stdin.write((json.dumps(spec) + "\n").encode())
        self.proc.stdin.flush()
        self.proc.stdin.close()


def _popen(argv: list[str], env: dict[str, str], with_stdin: bool) -> WorkerProcess:
    proc = subprocess.Popen(
        argv,
        env=env,
        stdin=subprocess.PIPE if with_stdin else subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,  # its own process group: killpg reaches its children too
    )
    out = RankLog()
    wp = WorkerProcess(proc=proc, output=out, prestarted=with_stdin)
    wp.pumps = start_pumps(proc.stdout, proc.stderr, out)  # type: ignore[arg-type]
    return wp


def _python_argv(python: str) -> list[str]:
    return [python, "-u", "-m", "trainguard.launch.worker_main"]


class WorkerPool:
    """Keeps ``size`` pre-started workers ready. ``take(n)`` never waits for imports to finish:
    a process that is still importing simply reads its assignment when done."""

    def __init__(self, size: int, python: str = sys.executable, enabled: bool = True) -> None:
        self.size = size if enabled else 0
        self.python = python
        self._ready: list[WorkerProcess] = []
        self._lock = threading.Lock()
        self._jobs: queue.Queue[Callable[[], None] | None] = queue.Queue()
        self._closed = False
        self._thread = threading.Thread(target=self._spawner, name="trainguard-prestart", daemon=True)
        self._thread.start()
        if self.size:
            self._jobs.put(lambda: self._refill(self.size))

    def _spawner(self) -> None:
        # Every process is created on this one thread (see the module docstring).
        while (job := self._jobs.get()) is not None:
            job()

    def _on_spawner(self, fn: Callable[[], WorkerProcess]) -> WorkerProcess:
        reply: queue.Queue = queue.Queue()

        def job() -> None:
            try:
                reply.put(fn())
            except Exception as exc:
                reply.put(exc)

        self._jobs.put(job)
        got = reply.get()
        if isinstance(got, Exception):
            raise got
        return got

    def _prestart_one(self) -> WorkerProcess:
        return _popen([*_python_argv(self.python), "--prestart"], dict(os.environ), True)

    def _refill(self, count: int) -> None:
        for _ in range(count):
            if self._closed:
                return
            try:
                wp = self._prestart_one()
            except OSError as exc:
                log.warning("could not pre-start a worker: %s", exc)
                return
            with self._lock:
                self._ready.append(wp)

    def take(self, count: int) -> list[WorkerProcess]:
        with self._lock:
            for dead in (w for w in self._ready if w.proc.poll() is not None):
                dead.output.close()
            alive = [w for w in self._ready if w.proc.poll() is None]
            got, self._ready = alive[:count], alive[count:]
        while len(got) < count:
            got.append(self._on_spawner(self._prestart_one))
        if self.size:
            self._jobs.put(lambda: self._refill(min(count, self.size)))  # background refill
        return got

    def spawn_direct(self, spec: dict) -> WorkerProcess:
        """A worker without pre-start (pre-start off, or a non-Python entrypoint)."""
        if spec.get("binary"):
            argv = [spec["binary"], *[str(a) for a in spec.get("args", [])]]
        else:
            argv = [*_python_argv(self.python), json.dumps(spec)]
        return self._on_spawner(lambda: _popen(argv, spec["env"], False))

    def close(self) -> None:
        self._closed = True
        self._jobs.put(None)
        self._thread.join(timeout=10)
        with self._lock:
            spare, self._ready = self._ready, []
        for w in spare:
            _kill_group(w.proc)
            w.output.close()


def _kill_group(proc: subprocess.Popen) -> None:
    import signal

    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        pass
