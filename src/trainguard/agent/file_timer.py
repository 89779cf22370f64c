"""torchrun's file timer for the workers (``TORCHELASTIC_ENABLE_FILE_TIMER=1``), kept as a drop-in.

Under torchrun, LocalElasticAgent starts torch's ``FileTimerServer`` and gives the workers
``TORCHELASTIC_TIMER_FILE`` for ``torch.distributed.elastic.timer.FileTimerClient``; a worker that
overruns ``timer.expires(after=...)`` is killed with its timer's signal. torch's server then
SIGKILLs its own process, the agent, so that the scheduler restarts the job. Here the agent stays:
the expired worker is killed, the expiry is reported (rank, scope), and the policy decides the
restart as for any other failed worker. Two guards torch does not have: only this agent's own
workers are ever signalled (anyone who can write the FIFO names the pid), and the FIFO torch
would put in the shared /tmp lives in a private directory.

Private torch used: ``FileTimerServer._reap_worker(pid, signal) -> bool`` and the ``log_event``
name "kill worker process"; checked on torch 2.13 and 2.14 (torch_compat.CHECKED_ON,
tests/test_torch_compat.py under bench/compat.sh).
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from torch.distributed.elastic.timer import FileTimerRequest, FileTimerServer

log = logging.getLogger(__name__)

ENABLE = "TORCHELASTIC_ENABLE_FILE_TIMER"
TIMER_FILE = "TORCHELASTIC_TIMER_FILE"


class AgentTimerServer(FileTimerServer):
    """torch's FileTimerServer that signals only the agent's workers and never the agent."""

    def __init__(self, file_path: str, run_id: str, workers: Callable[[], set[int]],
                 on_expired: Callable[[int, str, int], None], private_dir: str | None = None) -> None:
        super().__init__(file_path=file_path, run_id=run_id, max_interval=0.1, daemon=True, log_event=self._event)
        self._workers = workers
        self._on_expired = on_expired
        self._private_dir = private_dir

    def _reap_worker(self, worker_pid: int, signal: int) -> bool:
        if worker_pid == os.getpid():
            return True  # torch ends its own process after a reap; the agent carries on and reports
        if worker_pid not in self._workers():
            log.warning("file timer: pid %d is not a worker of this agent: not signalled", worker_pid)
            return True  # dropped, not retried
        return super()._reap_worker(worker_pid, signal)

    def _event(self, name: str, request: FileTimerRequest | None) -> None:
        if name == "kill worker process" and request is not None:
            self._on_expired(request.worker_pid, request.scope_id, request.signal)

    def stop(self) -> None:
        super().stop()
        if self._private_dir:
            shutil.rmtree(self._private_dir, ignore_errors=True)


def start(envs: dict[int, dict[str, str]], workers: Callable[[], set[int]],
          on_expired: Callable[[int, str, int], None]) -> Any:
    """The timer server when the user enabled it (None otherwise), its FIFO path in every
    worker's environment as torch does (also when only the path was given)."""
    path = os.getenv(TIMER_FILE)
    server = None
    if os.getenv(ENABLE) == "1":
        private = None
        if path is None:
            private = tempfile.mkdtemp(prefix="trainguard-timer-")  # 0700: only this user reaches the FIFO
            path = str(Path(private) / "watchdog_timer")
        run_id = next(iter(envs.values()), {}).get("TORCHELASTIC_RUN_ID", "")
        server = AgentTimerServer(path, run_id, workers, on_expired, private)
        server.start()
    if path is not None:
        for env in envs.values():
            env[TIMER_FILE] = path
    return server
