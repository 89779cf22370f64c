"""The channel of `trainguard chaos hang`: hold requests in the run dir, answered by the agent.

``trainguard chaos`` cannot reach a worker's ring itself (the agent unlinks its name once mapped),
so, like the profiling switch, it leaves a request in the run dir that the rank's agent reads on
its profiling thread (never the workers: they only test a bit of their ring's flag word, which the
agent sets) and answers:

    RUN_DIR/chaos/hang-r<rank>.json   {"id": ..., "rank": R, "pid": P}  while the rank is to be held
    RUN_DIR/chaos/hang-r<rank>.ack    {"id": ..., "held": bool, "why": ...}  the agent's answer

``pid`` is the worker the request was made for: the hold ends with it (a restarted rank is not held
again). Removing the request releases the rank. Files are replaced atomically.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

from trainguard import runfiles

CHAOS_DIR = "chaos"
_REQUEST = re.compile(r"hang-r(\d+)\.json")


@dataclass(frozen=True)
class HoldRequest:
    id: str
    rank: int
    pid: int


def chaos_dir(run_dir: Path) -> Path:
    return Path(run_dir) / CHAOS_DIR


def request_path(run_dir: Path, rank: int) -> Path:
    return chaos_dir(run_dir) / f"hang-r{rank}.json"


def ack_path(run_dir: Path, rank: int) -> Path:
    return chaos_dir(run_dir) / f"hang-r{rank}.ack"


def _write(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with runfiles.replace(path) as f:  # never through a symlink, never into a FIFO
        f.write((json.dumps(data) + "\n").encode())


def _read(path: Path) -> dict | None:
    try:
        data = json.loads(runfiles.read_text(path, 1 << 20))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def request(run_dir: Path, req: HoldRequest) -> None:
    ack_path(run_dir, req.rank).unlink(missing_ok=True)  # an older answer must not be taken for this one's
    _write(request_path(run_dir, req.rank), {"id": req.id, "rank": req.rank, "pid": req.pid})


def withdraw(run_dir: Path, rank: int, req_id: str | None = None) -> bool:
    """Remove the rank's request (only if it is ``req_id``'s, when given): the rank goes on.
    True when this call removed it."""
    path = request_path(run_dir, rank)
    if req_id is not None:
        data = _read(path)
        if data is None or data.get("id") != req_id:
            return False
    try:
        path.unlink()
    except FileNotFoundError:
        return False
    ack_path(run_dir, rank).unlink(missing_ok=True)
    return True


def pending(run_dir: Path) -> dict[int, HoldRequest]:
    """Every hold request in the run dir, by rank (unreadable ones skipped)."""
    out: dict[int, HoldRequest] = {}
    try:
        names = os.listdir(chaos_dir(run_dir))
    except OSError:
        return out
    for name in names:
        m = _REQUEST.fullmatch(name)
        data = _read(chaos_dir(run_dir) / name) if m else None
        if data is None:
            continue
        try:
            out[int(m.group(1))] = HoldRequest(str(data["id"]), int(data["rank"]), int(data["pid"]))
        except (KeyError, TypeError, ValueError):
            continue
    return out


def answer(run_dir: Path, req: HoldRequest, held: bool, why: str = "") -> None:
    _write(ack_path(run_dir, req.rank), {"id": req.id, "held": held, "why": why})


def answered(run_dir: Path, rank: int, req_id: str) -> dict | None:
    """The agent's answer to request ``req_id`` (None: not yet)."""
    data = _read(ack_path(run_dir, rank))
    return data if data is not None and data.get("id") == req_id else None


NODECHECK_HOLD = "nodecheck-hold"


def nodecheck_hold_path(run_dir: Path) -> Path:
    """While this file exists the job's node-check processes wait, their group up, before they
    measure (at most their timeout): a drill (``trainguard chaos nodecheck-kill``) then finds them
    alive however short the check is. Removing it lets them go on."""
    return chaos_dir(run_dir) / NODECHECK_HOLD
