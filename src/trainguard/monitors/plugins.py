"""The monitors the agent loads, in order. Each module defines:

    add_run_arguments(group: argparse._ArgumentGroup) -> None             # its `trainguard run` flags
    create(options: argparse.Namespace) -> Monitor | list[Monitor] | None  # None when switched off

``create`` builds the monitor's settings from the parsed flags once (``XSettings.from_options``).
A monitor that cannot start (a bad setting, a missing rules file...) stops the launch with one
line (``MonitorStartError``) — unless the user switched it off, which ``create`` honours first.

Order matters: the profiling monitor feeds step samples that the hang monitor reads.
"""

from __future__ import annotations

import argparse
import importlib
import logging
from types import ModuleType

from trainguard.monitors.api import Monitor
from trainguard.options import SettingsError

log = logging.getLogger(__name__)

MONITOR_MODULES = [
    # first: it subscribes to the event bus in on_before_start, before the checks emit anything
    "trainguard.monitors.metrics",
    "trainguard.monitors.checkpoint",
    "trainguard.monitors.checks",
    "trainguard.monitors.profiling.monitor",
    "trainguard.monitors.autoinstrument",
    "trainguard.monitors.hang.monitor",
    "trainguard.monitors.liveness",
    "trainguard.monitors.diagnosis",
    "trainguard.monitors.slowdown",
    "trainguard.monitors.stacks",
]


class MonitorStartError(Exception):
    """A monitor the user did not switch off cannot start; the message is the launch's error line."""


def _modules() -> list[ModuleType]:
    mods = []
    for name in MONITOR_MODULES:
        try:
            mods.append(importlib.import_module(name))
        except ModuleNotFoundError as exc:
            if exc.name != name:  # a real missing dependency inside the module: say so
                log.warning("monitor module %s unavailable: %s", name, exc)
    return mods


def _name(mod: ModuleType) -> str:
    """The monitor's short name: trainguard.monitors.hang.monitor -> hang, ...monitors.checks -> checks."""
    return mod.__name__.removeprefix("trainguard.monitors.").removesuffix(".monitor")


def add_run_arguments(parser: argparse.ArgumentParser) -> None:
    for mod in _modules():
        fn = getattr(mod, "add_run_arguments", None)
        if fn is not None:
            fn(parser.add_argument_group(_name(mod)))


def create_monitors(options: argparse.Namespace) -> list[Monitor]:
    monitors: list[Monitor] = []
    for mod in _modules():
        try:
            made = mod.create(options)
        except SettingsError as exc:
            raise MonitorStartError(str(exc)) from None
        except Exception as exc:
            raise MonitorStartError(f"monitor {_name(mod)} cannot start: {exc}") from None
        if isinstance(made, Monitor):
            monitors.append(made)
        elif made:
            monitors.extend(made)
    return monitors
