"""Per-rank log files: every line of a worker's stdout/stderr, timestamped and rank-prefixed.

A pump thread per pipe reads the worker's output, writes
``2026-11-21T09:30:01.123456 [rank1]: <text>`` to ``RUN_DIR/logs/attempt-<n>/rank-<rank>.log``
and tees it to the agent's console. Pipes are attached when a pre-started process is created;
the rank is only known later, so output before that goes to the agent log. A carriage return ends
a line too: progress bars (tqdm in HF Trainer, LLaMA-Factory, Accelerate) rewrite one line with
``\r``, and each update is a timestamped step-time reading while the bar still runs (the slowdown
monitor follows them live); on the console such a line still ends with ``\r``.
"""

from __future__ import annotations

import logging
import re
import sys
import threading
from datetime import datetime
from pathlib import Path
from typing import IO

log = logging.getLogger("trainguard.worker_output")

MAX_LINE = 1 << 20  # longer output without a line end is written in pieces of this size
_EOL = re.compile(rb"\r\n|\r|\n")


def attempt_dir(run_dir: Path, attempt: int) -> Path:
    return run_dir / "logs" / f"attempt-{attempt}"


def rank_log_path(run_dir: Path, attempt: int, rank: int) -> Path:
    return attempt_dir(run_dir, attempt) / f"rank-{rank}.log"


def error_file_path(run_dir: Path, attempt: int, rank: int) -> Path:
    return attempt_dir(run_dir, attempt) / f"error-{rank}.json"


def stamp() -> str:
    return datetime.now().strftime("%Y-%m-%dT%H:%M:%S.%f")


class RankLog:
    """Destination of one worker's output. Thread-safe; opened lazily once the rank is known."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._file: IO[str] | None = None
        self._prefix = "[pending]: "
        self._tee = False
        self.path: Path | None = None

    def assign(self, path: Path, rank: int, tee: bool) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        with self._lock:
            self._file = open(path, "a", encoding="utf-8", errors="replace", buffering=1)  # noqa: SIM115
            self._prefix = f"[rank{rank}]: "
            self._tee = tee
            self.path = path

    def write_line(self, text: str, stream: IO[str], end: str = "\n") -> None:
        with self._lock:
            if self._file is None:
                log.info("%s%s", self._prefix, text)
                return
            try:
                self._file.write(f"{stamp()} {self._prefix}{text}\n")
            except (OSError, ValueError) as exc:  # disk full: keep the job running, say so once
                log.warning("could not write %s: %s", self.path, exc)
            if self._tee:
                try:
                    stream.write(f"{self._prefix}{text}{end}")
                    stream.flush()
                except (OSError, ValueError):
                    pass

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                try:
                    self._file.close()
                except OSError:
                    pass
                self._file = None


def pump(pipe: IO[bytes], dest: RankLog, stream: IO[str]) -> None:
    """Copy lines from a worker pipe until EOF. Runs on its own daemon thread."""
    buf = b""
    try:
        while chunk := pipe.read1(1 << 16):  # type: ignore[attr-defined]
            buf = _write_lines(buf + chunk, dest, stream)
    except (OSError, ValueError):
        pass
    finally:
        if buf.rstrip(b"\r"):
            dest.write_line(buf.rstrip(b"\r").decode("utf-8", errors="replace"), stream)
        try:
            pipe.close()
        except OSError:
            pass


def _write_lines(buf: bytes, dest: RankLog, stream: IO[str]) -> bytes:
    """Write the complete lines in ``buf``; return what is left (an unfinished line)."""
    start = 0
    for m in _EOL.finditer(buf):
        if m.group() == b"\r" and m.end() == len(buf):
            break  # maybe the first half of \r\n: wait for the next chunk
        text = buf[start : m.start()]
        start = m.end()
        if m.group() == b"\r" and not text:
            continue  # a bar cleared before it is redrawn: nothing to record
        dest.write_line(text.decode("utf-8", errors="replace"), stream, "\r" if m.group() == b"\r" else "\n")
    rest = buf[start:]
    while len(rest) > MAX_LINE:
        dest.write_line(rest[:MAX_LINE].decode("utf-8", errors="replace"), stream)
        rest = rest[MAX_LINE:]
    return rest


def start_pumps(stdout: IO[bytes], stderr: IO[bytes], dest: RankLog) -> list[threading.Thread]:
    threads = []
    for pipe, stream, name in ((stdout, sys.stdout, "out"), (stderr, sys.stderr, "err")):
        t = threading.Thread(target=pump, args=(pipe, dest, stream), name=f"trainguard-log-{name}", daemon=True)
        t.start()
        threads.append(t)
    return threads


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
