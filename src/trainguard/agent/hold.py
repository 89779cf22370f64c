"""`--hold-on-failure MINUTES`: keep a failed node's agent (and so, under a scheduler, its
allocation) alive for inspection — what seed 003 does with `sleep 10000` at the end of the start
command. The workers are already stopped; the node, its logs, /dev/shm and GPU state stay
reachable. SIGTERM or Ctrl-C ends the hold early (a scheduler cancelling the job still can).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from torch.distributed.elastic.multiprocessing.api import SignalException

from trainguard.events import EventBus, Severity


def hold(minutes: float, bus: EventBus, run_dir: Path, state: str) -> str:
    """Block for ``minutes`` or until a signal; returns how it ended ("timeout" or the signal)."""
    until = time.time() + minutes * 60.0
    bus.emit(
        "node_held",
        f"job {state} on {bus.node}: holding this node for inspection for {minutes:g} min "
        f"(until {time.strftime('%H:%M:%S', time.localtime(until))}, agent pid {os.getpid()}); "
        f"logs and reports in {run_dir}; SIGTERM or Ctrl-C ends the hold",
        severity=Severity.WARNING,
        evidence={"minutes": minutes, "until": until, "pid": os.getpid(), "state": state},
    )
    how = "timeout"
    try:
        while (left := until - time.time()) > 0:
            time.sleep(min(left, 1.0))
    except SignalException as exc:
        how = exc.sigval.name
    except KeyboardInterrupt:
        how = "SIGINT"
    bus.emit("hold_ended", f"hold on {bus.node} ended ({how})", evidence={"ended_by": how, "state": state})
    return how
