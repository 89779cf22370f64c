"""Kubernetes: the one-line verdict of a run, written where the kubelet reads it.

A container's last words go to ``/dev/termination-log`` (``terminationMessagePath``); ``kubectl
describe pod`` and the PyTorchJob status show them next to the exit code, whose meaning follows
``trainguard.exitcodes`` (128-255 retryable, 1-127 permanent). See docs/kubernetes.md.

Also the restart budget of ModelArts' ``fault-tolerance/job-retry-num`` pod annotation, read from
the downward API file when no --max-restarts is given.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path

from trainguard.exitcodes import retryable
from trainguard.options import SettingsError

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


# ---------------------------------------------------------------- the restart budget annotation

POD_ANNOTATIONS = "/etc/podinfo/annotations"  # the downward API volume's usual mount
ENV_POD_ANNOTATIONS = "TRAINGUARD_POD_ANNOTATIONS"  # another path (tests, other mounts)
RETRY_ANNOTATION = "fault-tolerance/job-retry-num"  # ModelArts: how often a failed job is re-dispatched
RETRY_RANGE = range(1, 4)  # 1-3; absent: 0


def annotations_path(env: Mapping[str, str] = os.environ) -> Path:
    return Path(env.get(ENV_POD_ANNOTATIONS) or POD_ANNOTATIONS)


def read_annotations(path: Path) -> dict[str, str]:
    """The pod's annotations as the kubelet writes them in a downward API file: ``key="value"``
    a line, the value quoted as Go's %q does. A missing file is no annotations."""
    try:
        text = path.read_text(errors="replace")
    except (FileNotFoundError, NotADirectoryError):
        return {}
    except OSError as exc:
        raise SettingsError(f"cannot read the pod annotations {path}: {exc.strerror or exc}") from None
    found: dict[str, str] = {}
    for line in text.splitlines():
        key, sep, value = line.partition("=")
        if sep:
            found[key.strip()] = _unquote(value.strip())
    return found


def _unquote(value: str) -> str:
    if len(value) >= 2 and value[0] == value[-1] == '"':
        try:
            return str(json.loads(value))  # Go's %q of plain text is a JSON string
        except ValueError:
            return value[1:-1]
    return value


def restart_budget(env: Mapping[str, str] = os.environ) -> tuple[int, str]:
    """(restarts, where it came from) from the ``fault-tolerance/job-retry-num`` annotation: an
    integer 1-3, absent 0. Anything else is refused (SettingsError): a typo must not quietly turn
    fault tolerance off."""
    path = annotations_path(env)
    value = read_annotations(path).get(RETRY_ANNOTATION)
    if value is None:
        return 0, ""
    if value.strip() not in {str(n) for n in RETRY_RANGE}:
        raise SettingsError(f"pod annotation {RETRY_ANNOTATION}={value!r} in {path}: expected an integer 1-3")
    return int(value), f"{RETRY_ANNOTATION}={int(value)} in {path}"
