"""One job per node on a run dir: an exclusive lock on ``RUN_DIR/agent-<node>.lock``.

Two jobs on one run dir would load each other's live checkpoints and write the same steps, logs
and events. The agent takes an exclusive ``flock`` on its node's lock file for its whole life; the
kernel releases it when the agent ends, however it ends (SIGKILL included), so a stale file never
blocks the next run. Several nodes (agents with their own ``--node-name``) share one run dir on a
shared filesystem: each has its own lock. The holder writes who it is into the file, so a refused
job can name it (pid, node, host, start time).
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote

log = logging.getLogger(__name__)


class RunDirBusy(Exception):
    """Another job holds this node's lock on the run dir."""


def lock_path(run_dir: Path, node: str) -> Path:
    return Path(run_dir) / f"agent-{quote(node, safe='')}.lock"


@dataclass
class RunDirLock:
    path: Path
    fd: int | None

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)  # closing the file releases the flock
            self.fd = None


def _holder(fd: int) -> str:
    """Who holds the lock, as its holder wrote it (best effort: it may be writing it right now)."""
    try:
        d = json.loads(os.pread(fd, 4096, 0).decode(errors="replace") or "{}")
        started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(d["started"])))
        return f"pid {int(d['pid'])} on host {d['host']} (node {d['node']}), started {started}"
    except (OSError, ValueError, KeyError, TypeError, OverflowError):
        return "a job that has not said who it is yet"


def acquire(run_dir: Path, node: str) -> RunDirLock:
    """Lock the run dir for this node, or raise RunDirBusy naming the job that holds it. A
    filesystem without locks (some Lustre mounts) is said once and not locked."""
    path = lock_path(run_dir, node)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            who = _holder(fd)
            os.close(fd)
            raise RunDirBusy(
                f"run dir {run_dir} is in use by another job on node {node}: {who}. Wait for it to end, or "
                f"use another --run-dir (or --node-name, when it is another node of the same job)"
            ) from None
        os.close(fd)
        log.warning("cannot lock %s (%s): a second job on this run dir and node would not be refused", path,
                    exc.strerror or exc)
        return RunDirLock(path, None)
    me = {"pid": os.getpid(), "node": node, "host": socket.gethostname(), "started": time.time()}
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(me).encode(), 0)
    except OSError:  # a full disk: the lock holds all the same, the refused job just cannot name us
        pass
    return RunDirLock(path, fd)
