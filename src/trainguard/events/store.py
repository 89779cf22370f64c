"""SQLite stores of events: one database per node, merged by every reader.

Layout of a run directory: ``events/<node>.db``, written by that node's agent only. Several agents
sharing a run dir on a network filesystem (NFS, Lustre) never write the same SQLite file: SQLite's
WAL mode needs shared memory between every process that opens the database, which hosts sharing
an NFS mount do not have, and concurrent writers from several hosts depend on the filesystem's
locking being right. With one writer per file, a reader on another host takes only read locks,
and the worst a broken lock can do is a torn read it retries at its next poll. The per-node
databases use a rollback journal (``PERSIST``, so the journal file keeps its blocks) instead of
WAL for the same reason.

A full disk must not lose the job's record: the writer keeps a reserve of free pages inside its own
database file (a blob written and deleted: SQLite keeps the pages on its freelist and reuses them
before growing the file), so events go on being stored for a while after the disk fills up.

Readers (``RunEvents``) merge every node's database, and the single ``events.db`` of run dirs
written before per-node databases, in time order.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import sqlite3
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import quote, unquote

from trainguard import runfiles
from trainguard.events.model import Event, Severity

log = logging.getLogger("trainguard.events")

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
CREATE TABLE IF NOT EXISTS reserve (b BLOB);
"""

DB_NAME = "events.db"  # one database for the whole run: run dirs written before per-node databases
EVENTS_DIR = "events"  # events/<node>.db
RESERVE_BYTES = 1 << 20  # free pages kept inside the database: ~2000 events on a full disk
RESERVE_CHUNK = 64 << 10  # freed one chunk per transaction: the journal never needs more than this
TOP_UP_EVERY = 64  # appends between checks of the reserve
READ_TIMEOUT_S = 5.0  # a reader waits this long for a writer's lock, then tries again at its next read
READ_RETRY_S = 30.0  # a reader's first read of a database retries a lock this long (heavy writes)
SIDE_FILES = ("-journal", "-wal", "-shm")  # what SQLite writes next to a database


def node_db_path(run_dir: str | Path, node: str) -> Path:
    """Where ``node`` writes its events (the name quoted: any node name is one safe file name)."""
    return Path(run_dir) / EVENTS_DIR / f"{quote(node, safe='')}.db"


def node_of(db: Path) -> str | None:
    """The node a per-node database belongs to; None for a run-wide ``events.db``."""
    return unquote(db.stem) if db.parent.name == EVENTS_DIR else None


def event_dbs(run_dir: str | Path) -> list[Path]:
    """Every event database of a run dir: the per-node ones and a run-wide ``events.db``."""
    run_dir = Path(run_dir)
    # Symlinks are not this run's databases (runfiles.py): they are neither read nor written.
    found = [run_dir / DB_NAME] if runfiles.is_regular(run_dir / DB_NAME) else []
    try:
        found += sorted(p for p in (run_dir / EVENTS_DIR).iterdir() if p.suffix == ".db" and runfiles.is_regular(p))
    except OSError:  # no events/ (yet), or not a directory
        pass
    return found


