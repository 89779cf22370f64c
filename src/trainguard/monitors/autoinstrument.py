"""Zero-code instrumentation beyond trainguard's worker entry: every Python process of the job.

Workers that ``trainguard run`` starts as Python (a script, ``-m``) are instrumented by its worker
entry. Everything else — ``--no-python`` console scripts (``llamafactory-cli``, ``accelerate``,
``deepspeed``), shell wrappers, scripts that exec or spawn Python — gets trainguard's
``sitecustomize`` through PYTHONPATH (first, the user's entries kept after it), which installs
the same bootstrap in the process of each rank that trains (``trainguard.worker.bootstrap``).
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainguard.monitors.api import Monitor
from trainguard.worker.bootstrap import ENV_OWNER, SITE_DIR


def add_run_arguments(group: argparse._ArgumentGroup) -> None:
    group.add_argument("--auto-instrument", choices=["on", "off"], default="on",
                       help="instrument Python processes trainguard does not start itself (--no-python console "
                       "scripts, wrappers) through a sitecustomize on the workers' PYTHONPATH")  # fmt: skip


@dataclass(frozen=True)
class AutoInstrumentSettings:
    enabled: bool = True  # --auto-instrument on


def settings(options: argparse.Namespace) -> AutoInstrumentSettings:
    return AutoInstrumentSettings(options.auto_instrument != "off")


def create(settings: AutoInstrumentSettings) -> AutoInstrument:
    return AutoInstrument(settings.enabled)


class AutoInstrument(Monitor):
    name = "autoinstrument"

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled

    def worker_env(self, run_dir: Path) -> dict[str, Any]:
        # The owner mark of an enclosing job (trainguard run inside a worker) must not leak in.
        env = {ENV_OWNER: ""}
        if self.enabled:
            user = os.environ.get("PYTHONPATH")
            env["PYTHONPATH"] = SITE_DIR + (os.pathsep + user if user else "")
        return env
