"""Fan one event out to the store, the log, metrics and notifiers. Never raises into the caller."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from trainguard.events.model import Event, Severity
from trainguard.events.store import EventStore

log = logging.getLogger("trainguard.events")

Subscriber = Callable[[Event], None]

# Recorded and exported like any event, but too frequent for the console.
ROUTINE_KINDS = frozenset({"checkpoint_persisted"})


class EventBus:
    def __init__(self, store: EventStore | None, node: str) -> None:
        self.store = store
        self.node = node
        self._subscribers: list[Subscriber] = []
        self._lock = threading.Lock()

    def subscribe(self, fn: Subscriber) -> None:
        with self._lock:
            self._subscribers.append(fn)

    def emit(
        self,
        kind: str,
        message: str,
        severity: Severity | str = Severity.INFO,
        rank: int | None = None,
        evidence: dict[str, Any] | None = None,
        node: str | None = None,
    ) -> Event:
        event = Event(
            kind=kind,
            message=message,
            severity=Severity.parse(severity),
            node=self.node if node is None else node,
            rank=rank,
            evidence=evidence or {},
        )
        self.publish(event)
        return event

    def publish(self, event: Event) -> None:
        if self.store is not None:
            try:
                self.store.append(event)
            except Exception as exc:  # the store failing (disk full) must not stop the job
                log.error("could not store event %s: %s", event.kind, exc)
        level = {Severity.INFO: logging.INFO, Severity.WARNING: logging.WARNING}.get(event.severity, logging.ERROR)
        if event.kind in ROUTINE_KINDS and event.severity == Severity.INFO:
            level = logging.DEBUG
        where = f" rank={event.rank}" if event.rank is not None else ""
        log.log(level, "[%s]%s %s", event.kind, where, event.message)
        with self._lock:
            subscribers = list(self._subscribers)
        for fn in subscribers:
            try:
                fn(event)
            except Exception as exc:
                log.warning("event subscriber %r failed: %s", fn, exc)
