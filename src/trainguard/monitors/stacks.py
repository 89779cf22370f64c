"""Answers `trainguard stacks` requests: this node's workers' Python stacks, written into the run dir.

A background thread looks for request files (rundir/stack_requests.py) about once a second — one
directory listing — and answers each with py-spy dumps of this node's current workers. Dumping
never pauses a worker (probes/stacks.py), so answering is safe for a healthy job.
"""

from __future__ import annotations

import logging
import threading
import time

from trainguard.monitors.api import Monitor, MonitorContext
from trainguard.probes import stacks
from trainguard.rundir import stack_requests as req

log = logging.getLogger(__name__)

TICK_S = 1.0
STACK_TIMEOUT_S = 10.0


def create(settings: None) -> Monitor:  # no settings of its own
    return StacksMonitor()


class StacksMonitor(Monitor):
    name = "stacks"

    def __init__(self, tick_s: float = TICK_S) -> None:
        self.tick_s = tick_s
        self._ctx: MonitorContext | None = None
        self._answered: set[str] = set()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def on_workers_started(self, ctx: MonitorContext) -> None:
        self._ctx = ctx
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="trainguard-stacks", daemon=True)
            self._thread.start()

    def on_workers_stopped(self, ctx: MonitorContext) -> None:
        self._ctx = None  # no workers to dump until the next start

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=STACK_TIMEOUT_S + 5)

    def _loop(self) -> None:
        while not self._stop.wait(self.tick_s):
            try:
                self.answer_pending()
            except Exception as exc:  # never let a bad request file take the thread down
                log.warning("stacks: could not answer a request: %s", exc)

    def answer_pending(self) -> int:
        ctx = self._ctx
        if ctx is None:
            return 0
        answered = 0
        for d in req.pending(ctx.run_dir, ctx.node, self._answered, time.time()):
            self._answered.add(d.name)
            dumps = stacks.dump_all(ctx.pids(), timeout=STACK_TIMEOUT_S)
            if req.write_answer(d, ctx.node, ctx.restart_count, [stacks.to_dict(x) for x in dumps.values()]):
                answered += 1
                log.info("stacks: answered request %s with %d rank(s)", d.name, len(dumps))
        return answered

