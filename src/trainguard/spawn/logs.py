"""Log files of a run: every line of a worker's stdout/stderr, timestamped and rank-prefixed, and
the agent's own log. Neither stops the job, nor floods the console, when the disk is full.

A pump thread per pipe reads the worker's output, writes
``2026-11-21T09:30:01.123456 [rank1]: <text>`` to ``RUN_DIR/logs/attempt-<n>/rank-<rank>.log``
and tees it to the agent's console. Pipes are attached when a process is created; the rank is
only known a moment later (``RankLog.assign``), so lines that come before are held and written
once it is known: a ``--no-python`` worker that prints one line and exits at once loses nothing.
Where torchrun would write its own per-rank files (``--redirects``/``--tee`` under ``--log-dir``)
the pump writes them too (``Route``). A carriage return ends
a line too: progress bars (tqdm in HF Trainer, LLaMA-Factory, Accelerate) rewrite one line with
``\r``, and each update is a timestamped step-time reading while the bar still runs (the slowdown
monitor follows them live); on the console such a line still ends with ``\r``.
"""

from __future__ import annotations

import io
import logging
import os
import re
import select
import sys
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import IO

from trainguard import runfiles

log = logging.getLogger("trainguard.worker_output")  # the agent log only (see agent/console.py)
disk_log = logging.getLogger("trainguard.logs")  # on the console too

MAX_LINE = 1 << 20  # longer output without a line end is written in pieces of this size
MAX_HELD = 10_000  # lines held before the rank is known; past this they go to the agent log
_EOL = re.compile(rb"\r\n|\r|\n")


def attempt_dir(run_dir: Path, attempt: int) -> Path:
    return run_dir / "logs" / f"attempt-{attempt}"


def rank_log_path(run_dir: Path, attempt: int, rank: int) -> Path:
    return attempt_dir(run_dir, attempt) / f"rank-{rank}.log"


def error_file_path(run_dir: Path, attempt: int, rank: int) -> Path:
    return attempt_dir(run_dir, attempt) / f"error-{rank}.json"


def finished_file_path(run_dir: Path, attempt: int, rank: int) -> Path:
    """Written by a worker whose training script returned (or exited 0): whatever ends the process
    after that (a crash in interpreter teardown) happened once its work was done."""
    return attempt_dir(run_dir, attempt) / f"finished-{rank}.json"  # .json: log scanners skip it


def stamp() -> str:
    return datetime.now().strftime("%Y-%m-%dT%H:%M:%S.%f")


@dataclass(frozen=True)
class Route:
    """Where a worker's output goes besides its rank log, as torchrun's flags say: the console per
    stream ("out", "err"; off for a stream redirected without tee, or a rank --local-ranks-filter
    leaves out), torch's own per-rank files per stream (``<log-dir>/<run>/attempt_<n>/<local
    rank>/stdout.log``), and the console prefix (TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE)."""

    console: frozenset[str] = frozenset({"out", "err"})
    files: dict[str, Path] = field(default_factory=dict)
    prefix: str | None = None  # None: "[rank<N>]: "


class RankLog:
    """Destination of one worker's output. Thread-safe; opened once the rank is known
    (``assign``). Lines that come before are held (``hold``; the zygote's own output is not: it
    has no rank and goes to the agent log as it comes).

    A line that cannot be written (disk full) is counted, never retried: the first failure is said
    once on the console, and when writing works again the file gets one line saying how many lines
    are missing, so a reader of the log knows it has a hole."""

    def __init__(self, hold: bool = True) -> None:
        self._lock = threading.Lock()
        self._file: IO[bytes] | None = None
        self._files: dict[str, IO[bytes]] = {}  # torch's per-stream files (Route.files)
        self._prefix = "[pending]: "
        self._console_prefix = self._prefix
        self._console: frozenset[str] = frozenset()
        self._assigned = False
        self._closed = False
        self._hold = hold
        self._held: list[tuple[str, IO[str], str, str]] = []
        self._lost = 0  # lines not written since the last successful write
        self._said = False
        self.path: Path | None = None

    def assign(self, path: Path, rank: int, tee: bool, route: Route | None = None) -> None:
        route = route or Route()
        f = _open_append(path, rank)
        files = {which: g for which, p in route.files.items() if (g := _open_append(p, rank)) is not None}
        with self._lock:
            self._file = f
            self._files = files
            self._prefix = f"[rank{rank}]: "
            self._console_prefix = self._prefix if route.prefix is None else route.prefix
            self._console = route.console if tee else frozenset()
            self.path = path
            self._assigned = True
            held, self._held = self._held, []
            for text, stream, end, which in held:
                self._emit(text, stream, end, which)

    def write_line(self, text: str, stream: IO[str], end: str = "\n", which: str = "out") -> None:
        with self._lock:
            if self._assigned and not self._closed:
                self._emit(text, stream, end, which)
            elif self._hold and not self._closed and len(self._held) < MAX_HELD:
                self._held.append((text, stream, end, which))  # the rank comes in a moment
            else:
                log.info("%s%s", self._prefix, text)

    def _emit(self, text: str, stream: IO[str], end: str, which: str) -> None:
        if self._file is None:
            log.info("%s%s", self._prefix, text)
        else:
            self._write(f"{stamp()} {self._prefix}{text}\n")
        raw = self._files.get(which)
        if raw is not None:
            try:
                raw.write(f"{text}{end}".encode("utf-8", errors="replace"))
            except (OSError, ValueError):
                pass  # torch's copy; the rank log above is the one that says when lines are missing
        if which in self._console:
            try:
                stream.write(f"{self._console_prefix}{text}{end}")
                stream.flush()
            except (OSError, ValueError):
                pass

    def _write(self, line: str) -> None:
        assert self._file is not None
        try:
            if self._lost:
                self._file.write(f"{stamp()} {self._prefix}[trainguard] {self._lost} line(s) of this rank were not "
                                 f"written here (disk full)\n".encode())
                self._lost = 0
            self._file.write(line.encode("utf-8", errors="replace"))
        except (OSError, ValueError) as exc:  # disk full: keep the job running, say so once
            self._lost += 1
            if not self._said:
                self._said = True
                disk_log.warning("cannot write %s: %s; later lines of this rank that cannot be written are counted "
                                 "and the count is written once there is room", self.path, getattr(exc, "strerror", None) or exc)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            held, self._held = self._held, []
            for text, _stream, _end, _which in held:  # a spare that never got a rank
                log.info("%s%s", self._prefix, text)
            for f in [self._file, *self._files.values()]:
                if f is not None:
                    try:
                        f.close()
                    except OSError:
                        pass
            self._file = None
            self._files = {}


