"""A worker that starts a daemon holding its stdout/stderr, then exits 0 at once.

The daemon is a new session (``setsid``) that inherits the worker's output pipes, as a user's
``subprocess.Popen([...], start_new_session=True)`` without redirects, or a double fork with
``os.setsid()``, does. It outlives the worker (``--seconds``); its pid goes to ``--pid-dir``.
``--how popen`` (default) or ``fork``."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path


def by_popen(seconds: int) -> int:
    return subprocess.Popen(["sleep", str(seconds)], start_new_session=True).pid


def by_fork(seconds: int) -> int:
    r, w = os.pipe()
    if os.fork() == 0:  # the daemon: own session, the worker's stdout/stderr still open
        os.close(r)
        os.setsid()
        os.write(w, str(os.getpid()).encode())
        os.close(w)
        time.sleep(seconds)
        os._exit(0)
    os.close(w)
    return int(os.read(r, 32))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--pid-dir", required=True)
    p.add_argument("--seconds", type=int, default=300)
    p.add_argument("--how", choices=("popen", "fork"), default="popen")
    a = p.parse_args()
    pid = (by_popen if a.how == "popen" else by_fork)(a.seconds)
    rank = os.environ.get("RANK", "0")
    path = Path(a.pid_dir) / f"daemon-{rank}.pid"
    path.write_text(str(pid))
    print(f"rank {rank} started daemon {pid}", flush=True)
    sys.exit(0)


if __name__ == "__main__":
    main()
