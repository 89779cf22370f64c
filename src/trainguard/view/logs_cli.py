"""`trainguard logs RUN_DIR [--rank R] [--node N] [--attempt A] [--since T] [--until T] [--grep RE] [--follow]`

Every attempt's rank logs of a run (rundir/logs.py), merged by time, each line prefixed with its
node, rank and attempt: pick one worker and the seconds around a failure without opening files by
hand. Times are the agent's local time, as the log files have them.
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from datetime import datetime, timedelta
from pathlib import Path

from trainguard.options import seconds
from trainguard.rundir.logs import LOGS_DIR, LogFilter, LogTail, merged_lines

_RELATIVE = re.compile(r"^-(\d+(?:\.\d+)?)([smhd])$")
_UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400}
_CLOCK = re.compile(r"^\d{1,2}:\d\d(?::\d\d(?:\.\d{1,6})?)?$")
MAX_PATTERN = 4096


def parse_time(text: str, now: datetime | None = None) -> datetime:
    """An ISO date-time (an offset is turned into local time), ``HH:MM[:SS]`` of today, or ``-5m``
    (s, m, h, d) before now. Naive local time, as the log lines are."""
    now = now or datetime.now()
    text = text.strip()
    rel = _RELATIVE.match(text)
    if rel:
        return now - timedelta(seconds=float(rel.group(1)) * _UNIT_S[rel.group(2)])
    if _CLOCK.match(text):
        try:
            clock = datetime.strptime(text.split(".")[0], "%H:%M:%S" if text.count(":") == 2 else "%H:%M")
        except ValueError:
            raise argparse.ArgumentTypeError(f"bad time {text!r}: HH:MM:SS out of range") from None
        micro = int(text.split(".")[1].ljust(6, "0")) if "." in text else 0
        return now.replace(hour=clock.hour, minute=clock.minute, second=clock.second, microsecond=micro)
    try:
        when = datetime.fromisoformat(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"bad time {text!r}: give an ISO time (2026-12-08T02:12:32), HH:MM:SS (today) or -5m (s/m/h/d ago)"
        ) from None
    return when.astimezone().replace(tzinfo=None) if when.tzinfo is not None else when


def grep_pattern(text: str):
    """The --grep pattern, compiled with RE2 (linear time on any line: the pattern is user input)."""
    import re2

    if not text or len(text) > MAX_PATTERN:
        raise argparse.ArgumentTypeError(f"--grep must be 1 to {MAX_PATTERN} characters")
    options = re2.Options()
    options.log_errors = False  # the one line below says it; RE2's own log would add lines on stderr
    try:
        return re2.compile(text, options)
    except Exception as exc:  # re2.error: lookaround, backreferences ... are not supported
        why = exc.args[0].decode(errors="replace") if exc.args and isinstance(exc.args[0], bytes) else str(exc)
        raise argparse.ArgumentTypeError(f"bad --grep pattern {text!r} for RE2: {why}") from None


def _rank(text: str) -> int:
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"bad rank {text!r}: a number >= 0")
    return int(text)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir", help="the job's run directory")
    p.add_argument("--rank", type=_rank, action="append", default=[], help="only this global rank (repeatable)")
    p.add_argument("--node", action="append", default=[], help="only this node's ranks (repeatable)")
    p.add_argument("--attempt", type=_rank, action="append", default=[], help="only this attempt (repeatable)")
    p.add_argument("--since", type=parse_time, help="from this time: ISO, HH:MM:SS (today) or -5m")
    p.add_argument("--until", type=parse_time, help="up to this time: ISO, HH:MM:SS (today) or -5m")
    p.add_argument("--grep", type=grep_pattern, help="only lines matching this RE2 pattern (searched anywhere in the text)")
    p.add_argument("--follow", "-f", action="store_true", help="keep printing new lines (Ctrl-C ends)")
    p.add_argument("--interval", type=seconds, default=0.5, help=argparse.SUPPRESS)


def make_filter(args: argparse.Namespace) -> LogFilter:
    pattern = args.grep
    return LogFilter(frozenset(args.rank), frozenset(args.node), frozenset(args.attempt), args.since, args.until,
                     (lambda s: pattern.search(s) is not None) if pattern is not None else None)


def main(args: argparse.Namespace) -> int:
    run_dir = Path(args.run_dir)
    if not (run_dir / LOGS_DIR).is_dir():
        print(f"trainguard logs: error: {run_dir} has no {LOGS_DIR}/ directory: not a trainguard run directory "
              "(or no worker started yet)", file=sys.stderr)
        return 2
    if args.since and args.until and args.since > args.until:
        print("trainguard logs: error: --since is after --until", file=sys.stderr)
        return 2
    keep = make_filter(args)
    try:
        if not args.follow:
            for line in merged_lines(run_dir, keep):
                print(line.format())
            return 0
        return _follow(run_dir, keep, args.interval)
    except BrokenPipeError:  # `| head`: the reader has what it wanted
        sys.stderr.close()
        return 0


def _follow(run_dir: Path, keep: LogFilter, interval: float) -> int:
    tail = LogTail(run_dir, keep)
    while True:
        for line in tail.read():
            print(line.format(), flush=True)
        sys.stdout.flush()
        time.sleep(interval)
