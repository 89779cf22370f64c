"""SQLite (WAL) store of events under the run directory."""

from __future__ import annotations

import json
import sqlite3
import threading
from collections.abc import Iterator
from pathlib import Path

from trainguard.events.model import Event, Severity

SCHEMA = """
CREATE TABLE IF NOT EXISTS events (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    time REAL NOT NULL,
    kind TEXT NOT NULL,
    severity TEXT NOT NULL,
    node TEXT NOT NULL,
    rank INTEGER,
    message TEXT NOT NULL,
    evidence TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS events_kind ON events(kind);
"""

DB_NAME = "events.db"


class EventStore:
    """Appends and reads events. Safe to share between threads; several processes may write."""

    def __init__(self, path: str | Path, readonly: bool = False) -> None:
        path = Path(path)
        if path.is_dir() or path.suffix != ".db":
            path = path / DB_NAME
        self.path = path
        self._lock = threading.Lock()
        if readonly:
            if not path.exists():
                raise FileNotFoundError(f"no event store at {path}")
            self._conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True, check_same_thread=False, timeout=30)
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            self._conn = sqlite3.connect(path, check_same_thread=False, timeout=30, isolation_level=None)
            self._conn.execute("PRAGMA journal_mode=WAL")
            self._conn.execute("PRAGMA synchronous=NORMAL")
            self._conn.executescript(SCHEMA)

    def append(self, event: Event) -> int:
        row = (
            event.time,
            event.kind,
            event.severity.label,
            event.node,
            event.rank,
            event.message,
            json.dumps(event.evidence, default=str),
        )
        with self._lock:
            cur = self._conn.execute(
                "INSERT INTO events(time, kind, severity, node, rank, message, evidence) VALUES (?,?,?,?,?,?,?)",
                row,
            )
            event.id = cur.lastrowid
        return int(event.id or 0)

    def query(
        self,
        kinds: list[str] | None = None,
        after_id: int = 0,
        min_severity: Severity | None = None,
        limit: int | None = None,
    ) -> list[Event]:
        sql = "SELECT id, time, kind, severity, node, rank, message, evidence FROM events WHERE id > ?"
        params: list[object] = [after_id]
        if kinds:
            sql += " AND kind IN ({})".format(",".join("?" * len(kinds)))
            params.extend(kinds)
        sql += " ORDER BY id"
        if limit:
            sql += " LIMIT ?"
            params.append(limit)
        with self._lock:
            try:
                rows = self._conn.execute(sql, params).fetchall()
            except sqlite3.OperationalError as exc:
                if "no such table" in str(exc):  # a reader that came before the writer's schema
                    return []
                raise
        events = [_row_to_event(r) for r in rows]
        if min_severity is not None:
            events = [e for e in events if e.severity >= min_severity]
        return events

    def __iter__(self) -> Iterator[Event]:
        return iter(self.query())

    def close(self) -> None:
        with self._lock:
            self._conn.close()


def _row_to_event(row: tuple) -> Event:
    id_, t, kind, sev, node, rank, message, evidence = row
    try:
        ev = json.loads(evidence)
    except (TypeError, ValueError):
        ev = {"raw": evidence}
    return Event(
        id=id_, time=t, kind=kind, severity=Severity.parse(sev), node=node, rank=rank, message=message, evidence=ev
    )
