"""Stands in for the agent in checkpoint tests: runs the checkpoint monitor in its own process.

Prints one JSON line with the worker environment, then polls the monitor until stdin closes (or
it is killed, which is what the tests do to it), then closes the monitor.
Usage: checkpoint_agent.py RUN_DIR CKPT_DIR SHM_ROOT WRITE_LIMIT_MB_S
"""

from __future__ import annotations

import json
import sys
import threading
from pathlib import Path

from trainguard.events import EventBus, EventStore
from trainguard.monitors.api import MonitorContext, StepTracker
from trainguard.monitors.checkpoint import CheckpointMonitor


def main() -> None:
    run_dir, ckpt_dir, shm_root, limit = Path(sys.argv[1]), sys.argv[2], sys.argv[3], float(sys.argv[4])
    mon = CheckpointMonitor(ckpt_dir=ckpt_dir, keep=3, shm_root=shm_root, write_limit_mb_s=limit)
    bus = EventBus(EventStore(run_dir), node="agent-test")
    ctx = MonitorContext(
        run_dir=run_dir,
        node="agent-test",
        node_rank=0,
        nnodes=1,
        nproc_per_node=1,
        world_size=1,
        restart_count=0,
        workers=[],
        events=bus,
        steps=StepTracker(),
    )
    print(json.dumps(mon.worker_env(run_dir)), flush=True)
    mon.on_workers_started(ctx)
    stop = threading.Event()
    threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
    while not stop.wait(0.1):
        mon.poll(ctx)
    mon.close()


if __name__ == "__main__":
    main()
