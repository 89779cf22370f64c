"""Kubernetes: the one-line verdict of a run, written where the kubelet reads it.

A container's last words go to ``/dev/termination-log`` (``terminationMessagePath``); ``kubectl
describe pod`` and the PyTorchJob status show them next to the exit code, whose meaning follows
``trainguard.exitcodes`` (128-255 retryable, 1-127 permanent). See docs/kubernetes.md.
"""

from __future__ import annotations

import os
from pathlib import Path

from trainguard.exitcodes import retryable

TERMINATION_LOG = "/dev/termination-log"
ENV_TERMINATION_LOG = "TRAINGUARD_TERMINATION_LOG"  # another path (tests, other runtimes)
MESSAGE_MAX = 4096  # the kubelet keeps at most 4096 bytes of it


def verdict(code: int, message: str) -> str:
    """``trainguard: exit 200 (retryable): The node is down. ...`` — one line."""
    kind = "ok" if code == 0 else ("retryable" if retryable(code) else "permanent")
    line = f"trainguard: exit {code} ({kind}): {' '.join(message.split())}"
    data = line.encode()[:MESSAGE_MAX]
    return data.decode(errors="ignore")


def termination_log_path(env: dict[str, str] | os._Environ = os.environ) -> Path | None:
    """Where to write the verdict: $TRAINGUARD_TERMINATION_LOG, else /dev/termination-log when it
    exists (only inside a Kubernetes container); None: nowhere."""
    given = env.get(ENV_TERMINATION_LOG)
    if given:
        return Path(given)
    path = Path(TERMINATION_LOG)
    return path if path.exists() else None


def write_verdict(code: int, message: str, path: Path | None) -> str | None:
    """Write the verdict; returns the line written, None when there is nowhere to write or the
    write failed (a full or read-only disk must not change the job's exit code)."""
    if path is None:
        return None
    line = verdict(code, message)
    try:
        path.write_text(line + "\n")
    except OSError:
        return None
    return line
