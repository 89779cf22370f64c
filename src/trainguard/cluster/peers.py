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
STOP_SEEN_KEY = "trainguard/stop-seen"  # a counter: how many other agents have read the stop
CHECK_EVERY_S = 1.0
STOP_ACK_WAIT_S = 5.0


class Peers:
    """This node's side of the conversation with the other agents."""

    def __init__(self, node: str, key: JobKey, on_rejected: Callable[[str, str], None] | Rejections | None = None) -> None:
        self.node = node
        self.key = key
        self._report = on_rejected if isinstance(on_rejected, Rejections) else Rejections(on_rejected)
        self._last_check = 0.0
        self._acked: set[tuple[int, str]] = set()

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
                self._ack(store, stop)
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

    def _ack(self, store: Any, stop: str) -> None:
        """Count this agent as having read the stop, once per store and reason. Unsigned: a forged
        count can only end the stopping agent's wait early, never stop anything."""
        seen = (id(store), stop)
        if seen in self._acked:
            return
        try:
            store.add(STOP_SEEN_KEY, 1)
            self._acked.add(seen)
        except Exception as exc:  # the stop itself was read: that is what counts
            log.debug("could not acknowledge the stop: %s", exc)

    def stop_everywhere(self, store: Any, nnodes: int, reason: str, wait_s: float = STOP_ACK_WAIT_S) -> None:
        """Tell the other agents the job is stopped, so they stop too, and give them up to
        ``wait_s`` to read it: this agent may host the store, and once it exits the others can no
        longer read why (they would fail on a broken store instead of saying the reason)."""
        if store is None or nnodes <= 1:
            return
        try:
            self.signed(store).set(STOP_KEY, f"{reason} (decided on {self.node})")
        except Exception as exc:
            log.warning("could not tell the other agents to stop: %s", exc)
            return
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            try:
                if store.add(STOP_SEEN_KEY, 0) >= nnodes - 1:
                    return
            except Exception:  # the store host is gone: nobody left to wait for
                return
            time.sleep(0.05)
        log.info("not every agent read the stop within %.0f s; stopping anyway", wait_s)

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
