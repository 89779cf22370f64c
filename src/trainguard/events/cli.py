"""`trainguard events RUN_DIR [--json] [--follow] [--kind K]`"""

from __future__ import annotations

import argparse
import sys
import time
from datetime import datetime
from pathlib import Path

from trainguard.events.model import Event, Severity
from trainguard.events.store import DB_NAME, EventStore


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir", help="the job's run directory (or its events.db)")
    p.add_argument("--json", action="store_true", help="one JSON object per line")
    p.add_argument("--follow", "-f", action="store_true", help="keep printing new events")
    p.add_argument("--kind", action="append", help="only events of this kind (repeatable)")
    p.add_argument("--severity", default=None, help="only events at or above this severity")
    p.add_argument("--interval", type=float, default=0.5, help=argparse.SUPPRESS)


def format_row(e: Event) -> str:
    ts = datetime.fromtimestamp(e.time).strftime("%Y-%m-%d %H:%M:%S.%f")[:-3]
    rank = "-" if e.rank is None else str(e.rank)
    return f"{ts}  {e.severity.label:<8}  {e.kind:<18}  {e.node:<14}  {rank:>4}  {e.message}"


HEADER = f"{'time':<23}  {'severity':<8}  {'kind':<18}  {'node':<14}  {'rank':>4}  message"


def main(args: argparse.Namespace) -> int:
    path = Path(args.run_dir)
    db = path if path.suffix == ".db" else path / DB_NAME
    min_sev = Severity.parse(args.severity) if args.severity else None
    deadline_for_db = time.monotonic() + 60
    while not db.exists():
        if not args.follow or time.monotonic() > deadline_for_db:
            print(f"trainguard events: error: no events at {db}", file=sys.stderr)
            return 2
        time.sleep(args.interval)
    store = EventStore(db, readonly=True)
    last = 0
    if not args.json:
        print(HEADER)
    try:
        while True:
            for e in store.query(kinds=args.kind, after_id=last, min_severity=min_sev):
                last = max(last, e.id or 0)
                print(e.to_json() if args.json else format_row(e), flush=True)
            if not args.follow:
                return 0
            time.sleep(args.interval)
    except (KeyboardInterrupt, BrokenPipeError):
        return 0
    finally:
        store.close()
