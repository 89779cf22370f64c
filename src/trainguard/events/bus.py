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
        self._store_failing = False  # said once; said again when storing works again
        self._reserve_said = False

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

    def _store(self, event: Event) -> None:
        """Append to the store; a failing store (disk full past its reserve) is said once, not
        once per event: every event still reaches the log and the console below."""
        assert self.store is not None
        try:
            self.store.append(event)
        except Exception as exc:  # the store failing must not stop the job
            if not self._store_failing:
                self._store_failing = True
                log.error("events can no longer be stored in %s (%s): they go on to the console and the "
                          "agent log only, until it works again", self.store.path, exc)
            return
        if self._store_failing:
            self._store_failing = False
            log.warning("events are stored in %s again", self.store.path)
        if not self.store.reserve_ok and not self._reserve_said:
            self._reserve_said = True
            log.warning("the disk of %s is full: events are stored in the space the store reserved for this "
                        "(%d KB left)", self.store.path, self.store.reserve_left() >> 10)

    def publish(self, event: Event) -> None:
        if self.store is not None:
            self._store(event)
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
