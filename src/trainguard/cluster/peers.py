"""Agents tell each other through the rendezvous store: the job is stopped, or a node leaves.

A node whose policy stops the job writes ``STOP_KEY`` (the reason, with where it was decided); a
node that leaves (excluded) writes ``LEAVING_KEY`` with its name before its workers stop, so the
others read their workers' failure as a membership change rather than spending their restart
budget on it. Keys live in the round's store (a c10d rendezvous scopes it to the round).

Values are signed with the job's key through ``trainguard.cluster.stores.SignedStore``: one without
the right MAC was not written by an agent of this job, so it is ignored and reported
(``on_rejected``, once per value), never obeyed.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from trainguard import torch_compat
from trainguard.cluster.stores import ForgedValue, JobKey, Rejections, SignedStore
from trainguard.evidence import PeerLeft, PeerNews, PeerStop

log = logging.getLogger(__name__)

LEAVING_KEY = "trainguard/leaving"
STOP_KEY = "trainguard/stop"
CHECK_EVERY_S = 1.0


class Peers:
    """This node's side of the conversation with the other agents."""

    def __init__(self, node: str, key: JobKey, on_rejected: Callable[[str, str], None] | Rejections | None = None) -> None:
        self.node = node
        self.key = key
        self._report = on_rejected if isinstance(on_rejected, Rejections) else Rejections(on_rejected)
        self._last_check = 0.0

    def signed(self, store: Any) -> SignedStore:
        return SignedStore(store, self.key, self._report)

    def news(self, store: Any, nnodes: int, force: bool = False) -> PeerNews | None:
        """Another agent stopped the job or left it (looked up about once a second)."""
        now = time.monotonic()
        if store is None or nnodes <= 1:
            return None
        if not force and now - self._last_check < CHECK_EVERY_S:
            return None
        self._last_check = now
        try:
            stop = self._signed(store, STOP_KEY)
            if stop is not None:
                return PeerStop(stop)
            leaving = self._signed(store, LEAVING_KEY)
            if leaving is not None:
                return PeerLeft(leaving)
        except Exception:  # the store host may be gone; elastic's own failure handling takes over
            return None
        return None

    def _signed(self, store: Any, key: str) -> str | None:
        """The key's value when an agent of this job wrote it; a forged one is reported once."""
        if not store.check([key]):
            return None
        try:
            return self.signed(store).get(key).decode()
        except ForgedValue:
            return None

    def stop_everywhere(self, store: Any, nnodes: int, reason: str) -> None:
        """Tell the other agents the job is stopped, so they stop too."""
        if store is None or nnodes <= 1:
            return
        try:
            self.signed(store).set(STOP_KEY, f"{reason} (decided on {self.node})")
        except Exception as exc:
            log.warning("could not tell the other agents to stop: %s", exc)

    def announce_leaving(self, store: Any, node: str | None = None) -> None:
        """Tell the other agents this node (or a node found lost) leaves, so they re-form without
        using a restart."""
        if store is None:
            return
        try:
            self.signed(store).set(LEAVING_KEY, node or self.node)
        except Exception as exc:
            log.warning("could not announce leaving: %s", exc)

    @staticmethod
    def leave_rendezvous(handler: Any) -> None:
        """Drop out of the c10d rendezvous so the next round forms without waiting for this node."""
        try:
            torch_compat.leave_rendezvous(handler)
        except Exception as exc:
            log.warning("could not leave the rendezvous cleanly: %s", exc)
