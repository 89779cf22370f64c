"""The monitors the agent loads, in order. Each module defines:

    add_run_arguments(group: argparse._ArgumentGroup) -> None   # its `trainguard run` flags
    settings(options: argparse.Namespace) -> XSettings           # its typed settings (optional)
    create(settings: XSettings | None) -> Monitor | list[Monitor] | None  # None when switched off

``settings`` reads the monitor's flags once, from the run's settings builder
(agent/settings.py, through ``read_settings``); ``create`` gets that object only, never the
command line. A bad setting stops the command with one line (``SettingsError``); a monitor that
cannot start (a missing rules file...) stops the launch with one line (``MonitorStartError``) —
unless the user switched it off, which ``settings`` and ``create`` honour first.

Order matters: the profiling monitor feeds step samples that the hang monitor reads.
"""

from __future__ import annotations

import argparse
import importlib
import logging
from collections.abc import Mapping
from types import ModuleType
from typing import Any

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


def read_settings(options: argparse.Namespace) -> dict[str, Any]:
    """Each monitor's settings object, by monitor name (None for one without settings). Called
    once, by the run's settings builder; raises SettingsError (one line)."""
    out: dict[str, Any] = {}
    for mod in _modules():
        fn = getattr(mod, "settings", None)
        try:
            out[_name(mod)] = fn(options) if fn is not None else None
        except SettingsError:
            raise
        except Exception as exc:
            raise SettingsError(f"monitor {_name(mod)} cannot start: {exc}") from None
    return out


def create_monitors(settings: Mapping[str, Any]) -> list[Monitor]:
    """The monitors, each built from its own settings (``read_settings``)."""
    monitors: list[Monitor] = []
    for mod in _modules():
        try:
            made = mod.create(settings.get(_name(mod)))
        except SettingsError as exc:
            raise MonitorStartError(str(exc)) from None
        except Exception as exc:
            raise MonitorStartError(f"monitor {_name(mod)} cannot start: {exc}") from None
        if isinstance(made, Monitor):
            monitors.append(made)
        elif made:
            monitors.extend(made)
    return monitors
