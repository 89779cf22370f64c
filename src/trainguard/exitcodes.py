"""Exit codes: the ones trainguard's commands return, and names for the ones workers return."""

from __future__ import annotations

import signal

EXIT_OK = 0
EXIT_FAILED = 1  # the job failed (or a check found a fault)
EXIT_USAGE = 2  # bad input: one line on stderr, nothing started
EXIT_EXCLUDED = 4  # this node left the job (faulty or straggler); an elastic job goes on without it


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
