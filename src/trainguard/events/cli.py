"""`trainguard events RUN_DIR [--json] [--follow] [--kind K] [--severity S]`

Every node's events of the run, merged in time order (see events/store.py for the layout).
"""

from __future__ import annotations

import argparse
import sys
import time
from datetime import datetime
from pathlib import Path

from trainguard.events.model import Event, Severity
from trainguard.events.store import RunEvents
from trainguard.options import seconds

WAIT_FOR_DB_S = 60.0  # --follow on a run that has not written its first event yet


def _severity(text: str) -> Severity:
    try:
        return Severity.parse(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir", help="the job's run directory (or one of its .db files)")
    p.add_argument("--json", action="store_true", help="one JSON object per line")
    p.add_argument("--follow", "-f", action="store_true", help="keep printing new events")
    p.add_argument("--kind", action="append", help="only events of this kind (repeatable)")
    p.add_argument("--severity", type=_severity, default=None, help="only events at or above this severity")
    p.add_argument("--interval", type=seconds, default=0.5, help=argparse.SUPPRESS)


def _when(t: float) -> str:
    try:
        return datetime.fromtimestamp(t).strftime("%Y-%m-%d %H:%M:%S.%f")[:-3]
    except (OverflowError, OSError, ValueError):
        return f"{t!r:<23}"


def format_row(e: Event) -> str:
    rank = "-" if e.rank is None else str(e.rank)
    return f"{_when(e.time)}  {e.severity.label:<8}  {e.kind:<18}  {e.node:<14}  {rank:>4}  {e.message}"


HEADER = f"{'time':<23}  {'severity':<8}  {'kind':<18}  {'node':<14}  {'rank':>4}  message"


def _problem(path: Path) -> str | None:
    """Why ``path`` cannot hold events (None: it can, or may once the job writes)."""
    if path.suffix == ".db" and path.is_dir():
        return f"{path} is a directory, not an event database"
    if not path.exists():
        return f"no events at {path}"
    if path.is_file() and path.suffix != ".db":
        return f"{path} is not a run directory or an event database (.db)"
    return None


def main(args: argparse.Namespace) -> int:
    path = Path(args.run_dir)
    problem = _problem(path)
    reader = RunEvents(path)
    deadline = time.monotonic() + WAIT_FOR_DB_S
    while problem or not reader.databases():
        if problem is None:
            problem = f"no events at {path} (no events.db or events/*.db)"
        if not args.follow or time.monotonic() > deadline or path.is_file():
            print(f"trainguard events: error: {problem}", file=sys.stderr)
            return 2
        time.sleep(args.interval)
        problem = _problem(path)
    said: set[Path] = set()
    try:
        first = reader.read(kinds=args.kind, min_severity=args.severity)
        if reader.problems and len(reader.problems) == len(reader.databases()):
            db, why = next(iter(reader.problems.items()))  # nothing readable: an error, not an empty table
            print(f"trainguard events: error: cannot read {db}: {why}", file=sys.stderr)
            return 2
        if not args.json:
            print(HEADER)
        new = first
        while True:
            for e in new:
                print(e.to_json() if args.json else format_row(e), flush=True)
            for db, why in reader.problems.items():
                if db not in said:
                    said.add(db)
                    print(f"trainguard events: warning: cannot read {db} (skipped): {why}", file=sys.stderr)
            if not args.follow:
                return 0
            time.sleep(args.interval)
            new = reader.read(kinds=args.kind, min_severity=args.severity)
    except (KeyboardInterrupt, BrokenPipeError):
        return 0
    finally:
        reader.close()
