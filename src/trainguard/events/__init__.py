"""Event model, SQLite store, fan-out bus and notifiers."""

from trainguard.events.bus import EventBus
from trainguard.events.model import Event, Severity
from trainguard.events.store import EventStore

__all__ = ["Event", "EventBus", "EventStore", "Severity"]
