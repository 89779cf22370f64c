"""When a node's last node-check result may stand in for a new run of the check.

``--node-check`` runs the paired GEMM + collective benchmark before workers start, and a recovery
starts workers again: rerunning the whole check (6–20 s on CPU) on every rendezvous round makes
every recovery pay for it. A node keeps its own last *healthy* result and reuses it while nothing
about it changed:

- the result is younger than ``--node-check-reuse`` seconds;
- the node is the same: name, boot (``/proc/sys/kernel/random/boot_id``: a reboot may change
  anything), visible devices and the benchmark's settings (its *fingerprint*);
- the node was not involved in a failure since: its own workers failed first (not of a lost
  peer, not stopped as collateral), or a hardware check found a fault.

Faulty, straggling or undetermined results are never reused. Nodes that must be rechecked run
the check with as many healthy partners (``detect.nodecheck.recheck_nodes``); the others wait for
their verdict through the store.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import time
from dataclasses import dataclass

NEVER_CHECKED = "never checked on this node"


def fingerprint(node: str, config: object) -> str:
    """What about a node must stay the same for its last result to count."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    devices = {k: os.environ.get(k, "") for k in ("CUDA_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES", "ASCEND_VISIBLE_DEVICES")}
    cfg = dataclasses.asdict(config) if dataclasses.is_dataclass(config) else repr(config)  # type: ignore[arg-type]
    blob = json.dumps({"node": node, "boot": boot, "devices": devices, "config": cfg}, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


@dataclass
class NodeCheckMemory:
    """This node's last healthy node-check result and what happened since."""

    reuse_s: float
    healthy_at: float | None = None  # time.monotonic() of the last healthy result
    fingerprint: str = ""
    involved: str = ""  # why this node must be rechecked (set by a failure or a hardware fault)

    def reason_to_check(self, current: str, now: float | None = None) -> str:
        """Why this node must be (re)checked this round; "" when its last result stands."""
        now = time.monotonic() if now is None else now
        if self.healthy_at is None:
            return NEVER_CHECKED
        if self.reuse_s <= 0:
            return "reuse off (--node-check-reuse 0)"
        if self.involved:
            return self.involved
        if current != self.fingerprint:
            return "the node changed since its last check (boot, devices or check settings)"
        age = now - self.healthy_at
        if age > self.reuse_s:
            return f"last checked {age:.0f} s ago (reuse limit {self.reuse_s:g} s)"
        return ""

    def record(self, healthy: bool, current: str, now: float | None = None) -> None:
        """The outcome of a check this node took part in."""
        self.healthy_at = (time.monotonic() if now is None else now) if healthy else None
        self.fingerprint = current
        self.involved = ""

    def involve(self, why: str) -> None:
        if not self.involved:
            self.involved = why
