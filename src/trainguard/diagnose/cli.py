"""`trainguard diagnose PATH... [--json]`: first failure, root cause, evidence and fix from logs."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

from trainguard.detect.slowdown import DEFAULT_THRESHOLD, DEFAULT_WINDOW
from trainguard.diagnose.readstats import read_line
from trainguard.options import positive, positive_int


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("paths", nargs="+", metavar="PATH", help="log files, directories, globs (.gz .bz2 .xz .zst, UTF-8/16/32)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--rules", action="append", type=Path, default=[], metavar="FILE",
                   help="extra rules file (TOML, same format as the built-in rules); repeatable")  # fmt: skip
    p.add_argument("--max-mb", type=positive, default=None, metavar="MB",
                   help="read only the first 1 MB and the last MB of each file's text (after decompression; "
                        "a compressed file is decompressed no further than 16 x MB)")  # fmt: skip
    p.add_argument(
        "--window", type=positive_int, default=DEFAULT_WINDOW, help="slowdown smoothing window (iterations)"
    )
    p.add_argument(
        "--threshold",
        type=positive,
        default=DEFAULT_THRESHOLD,
        help="slowdown warning ratio (mean/baseline - 1)",
    )


def _fmt_hit(h: dict[str, Any]) -> str:
    where = " ".join(x for x in (
        f"rank {h['rank']}" if h.get("rank") is not None else "",
        f"host {h['host']}" if h.get("host") else "",
        h.get("time") or "",
    ) if x)  # fmt: skip
    return (f"  [{where}] " if where else "  ") + str(h.get("line", ""))


def _label(category: str) -> str:
    return "no failure found" if category == "healthy" else category


def _hypotheses(r: dict[str, Any]) -> list[str]:
    hs = r.get("hypotheses") or []
    if len(hs) < 2 and r.get("confidence") != "low":
        return []
    out = ["hypotheses:"]
    for i, h in enumerate(hs, 1):
        who = f" (rank {h['rank']})" if h.get("rank") is not None else ""
        out.append(f"  {i}. {_label(h['category'])}{who} [{h['confidence']}]: {h['summary']}")
        out += [f"       {ln}" for ln in h.get("evidence", [])[:2]]
    return out


def render(r: dict[str, Any]) -> str:
    head = "no failure found in these logs" if r["category"] == "healthy" else r["category"]
    out = [f"category:   {head}  (confidence: {r['confidence']})", f"summary:    {r['summary']}"]
    if r.get("low_confidence"):
        out.append(r["low_confidence"])
    ff = r.get("first_failure")
    if ff:
        out.append("first failure:")
        out.append(_fmt_hit(ff))
        if ff.get("file"):
            out.append(f"    at {ff['file']}" + (f":{ff['line_no']}" if ff.get("line_no") else ""))
        if ff.get("context"):
            out.append("    logged just before it:")
            out += [f"      {c}" for c in ff["context"][-6:]]
    if r.get("evidence"):
        out.append("evidence:")
        out += [_fmt_hit(h) for h in r["evidence"]]
    out += _hypotheses(r)
    if r.get("cascade"):
        out.append("then (cascade on other ranks):")
        out += [_fmt_hit(h) for h in r["cascade"][:8]]
    for f in r.get("findings", []):
        out.append(f"finding {f['id']}: {f['message']}")
        if f.get("fix"):
            out.append(f"  fix: {f['fix']}")
    if r.get("slowdown"):
        out.append("slowdown:")
        out += [f"  {w['message']}" for w in r["slowdown"]["warnings"]]
    if r.get("fix"):
        out.append(f"fix: {r['fix']}")
    for n in r.get("notes", []):
        out.append(f"note: {n}")
    out += [f"read in part: {p['detail']}" for p in r.get("stats", {}).get("partial", [])
            if p["reason"] == "over_limit" and p["detail"] not in r.get("notes", [])][:8]  # fmt: skip
    out.append(read_line(r.get("stats", {})))
    return "\n".join(out)


def main(args: argparse.Namespace) -> int:
    from trainguard.diagnose import DiagnoseError, diagnose_paths

    if args.window < 1 or args.threshold <= 0 or (args.max_mb is not None and args.max_mb <= 0):
        print(
            "trainguard diagnose: error: --window must be >= 1, --threshold and --max-mb > 0", file=sys.stderr
        )
        return 2
    try:
        result = diagnose_paths(
            args.paths,
            args.rules,
            max_bytes_per_file=None if args.max_mb is None else int(args.max_mb * (1 << 20)),
            window=args.window,
            threshold=args.threshold,
        )
    except DiagnoseError as exc:
        print(f"trainguard diagnose: error: {exc}", file=sys.stderr)
        return 2
    try:
        print(
            json.dumps(result, ensure_ascii=False, default=str) if args.json else render(result), flush=True
        )
    except BrokenPipeError:  # `trainguard diagnose ... | head`
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 0
