"""Exit codes: the ones trainguard's commands return, and names for the ones workers return."""

from __future__ import annotations

import signal

# Kubernetes convention (PyTorchJob/JobSet ``restartPolicy: ExitCode``): 1-127 are permanent (a
# retry would fail the same way), 128-255 retryable (replace the pod, reschedule the job). Signal
# deaths are 128 + signal number (129-192); trainguard's own retryable codes sit above them.
EXIT_OK = 0
EXIT_FAILED = 1  # the job failed: user code, restarts exhausted, or a restart loop (permanent)
EXIT_USAGE = 2  # bad input: one line on stderr, nothing started (permanent)
EXIT_EXCLUDED = 200  # this node left the job (faulty or straggler); an elastic job goes on without it
EXIT_NODE_FAULT = 201  # the job stopped because too few healthy nodes are left (retry elsewhere)
RETRYABLE_MIN = 128  # 128 + SIGTERM = 143: preempted / terminated, retryable as well


def retryable(code: int) -> bool:
    """Whether a scheduler should run the job (or replace the pod) again after this exit code."""
    return RETRYABLE_MIN <= code <= 255


def signal_exit(signum: int) -> int:
    """The exit code of a launcher stopped by a signal (shells' 128 + n): retryable."""
    return RETRYABLE_MIN + int(signum)


def signal_name(exitcode: object, given: object = None) -> str | None:
    """The signal that ended a process, as ``SIGKILL``; None when it exited on its own.

    ``given`` is a name someone already wrote down ("SIGKILL", or "KILL" as some tools print it);
    otherwise a negative exit code is read as torch elastic reports a signal death: ``-signum``.
    A signal number Python does not know is named ``signal <n>``."""
    if isinstance(given, str) and given:
        return given if given.startswith("SIG") or given.startswith("signal ") else f"SIG{given}"
    if isinstance(exitcode, int) and not isinstance(exitcode, bool) and exitcode < 0:
        try:
            return signal.Signals(-exitcode).name
        except ValueError:
            return f"signal {-exitcode}"
    return None


def signal_number(name: str | None) -> int | None:
    """The number of a signal named by ``signal_name``, None when it is not a known signal."""
    if name and name in signal.Signals.__members__:
        return int(signal.Signals[name])
    return None
