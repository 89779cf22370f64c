"""`trainguard trace RUN_DIR -o trace.json`: the run as a Chrome / Perfetto trace, plus its goodput."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections import defaultdict
from pathlib import Path

from trainguard.rundir.readers import NotARunDir, SpanTail, check_run_dir, read_events
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
    spans = SpanTail(run_dir, start_bytes=None, max_bytes_per_read=1 << 40).read()
    steps: dict[int, list[tuple[float, float]]] = defaultdict(list)
    for s in spans:
        if s.kind == "Step":
            steps[s.rank].append((s.end, s.duration))
    if args.kind:
        spans = [s for s in spans if s.kind in args.kind]
    g = goodput.compute(events, steps)
    doc = trace.build(events, spans, g)
    text = json.dumps(doc, separators=(",", ":"))
    if args.output == "-":
        sys.stdout.write(text + "\n")
        print(g.line(), file=sys.stderr)
        return 0
    out = Path(args.output)
    tmp = out.with_name(f".{out.name}.{os.getpid()}")
    try:
        tmp.write_text(text)
        os.replace(tmp, out)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        print(f"trainguard trace: error: cannot write {out}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    other = doc["otherData"]
    print(f"wrote {out}: {other['spans']} span(s) of {len(steps)} rank(s), {other['events']} event(s); "
          "open it in https://ui.perfetto.dev or chrome://tracing")
    print(g.line())
    return 0
