"""NVIDIA Xid errors from the kernel log (`/dev/kmsg`), where the container may read it.

NVML has no history of Xid errors (only a live event stream), so the driver's kernel log lines
``NVRM: Xid (PCI:0000:3b:00): 79, pid=..., GPU has fallen off the bus.`` are the record.
"""

from __future__ import annotations

import errno
import os
import re
from dataclasses import dataclass

# Xids that mean the hardware (or its driver state) is broken, rather than a bug in the
# application (13, 31, 43 are usually the program's own illegal memory access / fault).
HARDWARE_XIDS: dict[int, str] = {
    48: "double-bit ECC error",
    61: "internal micro-controller breakpoint",
    62: "internal micro-controller halt",
    63: "ECC page retirement / row remapping event",
    64: "ECC page retirement / row remapping failure",
    74: "NVLink error",
    79: "GPU has fallen off the bus",
    92: "high single-bit ECC error rate",
    94: "contained ECC error",
    95: "uncontained ECC error",
    119: "GSP RPC timeout",
    120: "GSP error",
    140: "unrecovered ECC error",
}

_XID = re.compile(r"NVRM: Xid \((?P<pci>[^)]*)\):\s*(?P<xid>\d+)(?:,\s*(?P<rest>.*))?")
MAX_RECORDS = 200_000  # bound the read of a huge ring buffer


@dataclass(frozen=True)
class XidEvent:
    xid: int
    pci: str
    text: str
    age_s: float | None  # seconds before now, when the record had a timestamp

    @property
    def hardware(self) -> bool:
        return self.xid in HARDWARE_XIDS


def parse_kmsg_record(record: str, now_us: float | None) -> XidEvent | None:
    """One /dev/kmsg record ``prio,seq,usec,flags;message`` -> XidEvent, or None if not an Xid."""
    header, sep, message = record.partition(";")
    if not sep:
        header, message = "", record
    m = _XID.search(message)
    if m is None:
        return None
    age = None
    fields = header.split(",")
    if now_us is not None and len(fields) >= 3 and fields[2].isdigit():
        age = max(0.0, (now_us - int(fields[2])) / 1e6)
    return XidEvent(int(m["xid"]), m["pci"], (m["rest"] or "").strip(), age)


def _uptime_us() -> float | None:
    try:
        with open("/proc/uptime") as f:
            return float(f.read().split()[0]) * 1e6
    except (OSError, ValueError, IndexError):
        return None


def read_xids(path: str = "/dev/kmsg", window_s: float | None = None) -> list[XidEvent] | None:
    """Xid events in the kernel ring buffer (within the last ``window_s`` seconds if given).

    None when the log cannot be read (no /dev/kmsg in the container, or no permission)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError:
        return None
    now_us = _uptime_us()
    out: list[XidEvent] = []
    try:
        for _ in range(MAX_RECORDS):
            try:
                raw = os.read(fd, 8192)
            except BlockingIOError:
                break  # end of the buffer
            except OSError as exc:
                if exc.errno == errno.EPIPE:  # record overwritten while reading: go on
                    continue
                if exc.errno == errno.EPERM and not out:
                    return None
                break
            if not raw:
                break
            ev = parse_kmsg_record(raw.decode(errors="replace").rstrip("\n"), now_us)
            if ev is not None and (window_s is None or ev.age_s is None or ev.age_s <= window_s):
                out.append(ev)
    finally:
        os.close(fd)
    return out
