"""Did the kernel's OOM killer kill anything during an attempt? Counters read before and after.

A worker that dies of SIGKILL with a silent log was killed either by the kernel's OOM killer or
from outside (a person, the scheduler, a watchdog). Only the kernel can tell: its ``oom_kill``
counters move when it kills for lack of memory.

- cgroup v2 ``memory.events`` ``oom_kill``: processes of the cgroup (and below) killed by any OOM
  killer, the cgroup's limit or the whole host's;
- cgroup v1 ``memory.oom_control`` ``oom_kill`` (kernel >= 4.13), same meaning;
- ``/proc/vmstat`` ``oom_kill``: every OOM kill on the host (not namespaced: in a container it also
  counts other containers' kills), so it is used only when no cgroup counter can be read.

The cgroups read are the agent's own and the workers' (``/proc/<pid>/cgroup``, taken while the
workers live, so the files can be read again after they died). Parsing functions are pure; the
reader is a few small file reads and never raises.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

CGROUP_ROOT = "/sys/fs/cgroup"
VMSTAT = "/proc/vmstat"


def _field(text: str, name: str) -> int | None:
    for line in text.splitlines():
        key, _, value = line.partition(" ")
        if key == name:
            try:
                return int(value.strip())
            except ValueError:
                return None
    return None


def parse_vmstat(text: str) -> int | None:
    """``oom_kill`` of /proc/vmstat."""
    return _field(text, "oom_kill")


def parse_memory_events(text: str) -> int | None:
    """``oom_kill`` of a cgroup v2 memory.events file."""
    return _field(text, "oom_kill")


def parse_oom_control(text: str) -> int | None:
    """``oom_kill`` of a cgroup v1 memory.oom_control file."""
    return _field(text, "oom_kill")


def counter_files(proc_cgroup: str, root: str = CGROUP_ROOT) -> list[str]:
    """The OOM counter files of the cgroups listed in a /proc/<pid>/cgroup text."""
    out = []
    for line in proc_cgroup.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        path = path.strip()
        if not path.startswith("/") or ".." in path.split("/"):
            continue
        if controllers == "":  # cgroup v2 (unified)
            rel = path.rstrip("/")
            out += [f"{root}{rel}/memory.events", f"{root}/unified{rel}/memory.events"]
        elif "memory" in controllers.split(","):
            out.append(f"{root}/memory{path.rstrip('/')}/memory.oom_control")
    return out


def parse_counter(path: str, text: str) -> int | None:
    if path.endswith("memory.events"):
        return parse_memory_events(text)
    if path.endswith("memory.oom_control"):
        return parse_oom_control(text)
    return parse_vmstat(text)


@dataclass(frozen=True)
class OomCounters:
    values: dict[str, int] = field(default_factory=dict)  # counter file -> oom_kill


@dataclass(frozen=True)
class OomEvidence:
    moved: bool  # the OOM killer killed something in the watched cgroups (or the host) meanwhile
    delta: int
    sources: list[str]  # counters that moved
    checked: list[str]  # counters that could be read before and after

    def to_dict(self) -> dict[str, Any]:
        return {"moved": self.moved, "delta": self.delta, "sources": self.sources, "checked": self.checked}


def _read(path: str) -> str | None:
    try:
        with open(path, encoding="ascii", errors="replace") as f:
            return f.read(1 << 16)
    except OSError:
        return None


def files_for(pids: Iterable[int] = ()) -> list[str]:
    """The counter files to watch: the cgroups of this process and of ``pids``, then /proc/vmstat."""
    files: list[str] = []
    for who in ("self", *(str(int(p)) for p in pids)):
        text = _read(f"/proc/{who}/cgroup")
        for f in counter_files(text or ""):
            if f not in files and os.path.exists(f):
                files.append(f)
    return files + [VMSTAT]


def read_counters(files: Iterable[str]) -> OomCounters:
    values = {}
    for f in files:
        text = _read(f)
        value = parse_counter(f, text) if text is not None else None
        if value is not None:
            values[f] = value
    return OomCounters(values)


def compare(before: OomCounters, after: OomCounters) -> OomEvidence:
    """Evidence from two readings. The cgroup counters decide when any could be read; the host-wide
    vmstat counter only when none could (it also counts other processes' kills)."""
    both = [f for f in before.values if f in after.values]
    moved = [f for f in both if after.values[f] > before.values[f]]
    cgroups = [f for f in both if f != VMSTAT]
    deciding = [f for f in moved if f != VMSTAT] if cgroups else moved
    delta = max((after.values[f] - before.values[f] for f in deciding), default=0)
    return OomEvidence(bool(deciding), delta, deciding, both)
