"""A stop signal (SIGTERM, SIGINT, SIGUSR1, ...) the agent got, kept until the run loop acts on it.

The agent's signal handler raises torch's ``SignalException`` wherever the main thread is, as
torch elastic's own agent does. If that happens inside a ``try/except Exception`` (a monitor
guarding a store call, the policy, a log scan), the exception is swallowed and the stop is lost:
a preempted node would go on training until SIGKILL, its snapshot never persisted. So the handler
also records the signal here, and the agent's loop and every monitor call raise it again.
"""

from __future__ import annotations

from torch.distributed.elastic.multiprocessing.api import SignalException

_pending: SignalException | None = None


def record(exc: SignalException) -> None:
    global _pending
    _pending = exc


def raise_pending() -> None:
    """Raise the recorded stop signal again (nothing when none came, or it was handled)."""
    if _pending is not None:
        raise _pending


def handled() -> None:
    """The run is stopping because of the signal: nothing to raise again."""
    global _pending
    _pending = None