def _open_append(path: Path, rank: int) -> IO[bytes] | None:
    try:
        runfiles.private_dirs(path.parent)
        return open(_private_append(path), "ab", buffering=0)  # noqa: SIM115 - one write per line, nothing held back
    except OSError as exc:
        disk_log.warning("cannot open %s: %s; rank %d's output goes only to the agent log", path, exc.strerror or exc, rank)
        return None


def _private_append(path: Path) -> int:
    """An fd to append to ``path``, created owner-only whatever the umask (logs hold the job's output)."""
    return os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)


class AgentLogHandler(logging.FileHandler):
    """``agent-<node>.log``. Each record is written straight through (nothing is held in a buffer
    that a full disk would make grow); a record that cannot be written is dropped and said once on
    stderr, instead of logging's traceback for every record."""

    def __init__(self, path: Path) -> None:
        self._failing = False  # said; said again after a write worked
        self._this_failed = False
        super().__init__(path, encoding="utf-8")

    def _open(self):  # type: ignore[override]
        raw = open(_private_append(Path(self.baseFilename)), "ab", buffering=0)  # noqa: SIM115 - owned by the handler
        return io.TextIOWrapper(raw, encoding="utf-8", errors="replace", write_through=True)

    def emit(self, record: logging.LogRecord) -> None:
        self._this_failed = False
        super().emit(record)  # calls handleError on failure
        if not self._this_failed:
            self._failing = False

    def handleError(self, record: logging.LogRecord) -> None:  # noqa: N802 - logging's name
        self._this_failed = True
        if self._failing:
            return
        self._failing = True
        exc = sys.exc_info()[1]
        why = getattr(exc, "strerror", None) or exc
        try:
            sys.stderr.write(f"[trainguard] cannot write the agent log {self.baseFilename}: {why}; its lines are "
                             "dropped until it can (the console goes on)\n")
            sys.stderr.flush()
        except (OSError, ValueError):
            pass


def pump(pipe: IO[bytes], dest: RankLog, stream: IO[str], which: str = "out", wake: int | None = None,
         drained: threading.Event | None = None) -> None:
    """Copy lines from a worker pipe until EOF. Runs on its own daemon thread.

    ``wake``: the read end of a pipe that becomes readable when the agent asks the pump to stop
    waiting for EOF (``Pumps.stop``): what the pipe holds then is copied, ``drained`` is set, and
    the pump goes on reading whatever a process outside the worker's group (a daemon that kept the
    worker's stdout) writes later, until EOF or the agent's exit, into what ``dest`` does with
    lines once closed (the agent log): the daemon is neither blocked on a full pipe nor killed by
    SIGPIPE while the agent lives."""
    fd = pipe.fileno()
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    if wake is not None:
        poller.register(wake, select.POLLIN)
    buf = b""
    try:
        while True:
            ready = {f for f, _ in poller.poll()}
            if wake is not None and wake in ready:
                poller.unregister(wake)
                wake = None
                buf, ended = _drain(fd, buf, dest, stream, which)
                buf = _flush(buf, dest, stream, which)
                if drained is not None:
                    drained.set()
                if ended:
                    break
            elif ready:
                chunk = os.read(fd, 1 << 16)
                if not chunk:
                    break
                buf = _write_lines(buf + chunk, dest, stream, which)
    except (OSError, ValueError):
        pass
    finally:
        _flush(buf, dest, stream, which)
        try:
            pipe.close()
        except OSError:
            pass
        if drained is not None:
            drained.set()


