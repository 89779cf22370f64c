"""`trainguard profile RUN_DIR on|off [--comm on|off]`: switch lightweight profiling at run time.

Writes the run's switch file (``RUN_DIR/profiling-switch.json``, seed format). Every agent of the
run watches it and sets the flag word in its workers' rings within a fraction of a second — no
restart. With no state given, prints the current switch. Seed rules: Step, SaveCheckpoint, FP and
DataLoader go on and off together; Communication separately, and only while they are on (so
``off`` turns everything off, and ``off --comm on`` is refused).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from trainguard import runfiles
from trainguard.events.store import event_dbs
from trainguard.exitcodes import EXIT_USAGE
from trainguard.rundir import profiling as pf
from trainguard.worker.ring import FLAG_BASIC, FLAG_COMM


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir", metavar="RUN_DIR", help="the run directory of a `trainguard run` job")
    parser.add_argument("state", nargs="?", choices=["on", "off"], help="Step/FP/DataLoader/SaveCheckpoint; omit to show")
    parser.add_argument("--comm", choices=["on", "off"], default=None, help="Communication spans (default: unchanged; off with 'off')")


def main(args: argparse.Namespace) -> int:
    run_dir = Path(args.run_dir)
    if not run_dir.is_dir():
        print(f"trainguard profile: error: no run directory {run_dir}", file=sys.stderr)
        return EXIT_USAGE
    if not event_dbs(run_dir):  # a switch file is only written where a trainguard job runs
        print(f"trainguard profile: error: {run_dir} is not a trainguard run directory (no events.db or events/*.db)",
              file=sys.stderr)
        return EXIT_USAGE
    try:
        current = pf.read_switch(run_dir)
    except ValueError as exc:
        current = None
        if args.state is None:  # when switching, the new switch replaces it (or the write says why not)
            print(f"trainguard profile: warning: ignoring unreadable switch file: {exc}", file=sys.stderr)
    if args.state is None:
        if args.comm is not None:
            print("trainguard profile: error: --comm needs a state (on|off)", file=sys.stderr)
            return EXIT_USAGE
        if current is None:
            print(f"no profiling switch in {run_dir} (the agent writes one when it starts)")
            return 0
        print(json.dumps(pf.switch_dict(current)))
        return 0
    if args.state == "off":
        if args.comm == "on":
            print("trainguard profile: error: Communication can be on only while profiling is on", file=sys.stderr)
            return EXIT_USAGE
        flags = 0
    else:
        comm = args.comm == "on" if args.comm is not None else bool((current or 0) & FLAG_COMM)
        flags = FLAG_BASIC | (FLAG_COMM if comm else 0)
    try:
        path = pf.write_switch(run_dir, flags)
    except OSError as exc:  # a read-only or full run dir, a symlink or FIFO there: the switch is unchanged
        why = exc if isinstance(exc, runfiles.UnsafeFile) else exc.strerror or exc
        print(f"trainguard profile: error: cannot write the switch in {run_dir}: {why}", file=sys.stderr)
        return EXIT_USAGE
    print(f"{path}: {json.dumps(pf.switch_dict(flags))}")
    return 0
