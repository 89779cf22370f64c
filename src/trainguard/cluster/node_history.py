"""The site's node history: which hosts failed, how and when, across runs.

Each run otherwise starts with no memory of the hosts that failed before, and the scheduler hands
the job the same bad node again. Agents record here the hardware-class faults of their host, its
exclusions and the restart loops that followed it; the pre-check reads it and refuses a host with
``--node-history-faults`` such faults within ``--node-history-window`` (``trainguard status``
lists them).

One small SQLite file in a directory the nodes share (``--node-history PATH``; default next to the
run dir). Several agents write it at once: every write is one short transaction and waits for the
others (busy timeout). Rollback journal, not WAL: WAL needs the shared memory of one host, and the
nodes sharing this file are on several hosts (NFS, Lustre; see events/store.py). A file that
cannot be read or written (corrupt, not SQLite, no permission) is one clear line and the job goes
on without history: ``HistoryUnavailable``.
"""

from __future__ import annotations

import sqlite3
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

DEFAULT_NAME = "trainguard-node-history.sqlite"
HARDWARE, EXCLUSION, RESTART_LOOP = "hardware", "exclusion", "restart_loop"
NAN_TRANSIENT = "nan_transient"  # a NaN that did not come back in its replay (the NaN triage)
# What counts against a host. An exclusion alone (a straggler) does not, nor a transient NaN: it
# may be the host's silent corruption or the numerics of one batch, and nothing here tells which.
COUNTED = (HARDWARE, RESTART_LOOP)
BUSY_TIMEOUT_S = 30.0
DEFAULT_FAULTS = 2
DEFAULT_WINDOW_S = 7 * 86400.0

_SCHEMA = """CREATE TABLE IF NOT EXISTS node_faults (
    host TEXT NOT NULL, kind TEXT NOT NULL, detail TEXT NOT NULL, time REAL NOT NULL, run TEXT NOT NULL)"""
_INDEX = "CREATE INDEX IF NOT EXISTS node_faults_host ON node_faults (host, time)"


class HistoryUnavailable(Exception):
    """The history file cannot be used; the message is the one line to print."""


@dataclass(frozen=True)
class NodeFault:
    host: str
    kind: str  # hardware | exclusion | restart_loop
    detail: str
    time: float
    run: str  # the run dir that recorded it

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def default_path(run_dir: Path) -> Path:
    return Path(run_dir).absolute().parent / DEFAULT_NAME


def path_for(option: str | None, run_dir: Path) -> Path:
    return Path(option) if option else default_path(run_dir)


@dataclass(frozen=True)
class HistorySettings:
    """`trainguard run`'s node-history flags, parsed once."""

    path: str | None = None  # None: next to the run dir
    max_faults: int = DEFAULT_FAULTS  # 0: never refuse a host
    window_s: float = DEFAULT_WINDOW_S

    @classmethod
    def from_options(cls, options: Any) -> HistorySettings:
        fields = {k: v for k, v in (("path", getattr(options, "node_history", None)),
                                    ("max_faults", getattr(options, "node_history_faults", None)),
                                    ("window_s", getattr(options, "node_history_window", None))) if v is not None}
        return cls(**fields)


class NodeHistory:
    def __init__(self, path: Path) -> None:
        self.path = Path(path)

    def _connect(self, create: bool) -> sqlite3.Connection:
        if not create and not self.path.exists():
            raise FileNotFoundError(self.path)
        if self.path.is_symlink() or (self.path.exists() and not self.path.is_file()):
            raise HistoryUnavailable(f"node history {self.path} is not a plain file: going on without node history")
        conn = sqlite3.connect(self.path, timeout=BUSY_TIMEOUT_S, isolation_level=None)
        try:
            conn.execute(f"PRAGMA busy_timeout={int(BUSY_TIMEOUT_S * 1000)}")
            if create:
                conn.execute(_SCHEMA)
                conn.execute(_INDEX)
        except BaseException:
            conn.close()
            raise
        return conn

    def _unavailable(self, exc: BaseException, doing: str) -> HistoryUnavailable:
        return HistoryUnavailable(f"node history {self.path} cannot be {doing} ({exc}): going on without node history")

    def record(self, host: str, kind: str, detail: str, run: str, now: float | None = None) -> None:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            conn = self._connect(create=True)
            try:
                conn.execute("INSERT INTO node_faults VALUES (?, ?, ?, ?, ?)",
                             (host, kind, detail[:500], time.time() if now is None else now, run))
            finally:
                conn.close()
        except (sqlite3.Error, OSError) as exc:
            raise self._unavailable(exc, "written") from None

    def faults(self, since: float, host: str | None = None) -> list[NodeFault]:
        """The records since ``since`` (unix time), oldest first; none when the file does not exist."""
        try:
            conn = self._connect(create=False)
        except FileNotFoundError:
            return []
        except (sqlite3.Error, OSError) as exc:
            raise self._unavailable(exc, "read") from None
        try:
            where, args = ("time >= ?", [since]) if host is None else ("time >= ? AND host = ?", [since, host])
            rows = conn.execute(f"SELECT host, kind, detail, time, run FROM node_faults WHERE {where} ORDER BY time",
                                args).fetchall()
        except sqlite3.OperationalError as exc:
            if "no such table" in str(exc):
                return []
            raise self._unavailable(exc, "read") from None
        except sqlite3.Error as exc:
            raise self._unavailable(exc, "read") from None
        finally:
            conn.close()
        return [NodeFault(str(h), str(k), str(d), float(t), str(r)) for h, k, d, t, r in rows]


def counted(faults: list[NodeFault]) -> list[NodeFault]:
    return [f for f in faults if f.kind in COUNTED]


def refused_hosts(faults: list[NodeFault], max_faults: int) -> dict[str, list[NodeFault]]:
    """Hosts with at least ``max_faults`` counted faults among ``faults`` (0: none refused)."""
    if max_faults <= 0:
        return {}
    by_host: dict[str, list[NodeFault]] = {}
    for f in counted(faults):
        by_host.setdefault(f.host, []).append(f)
    return {h: fs for h, fs in by_host.items() if len(fs) >= max_faults}


def refusal(host: str, faults: list[NodeFault], window_s: float) -> str:
    """One line: why the host is refused."""
    said = "; ".join(f"{f.kind} at {time.strftime('%Y-%m-%d %H:%M', time.localtime(f.time))}: {f.detail[:120]}"
                     for f in faults[-3:])
    return (f"{host} had {len(faults)} hardware-class fault(s) in the last {window_s / 3600:g} h "
            f"({said})")