def _drain(fd: int, buf: bytes, dest: RankLog, stream: IO[str], which: str) -> tuple[bytes, bool]:
    """Copy what the pipe holds now, without waiting for more. Returns the unfinished line and
    whether EOF was reached."""
    ready = select.poll()  # not select(): an agent of many workers has descriptors past FD_SETSIZE
    ready.register(fd, select.POLLIN)
    while ready.poll(0):
        chunk = os.read(fd, 1 << 16)
        if not chunk:
            return buf, True
        buf = _write_lines(buf + chunk, dest, stream, which)
    return buf, False


def _flush(buf: bytes, dest: RankLog, stream: IO[str], which: str) -> bytes:
    """Write an unfinished line as it is (the writer is gone, or no longer waited for)."""
    if buf.rstrip(b"\r"):
        dest.write_line(buf.rstrip(b"\r").decode("utf-8", errors="replace"), stream, "\n", which)
    return b""


def _write_lines(buf: bytes, dest: RankLog, stream: IO[str], which: str) -> bytes:
    """Write the complete lines in ``buf``; return what is left (an unfinished line)."""
    start = 0
    for m in _EOL.finditer(buf):
        if m.group() == b"\r" and m.end() == len(buf):
            break  # maybe the first half of \r\n: wait for the next chunk
        text = buf[start : m.start()]
        start = m.end()
        if m.group() == b"\r" and not text:
            continue  # a bar cleared before it is redrawn: nothing to record
        dest.write_line(text.decode("utf-8", errors="replace"), stream, "\r" if m.group() == b"\r" else "\n", which)
    rest = buf[start:]
    while len(rest) > MAX_LINE:
        dest.write_line(rest[:MAX_LINE].decode("utf-8", errors="replace"), stream, "\n", which)
        rest = rest[MAX_LINE:]
    return rest


class Pumps:
    """The pump threads of one process's stdout and stderr.

    A pipe reaches EOF once every process holding its write end is gone. The agent kills the
    worker's process group, but a daemon the worker started in a session of its own
    (``start_new_session=True``, ``os.setsid()``) keeps the worker's stdout open and the pipe
    never ends while it lives: ``stop`` makes the pumps copy what is there and stop waiting, and
    ``held`` says which pipes are still open (``inodes``: the pipes' inode numbers, by which the
    processes holding them are found in /proc)."""

    def __init__(self, stdout: IO[bytes], stderr: IO[bytes], dest: RankLog) -> None:
        self._wake_r, self._wake_w = os.pipe()  # closed by the last pump to end
        self._lock = threading.Lock()
        self._stopped = False
        self._live = 2
        self.inodes: dict[str, int] = {}
        self._drained: dict[str, threading.Event] = {}
        self._threads: dict[str, threading.Thread] = {}
        for pipe, stream, name in ((stdout, sys.stdout, "out"), (stderr, sys.stderr, "err")):
            self.inodes[name] = os.fstat(pipe.fileno()).st_ino
            self._drained[name] = threading.Event()
            t = threading.Thread(target=self._run, args=(pipe, dest, stream, name), name=f"trainguard-log-{name}", daemon=True)
            t.start()
            self._threads[name] = t

    def _run(self, pipe: IO[bytes], dest: RankLog, stream: IO[str], name: str) -> None:
        try:
            pump(pipe, dest, stream, name, self._wake_r, self._drained[name])
        finally:
            with self._lock:
                self._live -= 1
                if self._live == 0:
                    os.close(self._wake_r)
                    os.close(self._wake_w)
                    self._wake_w = -1

    def wait(self, deadline: float) -> bool:
        """Wait until both pipes ended or were drained after ``stop``, or the monotonic deadline."""
        for ev in self._drained.values():
            ev.wait(timeout=max(0.0, deadline - time.monotonic()))
        return all(ev.is_set() for ev in self._drained.values())

    def stop(self) -> None:
        """Copy what the pipes hold now and stop waiting for their EOF."""
        with self._lock:
            if not self._stopped and self._wake_w >= 0:
                self._stopped = True
                os.write(self._wake_w, b"x")

    def held(self) -> dict[str, int]:
        """The pipes (stream -> inode) still open for writing after ``stop`` drained them."""
        return {n: self.inodes[n] for n, t in self._threads.items() if self._drained[n].is_set() and t.is_alive()}


def start_pumps(stdout: IO[bytes], stderr: IO[bytes], dest: RankLog) -> Pumps:
    return Pumps(stdout, stderr, dest)


def tail(path: Path | None, lines: int = 20, max_bytes: int = 64 * 1024) -> list[str]:
    """The last lines of a log file (bounded read)."""
    if path is None or not path.exists():
        return []
    try:
        with open(path, "rb") as f:
            f.seek(0, 2)
            size = f.tell()
            f.seek(max(0, size - max_bytes))
            data = f.read().decode("utf-8", errors="replace")
    except OSError:
        return []
    return data.splitlines()[-lines:]
