"""Spare worker processes with torch already imported, so a (re)start does not wait for imports.

Two ways to have them (``--prestart-workers``):

- ``on`` (default): a zygote (spawn/zygote.py) imports torch once; spares are forked from it in
  milliseconds and replenished right after every start, so a failure soon after a restart finds
  spares as ready as the first one did. If the zygote cannot be used (it did not become ready,
  or something in it started a thread, which makes forking unsafe) the pool says so in the agent
  log and falls back to the next way.
- ``spawn``: fresh interpreters (``worker_main --prestart``) that import torch themselves and wait.
  A restart that comes before they finish importing waits for them.

A spare waits on its stdin for its assignment (one JSON line). Processes are created from one
long-lived thread: PR_SET_PDEATHSIG fires when the *thread* that forked a process exits, so the
zygote and the spawned spares must not be created from short-lived threads.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import signal
import subprocess
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass

from trainguard.spawn.logs import Pumps, RankLog, start_pumps
from trainguard.spawn.zygote import Zygote, ZygoteChild, ZygoteError, take_early

log = logging.getLogger(__name__)

MODES = ("on", "spawn", "off")


@dataclass
class WorkerProcess:
    proc: subprocess.Popen | ZygoteChild
    output: RankLog
    prestarted: bool
    pumps: Pumps | None = None

    def assign(self, spec: dict) -> None:
        if not self.prestarted:
            return
        assert self.proc.stdin is not None
        self.proc.stdin.write((json.dumps(spec) + "\n").encode())
        self.proc.stdin.flush()
        self.proc.stdin.close()


def _with_pumps(proc: subprocess.Popen | ZygoteChild, prestarted: bool) -> WorkerProcess:
    out = RankLog()
    wp = WorkerProcess(proc=proc, output=out, prestarted=prestarted)
    wp.pumps = start_pumps(proc.stdout, proc.stderr, out)  # type: ignore[arg-type]
    return wp


def _popen(argv: list[str], env: dict[str, str], with_stdin: bool) -> WorkerProcess:
    proc = subprocess.Popen(
        argv,
        env=env,
        stdin=subprocess.PIPE if with_stdin else subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,  # its own process group: killpg reaches its children too
    )
    return _with_pumps(proc, with_stdin)


def _python_argv(python: str) -> list[str]:
    return [python, "-u", "-m", "trainguard.spawn.worker_main"]


class WorkerPool:
    """Keeps ``size`` spare workers ready (``mode`` on/spawn; off: none, every worker is started
    when needed). ``take(n)`` never waits for a spawned spare's imports: a process still importing
    reads its assignment when done."""

    def __init__(self, size: int, python: str = sys.executable, mode: str = "on") -> None:
        if mode not in MODES:
            raise ValueError(f"prestart mode {mode!r}: expected one of {', '.join(MODES)}")
        self.mode = mode
        self.size = size if mode != "off" else 0
        self.python = python
        self.zygote: Zygote | None = None
        self._ready: list[WorkerProcess] = []
        self._lock = threading.Lock()
        self._jobs: queue.Queue[Callable[[], None] | None] = queue.Queue()
        self._closed = False
        self._thread = threading.Thread(target=self._spawner, name="trainguard-prestart", daemon=True)
        self._thread.start()
        early = take_early(python)
        if mode == "on" and self.size:
            if early is not None:
                self.zygote = early  # started before the agent's imports (cold start)
            else:
                self._jobs.put(self._start_zygote)
        elif early is not None:
            early.close()
        if self.size:
            self._jobs.put(self._refill)

    def _spawner(self) -> None:
        # Every process is created on this one thread (see the module docstring).
        while (job := self._jobs.get()) is not None:
            job()

    def _on_spawner(self, fn: Callable[[], object]) -> object:
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

    # ---- making spares ----------------------------------------------------------------------
    def _start_zygote(self) -> None:
        try:
            self.zygote = Zygote(self.python, dict(os.environ))
        except OSError as exc:
            self._zygote_failed(str(exc))

    def _zygote_failed(self, why: str) -> None:
        log.warning("worker zygote unavailable (%s): spare workers are started as fresh processes", why)
        zygote, self.zygote = self.zygote, None
        if zygote is not None:
            zygote.close()

    def _prestart_one(self) -> WorkerProcess:
        if self._closed:
            raise OSError("the worker pool is closed")
        zygote = self.zygote
        if zygote is not None:
            try:
                return _with_pumps(zygote.fork(), True)
            except ZygoteError as exc:
                self._zygote_failed(str(exc))
        return _popen([*_python_argv(self.python), "--prestart"], dict(os.environ), True)

    def _refill(self) -> None:
        """Top the spares up to ``size``."""
        while not self._closed:
            with self._lock:
                if len(self._ready) >= self.size:
                    return
            try:
                wp = self._prestart_one()
            except OSError as exc:
                log.warning("could not pre-start a worker: %s", exc)
                return
            with self._lock:
                self._ready.append(wp)

    def _pop_ready(self, count: int) -> list[WorkerProcess]:
        zygote = self.zygote
        if zygote is not None and zygote.proc.poll() is not None:
            # Its spares die with it (their death signal); its reader may not have noticed yet.
            self._zygote_failed(f"the zygote process ended with {zygote.proc.returncode}")
            with self._lock:
                for w in self._ready:
                    if isinstance(w.proc, ZygoteChild):
                        _kill_group(w.proc)
                        w.output.close()
                self._ready = [w for w in self._ready if not isinstance(w.proc, ZygoteChild)]
        with self._lock:
            for dead in (w for w in self._ready if w.proc.poll() is not None):
                dead.output.close()
            alive = [w for w in self._ready if w.proc.poll() is None]
            got, self._ready = alive[:count], alive[count:]
        return got

    def take(self, count: int) -> list[WorkerProcess]:
        def job() -> list[WorkerProcess]:
            # On the spawner thread, after any refill already queued: at a cold start this waits
            # for the zygote's first spares instead of making extra ones beside them.
            got = self._pop_ready(count)
            while len(got) < count:
                got.append(self._prestart_one())
            return got

        got = self._on_spawner(job)
        if self.size:
            self._jobs.put(self._refill)  # in the background: the next failure finds spares ready
        return got  # type: ignore[return-value]

    def spawn_direct(self, spec: dict) -> WorkerProcess:
        """A worker without pre-start (pre-start off, or a non-Python entrypoint)."""
        if spec.get("binary"):
            argv = [spec["binary"], *[str(a) for a in spec.get("args", [])]]
        else:
            argv = [*_python_argv(self.python), json.dumps(spec)]
        return self._on_spawner(lambda: _popen(argv, spec["env"], False))  # type: ignore[return-value]

    def spare_pids(self) -> list[int]:
        with self._lock:
            return [w.proc.pid for w in self._ready]

    def close(self) -> None:
        self._closed = True
        self._jobs.put(None)
        self._thread.join(timeout=10)
        with self._lock:
            spare, self._ready = self._ready, []
        for w in spare:
            _kill_group(w.proc)
            w.output.close()
        if self.zygote is not None:
            self.zygote.close()


def _kill_group(proc: subprocess.Popen | ZygoteChild) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        pass
