"""A stop signal (SIGTERM, SIGINT, SIGUSR1, ...) the agent got, kept until the run loop acts on it.

The agent's signal handler raises torch's ``SignalException`` wherever the main thread is, as
torch elastic's own agent does. If that happens inside a ``try/except Exception`` (a monitor
guarding a store call, the policy, a log scan), the exception is swallowed and the stop is lost:
a preempted node would go on training until SIGKILL, its snapshot never persisted. So the handler
also records the signal here, and the agent's loop and every monitor call raise it again.

torch's ``PContext.start`` registers its own handler (``_terminate_process_handler``, which raises
the same exception but records nothing) for the stop signals each time workers start; a signal
caught by it inside a broad except was lost for good (seen: a SIGINT during a monitor's
``Thread.start`` right after the workers started surfaced as a KeyError, reported as a monitor
error, and the agent trained on). ``reclaim()``, called as the workers start, gives those signals
back to the agent's handler.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable
from typing import Any

from torch.distributed.elastic.multiprocessing.api import SignalException

_pending: SignalException | None = None
_handler: Callable[[int, Any], None] | None = None  # the agent's: raises and records


def set_handler(handler: Callable[[int, Any], None]) -> None:
    """The agent's stop-signal handler, which ``reclaim`` puts back over torch's."""
    global _handler
    _handler = handler


def reclaim() -> list[int]:
    """Give every signal torch's ``PContext.start`` took (its handler on it) back to the agent's
    handler; the signals given back. Nothing while a stop is under way (the agent's handler then
    ignores further stop signals on purpose), off the main thread, or before ``set_handler``."""
    if _handler is None or _pending is not None or threading.current_thread() is not threading.main_thread():
        return []
    from torch.distributed.elastic.multiprocessing import api

    torch_handler = getattr(api, "_terminate_process_handler", None)
    back = []
    for sig in signal.valid_signals():
        try:
            if torch_handler is not None and signal.getsignal(sig) is torch_handler:
                signal.signal(sig, _handler)
                back.append(int(sig))
        except (OSError, ValueError):
            continue
    return back


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
