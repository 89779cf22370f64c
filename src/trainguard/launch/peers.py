"""Agents tell each other through the rendezvous store: the job is stopped, or a node leaves.

A node whose policy stops the job writes ``STOP_KEY`` (the reason, with where it was decided); a
node that leaves (excluded) writes ``LEAVING_KEY`` with its name before its workers stop, so the
others read their workers' failure as a membership change rather than spending their restart
budget on it. Keys live in the round's store (a c10d rendezvous scopes it to the round).
"""

from __future__ import annotations

import logging
import time
from typing import Any

from trainguard import torch_compat
from trainguard.evidence import PeerLeft, PeerNews, PeerStop

log = logging.getLogger(__name__)

LEAVING_KEY = "trainguard/leaving"
STOP_KEY = "trainguard/stop"
CHECK_EVERY_S = 1.0


class Peers:
    """This node's side of the conversation with the other agents."""

    def __init__(self, node: str) -> None:
        self.node = node
        self._last_check = 0.0

    def news(self, store: Any, nnodes: int, force: bool = False) -> PeerNews | None:
        """Another agent stopped the job or left it (looked up about once a second)."""
        now = time.monotonic()
        if store is None or nnodes <= 1:
            return None
        if not force and now - self._last_check < CHECK_EVERY_S:
            return None
        self._last_check = now
        try:
            if store.check([STOP_KEY]):
                return PeerStop(store.get(STOP_KEY).decode(errors="replace"))
            if store.check([LEAVING_KEY]):
                return PeerLeft(store.get(LEAVING_KEY).decode(errors="replace"))
        except Exception:  # the store host may be gone; elastic's own failure handling takes over
            return None
        return None

    def stop_everywhere(self, store: Any, nnodes: int, reason: str) -> None:
        """Tell the other agents the job is stopped, so they stop too."""
        if store is None or nnodes <= 1:
            return
        try:
            store.set(STOP_KEY, f"{reason} (decided on {self.node})")
        except Exception as exc:
            log.warning("could not tell the other agents to stop: %s", exc)

    def announce_leaving(self, store: Any) -> None:
        """Tell the other agents this node leaves, so they re-form without using a restart."""
        if store is None:
            return
        try:
            store.set(LEAVING_KEY, self.node)
        except Exception as exc:
            log.warning("could not announce leaving: %s", exc)

    @staticmethod
    def leave_rendezvous(handler: Any) -> None:
        """Drop out of the c10d rendezvous so the next round forms without waiting for this node."""
        try:
            torch_compat.leave_rendezvous(handler)
        except Exception as exc:
            log.warning("could not leave the rendezvous cleanly: %s", exc)