class EventStore:
    """One SQLite database of events. Safe to share between threads.

    ``EventStore(path)`` with a directory opens its run-wide ``events.db`` (tests, old run dirs);
    agents open their node's database: ``EventStore(node_db_path(run_dir, node))``."""

    def __init__(self, path: str | Path, readonly: bool = False) -> None:
        path = Path(path)
        if path.is_dir() or path.suffix != ".db":
            path = path / DB_NAME
        self.path = path
        self._lock = threading.Lock()
        self._appends = 0
        self.reserve_ok = True
        if readonly:
            if not path.is_file():
                raise FileNotFoundError(f"no event store at {path}")
            # as_uri() percent-encodes the path: a quoted node name (``events/a%40b.db``) stays itself
            uri = f"{path.absolute().as_uri()}?mode=ro"
            self._conn = sqlite3.connect(uri, uri=True, check_same_thread=False, timeout=READ_TIMEOUT_S)
        else:
            _prepare_writable(path)
            self._conn = sqlite3.connect(path, check_same_thread=False, timeout=30, isolation_level=None)
            # A run-wide events.db written by an older trainguard is WAL: it stays WAL (a database
            # file's journal mode is only changed by a writer with every other connection closed).
            current = self._conn.execute("PRAGMA journal_mode").fetchone()[0]
            if current != "wal":
                self._conn.execute("PRAGMA journal_mode=PERSIST")
            self._conn.execute("PRAGMA synchronous=NORMAL")
            self._conn.executescript(SCHEMA)
            self.reserve_ok = self._top_up()

    # ---- writing ----------------------------------------------------------------------------------
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
            self._appends += 1
            if not self._disk_has_room():
                self.reserve_ok = False  # this event (and the next ones) live on the reserve
            elif self._appends % TOP_UP_EVERY == 0 or not self.reserve_ok:
                self.reserve_ok = self._top_up()
        return int(event.id or 0)

    def _disk_has_room(self) -> bool:
        try:
            st = os.statvfs(self.path.parent)
        except OSError:
            return True
        return st.f_bavail * st.f_frsize >= RESERVE_CHUNK

    def reserve_left(self) -> int:
        """Bytes of free pages left in the database file (what events can use on a full disk)."""
        with self._lock:
            return self._free_pages_bytes()

    def _free_pages_bytes(self) -> int:
        page = self._conn.execute("PRAGMA page_size").fetchone()[0]
        return int(self._conn.execute("PRAGMA freelist_count").fetchone()[0]) * int(page)

    def _top_up(self) -> bool:
        """Keep about RESERVE_BYTES of free pages in the file; False when the disk has no room."""
        missing = RESERVE_BYTES - self._free_pages_bytes()
        if missing < RESERVE_BYTES // 2:
            return True
        if not self._disk_has_room():
            return False
        chunks = -(-missing // RESERVE_CHUNK)
        try:
            self._conn.execute("BEGIN IMMEDIATE")
            try:
                self._conn.executemany("INSERT INTO reserve VALUES (zeroblob(?))", [(RESERVE_CHUNK,)] * chunks)
                self._conn.execute("COMMIT")
            except BaseException:
                self._conn.execute("ROLLBACK")
                raise
            # One chunk per transaction: a rollback journal records what a transaction frees, and
            # the journal (kept, PERSIST) must never need more room than the disk may have left.
            for rowid in [r[0] for r in self._conn.execute("SELECT rowid FROM reserve").fetchall()]:
                self._conn.execute("DELETE FROM reserve WHERE rowid = ?", (rowid,))
        except sqlite3.OperationalError as exc:
            log.debug("event store %s: no room for its reserve: %s", self.path, exc)
            return False
        return True

    # ---- reading ----------------------------------------------------------------------------------
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
        events = [e for e in map(_row_to_event, rows) if e is not None]
        if min_severity is not None:
            events = [e for e in events if e.severity >= min_severity]
        return events

    def __iter__(self) -> Iterator[Event]:
        return iter(self.query())

    def close(self) -> None:
        with self._lock:
            self._conn.close()


def _prepare_writable(path: Path) -> None:
    """Create ``path`` as a regular file, refusing a symlink (dangling ones too), a FIFO or a device
    there, a symlinked ``events/`` directory and symlinked journal files: SQLite follows links, and
    would write another application's database or create a file outside the run dir."""
    ours = path.parent.name == EVENTS_DIR  # the run dir itself may be a link the user made; events/ not
    if ours:
        runfiles.safe_dir(path.parent)
    runfiles.private_dirs(path.parent)
    if ours:
        runfiles.safe_dir(path.parent)  # made by someone else between the two
    for side in SIDE_FILES:
        side_path = path.with_name(path.name + side)
        if os.path.lexists(side_path) and not runfiles.is_regular(side_path):
            raise runfiles.refuse(side_path, "a symlink or special file")
    runfiles.create_regular(path)


class _Recovered:
    """A read of a database whose writer died mid-transaction (a hot journal): SQLite needs write
    access to roll the journal back, which a reader must never use on the run dir. The database and
    its journal are copied to a private temporary directory and the copy is rolled back there; the
    run dir is not touched. The copy is made again at every read (the writer may come back)."""

    @staticmethod
    def query(db: Path, after_id: int, kinds: list[str] | None) -> list[Event]:
        tmp = Path(tempfile.mkdtemp(prefix="trainguard-events-"))
        try:
            copy = tmp / "copy.db"
            for side in ("", "-journal"):
                src = db.with_name(db.name + side)
                try:
                    with runfiles.open_read(src) as f, open(copy.with_name(copy.name + side), "wb") as out:
                        shutil.copyfileobj(f, out)
                except FileNotFoundError:
                    continue
            store = EventStore.__new__(EventStore)
            store.path, store._lock = copy, threading.Lock()
            store._conn = sqlite3.connect(copy, check_same_thread=False, timeout=READ_TIMEOUT_S)
            try:
                return store.query(kinds=kinds, after_id=after_id)
            finally:
                store.close()
        finally:
            shutil.rmtree(tmp, ignore_errors=True)


def _needs_rollback(exc: sqlite3.Error) -> bool:
    return "readonly" in str(exc) or getattr(exc, "sqlite_errorcode", None) == 776  # SQLITE_READONLY_ROLLBACK


def _locked(exc: sqlite3.Error) -> bool:
    return "locked" in str(exc) or "busy" in str(exc)


class RunEvents:
    """Every node's events of a run dir, merged: each ``read`` returns what is new since the last
    one, in time order (a later read can return an event older than one already returned, when
    another node wrote it late). Events get ids in the order this reader returned them (1, 2, ...):
    a node's own row ids repeat across nodes. Databases that appear later (a node that joins) are
    picked up; one that cannot be read (locked for too long, torn by a network filesystem, not a
    database) is skipped until it can, and named in ``problems``.

    ``skip_nodes``: nodes whose databases are not read (an agent reading the other nodes' events).
    ``path`` may also be one ``.db`` file. ``wait_s``: how long the first read of a database waits
    for a writer holding its lock (a command's answer depends on it; an agent's thread passes 0)."""

    def __init__(self, path: str | Path, skip_nodes: set[str] | frozenset[str] = frozenset(),
                 wait_s: float = READ_RETRY_S) -> None:
        path = Path(path)
        self.wait_s = wait_s  # how long a database's first read waits out a writer's lock
        self.single = path if path.suffix == ".db" and not path.is_dir() else None
        self.run_dir = path.parent if self.single else path
        self.skip_nodes = set(skip_nodes)
        self.problems: dict[Path, str] = {}
        self._stores: dict[Path, EventStore] = {}
        self._after: dict[Path, int] = {}
        self._next_id = 1

    def databases(self) -> list[Path]:
        dbs = [self.single] if self.single else event_dbs(self.run_dir)
        return [p for p in dbs if node_of(p) not in self.skip_nodes]

    def read(self, kinds: list[str] | None = None, min_severity: Severity | None = None) -> list[Event]:
        new: list[Event] = []
        for db in self.databases():
            new += self._read_one(db, kinds, min_severity)
        new.sort(key=lambda e: e.time)  # stable: one node's events keep their order
        for e in new:
            e.id, self._next_id = self._next_id, self._next_id + 1
        return new

    def _read_one(self, db: Path, kinds: list[str] | None, min_severity: Severity | None) -> list[Event]:
        # A database never read yet waits out a busy writer (READ_RETRY_S): its first read decides
        # whether a command answers at all. Later reads skip it until the next poll.
        deadline = time.monotonic() + (self.wait_s if db not in self._after else 0.0)
        while True:
            try:
                events = self._query(db, kinds)
                break
            except sqlite3.Error as exc:
                if _locked(exc) and time.monotonic() < deadline:
                    self._forget(db)
                    time.sleep(0.05)
                    continue
                self.problems[db] = str(exc)
                self._forget(db)
                return []
            except OSError as exc:
                self.problems[db] = str(exc)
                self._forget(db)
                return []
        self.problems.pop(db, None)
        self._after[db] = max([self._after.get(db, 0)] + [e.id or 0 for e in events])
        if min_severity is not None:
            events = [e for e in events if e.severity >= min_severity]
        return events

    def _query(self, db: Path, kinds: list[str] | None) -> list[Event]:
        after = self._after.get(db, 0)
        store = self._stores.get(db)
        try:
            if store is None:
                store = self._stores[db] = EventStore(db, readonly=True)
            return store.query(kinds=kinds, after_id=after, min_severity=None)
        except sqlite3.OperationalError as exc:
            if not _needs_rollback(exc):
                raise
            self._forget(db)
            return _Recovered.query(db, after, kinds)

    def _forget(self, db: Path) -> None:
        store = self._stores.pop(db, None)
        if store is not None:
            try:
                store.close()
            except sqlite3.Error:
                pass

    def close(self) -> None:
        for db in list(self._stores):
            self._forget(db)


def read_all(path: str | Path, kinds: list[str] | None = None) -> list[Event]:
    """Every event of a run dir (or one database), all nodes merged in time order."""
    events = RunEvents(path)
    try:
        return events.read(kinds=kinds)
    finally:
        events.close()


MAX_TIME = 1e11  # unix seconds (year 5138): a later (or negative) time is a damaged row
MAX_RANK = 1 << 24


def _row_to_event(row: tuple) -> Event | None:
    """One row as an event; None for a row no view can place (its time is not a time). Rows other
    programs wrote are shown as well as they can be rather than failing the whole read."""
    id_, t, kind, sev, node, rank, message, evidence = row
    try:
        t = float(t)
    except (TypeError, ValueError):
        return None
    if not 0 <= t < MAX_TIME:  # NaN too
        return None
    try:
        ev = json.loads(evidence)
    except (TypeError, ValueError, RecursionError):
        ev = {"raw": evidence}
    if not isinstance(ev, dict):
        ev = {"raw": ev}
    try:
        severity = Severity.parse(sev)
    except (ValueError, TypeError, AttributeError):  # a row some other program wrote
        severity = Severity.INFO
    if not (isinstance(rank, int) and 0 <= rank < MAX_RANK):
        rank = None
    return Event(id=id_, time=t, kind=_text(kind), severity=severity, node=_text(node), rank=rank,
                 message=_text(message), evidence=ev)


def _text(value: object) -> str:
    if isinstance(value, bytes):
        return value.decode(errors="replace")
    return "" if value is None else str(value)
