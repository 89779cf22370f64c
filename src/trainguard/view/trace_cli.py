"""`trainguard trace RUN_DIR -o trace.json`: the run as a Chrome / Perfetto trace, plus its goodput."""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from pathlib import Path

from trainguard import runfiles
from trainguard.events.store import SIDE_FILES, event_dbs
from trainguard.rundir.readers import NotARunDir, check_run_dir, iter_spans, read_events
from trainguard.view import goodput, trace


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir", help="the job's run directory")
    p.add_argument("-o", "--output", default="trace.json", help="where to write the trace (default trace.json; - for stdout)")
    p.add_argument("--kind", action="append", default=None,
                   help="only spans of this kind (Step, FP, DataLoader, Communication, SaveCheckpoint, User; repeatable)")


def main(args: argparse.Namespace) -> int:
    try:
        run_dir = check_run_dir(args.run_dir)
    except NotARunDir as exc:
        print(f"trainguard trace: error: {exc}", file=sys.stderr)
        return 2
    events = read_events(run_dir)
    # Two passes over the span records, none of them held: the first for t0 and the reference
    # rank's steps (goodput), the second writes them.
    steps: dict[int, list[tuple[float, float]]] = defaultdict(list)
    t0 = min((e.time for e in events), default=float("inf"))
    for s in iter_spans(run_dir):
        t0 = min(t0, s.start)
        if s.kind == "Step":
            steps[s.rank].append((s.end, s.duration))
    t0 = 0.0 if t0 == float("inf") else t0
    g = goodput.compute(events, steps)
    spans = (s for s in iter_spans(run_dir) if not args.kind or s.kind in args.kind)
    if args.output == "-":
        other = trace.write(sys.stdout.buffer, events, spans, t0, g)
        sys.stdout.flush()
        print(g.line(), file=sys.stderr)
        return 0
    out = Path(args.output)
    protect = [p.with_name(p.name + side) for p in event_dbs(run_dir) for side in ("", *SIDE_FILES)]
    try:
        with runfiles.replace(out, protect=protect) as f:
            other = trace.write(f, events, spans, t0, g)
    except OSError as exc:
        why = str(exc) if isinstance(exc, runfiles.UnsafeFile) else f"cannot write {out}: {exc.strerror or exc}"
        print(f"trainguard trace: error: {why}", file=sys.stderr)
        return 2
    print(f"wrote {out}: {other['spans']} span(s) of {len(steps)} rank(s), {other['events']} event(s); "
          "open it in https://ui.perfetto.dev or chrome://tracing")
    print(g.line())
    return 0
