"""Asking every node's agent for its workers' stacks through the run directory.

A run directory on a shared filesystem is the one thing every node of a job sees, so a request is
a file in it and each agent answers beside it (atomic writes; nothing listens on the network)::

    RUN_DIR/stacks/<id>/request.json        {"id", "time", "nodes": [names] or null for all}
    RUN_DIR/stacks/<id>/answer-<node>.json  {"node", "time", "attempt", "dumps": [probes.stacks.to_dict ...]}

Agents answer requests younger than ``MAX_AGE_S`` that they have not answered yet.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import time
from pathlib import Path
from typing import Any

from trainguard import runfiles

STACKS_DIR = "stacks"
REQUEST = "request.json"
MAX_AGE_S = 120.0


def safe_node(node: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", node) or "node"


def _write_json(path: Path, data: dict[str, Any]) -> None:
    with runfiles.replace(path) as f:  # never through a symlink, never into a FIFO
        f.write(json.dumps(data, default=str).encode())


def _read_json(path: Path) -> Any:
    """A request's or answer's JSON; OSError or ValueError for anything else (a FIFO would block)."""
    return json.loads(runfiles.read_text(path, 64 << 20))


def write_request(run_dir: Path, nodes: list[str] | None) -> Path:
    rid = time.strftime("%Y%m%d-%H%M%S") + "-" + secrets.token_hex(3)
    d = Path(run_dir) / STACKS_DIR / rid
    d.mkdir(parents=True)
    _write_json(d / REQUEST, {"id": rid, "time": time.time(), "nodes": nodes})
    return d


def pending(run_dir: Path, node: str, answered: set[str], now: float) -> list[Path]:
    """Request dirs this node should answer now."""
    root = Path(run_dir) / STACKS_DIR
    try:
        entries = list(os.scandir(root))
    except (FileNotFoundError, NotADirectoryError):
        return []
    out = []
    for entry in entries:
        if entry.name in answered or not entry.is_dir():
            continue
        try:
            req = _read_json(Path(entry.path) / REQUEST)
        except (OSError, ValueError):
            continue  # not complete yet, or not ours
        if not isinstance(req, dict) or not isinstance(req.get("time", 0), int | float) \
                or now - float(req.get("time", 0)) > MAX_AGE_S:
            continue
        nodes = req.get("nodes")
        if nodes is not None and (not isinstance(nodes, list) or node not in nodes):
            continue
        if (Path(entry.path) / f"answer-{safe_node(node)}.json").exists():
            continue
        out.append(Path(entry.path))
    return out


def write_answer(request_dir: Path, node: str, attempt: int, dumps: list[dict[str, Any]]) -> bool:
    """False when the request is gone (the asker stopped waiting and cleaned up)."""
    if not request_dir.is_dir():
        return False
    try:
        _write_json(request_dir / f"answer-{safe_node(node)}.json",
                    {"node": node, "time": time.time(), "attempt": attempt, "dumps": dumps})
    except FileNotFoundError:
        return False
    return True


def read_answers(request_dir: Path) -> dict[str, dict[str, Any]]:
    """node -> its answer, for the answers complete so far."""
    out = {}
    for p in request_dir.glob("answer-*.json"):
        try:
            data = _read_json(p)
        except (OSError, ValueError):
            continue
        if isinstance(data, dict) and isinstance(data.get("node"), str):
            out[data["node"]] = data
    return out
