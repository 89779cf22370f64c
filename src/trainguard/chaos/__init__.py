"""Rehearse failures on a running job (``trainguard chaos``) and test beds of several "nodes"."""

from __future__ import annotations

import socket
from pathlib import Path

from trainguard.events.store import node_db_path


def event_db(run_dir: str | Path) -> Path:
    """Where injections are recorded: a database of this host's own in the run dir's ``events/``
    (never one an agent writes: SQLite may not share a writer across hosts on NFS / Lustre)."""
    return node_db_path(run_dir, f"chaos@{socket.gethostname()}")
