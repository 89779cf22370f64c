"""The monitors the agent loads, in order. Each module defines:

    add_run_arguments(group: argparse._ArgumentGroup) -> None   # its `trainguard run` flags
    create(options: argparse.Namespace) -> Monitor | None       # None when switched off

Order matters: the profiling monitor feeds step samples that the hang monitor reads, and the
diagnosis and checks monitors fill ctx.extra before the policy decides on a failure.
"""

from __future__ import annotations

import argparse
import importlib
import logging
from types import ModuleType

from trainguard.launch.monitor import Monitor

log = logging.getLogger(__name__)

MONITOR_MODULES = [
    "trainguard.launch.checkpoint_monitor",
    "trainguard.launch.checks_monitor",
    "trainguard.launch.profiling",
    "trainguard.launch.autoinstrument",
    "trainguard.launch.hang",
    "trainguard.launch.diagnosis_monitor",
    "trainguard.launch.slowdown_monitor",
]


def _modules() -> list[ModuleType]:
    mods = []
    for name in MONITOR_MODULES:
        try:
            mods.append(importlib.import_module(name))
        except ModuleNotFoundError as exc:
            if exc.name != name:  # a real missing dependency inside the module: say so
                log.warning("monitor module %s unavailable: %s", name, exc)
    return mods


def add_run_arguments(parser: argparse.ArgumentParser) -> None:
    for mod in _modules():
        fn = getattr(mod, "add_run_arguments", None)
        if fn is not None:
            fn(parser.add_argument_group(mod.__name__.rsplit(".", 1)[-1]))


def create_monitors(options: argparse.Namespace) -> list[Monitor]:
    monitors = []
    for mod in _modules():
        try:
            m = mod.create(options)
        except Exception as exc:  # a broken monitor must not stop the job from starting
            log.error("monitor %s failed to start: %s", mod.__name__, exc)
            continue
        if m is not None:
            monitors.append(m)
    return monitors
