"""`trainguard status RUN_DIR [--once] [--json]`: where the job is, rank by rank.

The live view redraws every second (rich); ``--once`` prints the same as plain, stable text for
scripts, ``--json`` the whole summary. Shows seed 003's fault-tolerance counts: the maximum number
of restarts, the restarts used and the reschedules caused by hardware faults.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from datetime import datetime
from pathlib import Path
from typing import Any

from trainguard.cluster import node_history
from trainguard.options import non_negative, non_negative_int, seconds
from trainguard.rundir.readers import NotARunDir
from trainguard.view.live import RunView


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir", help="the job's run directory")
    p.add_argument("--once", action="store_true", help="print once as plain text and exit (for scripts)")
    p.add_argument("--json", action="store_true", help="print the whole summary as JSON once and exit")
    p.add_argument("--interval", type=seconds, default=1.0, help="seconds between redraws of the live view")
    p.add_argument("--node-history", default=None, metavar="PATH",
                   help=f"the site's node history (default {node_history.DEFAULT_NAME} next to the run dir)")
    p.add_argument("--node-history-faults", type=non_negative_int, default=node_history.DEFAULT_FAULTS, metavar="K",
                   help="faults in the window that refuse a host, as given to `trainguard run`")
    p.add_argument("--node-history-window", type=non_negative, default=node_history.DEFAULT_WINDOW_S,
                   metavar="SECONDS", help="how far back the node history counts")


def history_summary(run_dir: Path, args: argparse.Namespace) -> dict[str, Any]:
    """The hosts the site's node history holds hardware-class faults of, within the window, and
    which of them the pre-check refuses."""
    path = node_history.path_for(getattr(args, "node_history", None), run_dir)
    window = getattr(args, "node_history_window", node_history.DEFAULT_WINDOW_S)
    limit = getattr(args, "node_history_faults", node_history.DEFAULT_FAULTS)
    out: dict[str, Any] = {"path": str(path), "hosts": {}, "error": None}
    try:
        faults = node_history.NodeHistory(path).faults(time.time() - window)
    except node_history.HistoryUnavailable as exc:
        out["error"] = str(exc)
        return out
    refused = node_history.refused_hosts(faults, limit)
    for f in node_history.counted(faults):
        host = out["hosts"].setdefault(f.host, {"faults": 0, "refused": f.host in refused, "last": None})
        host["faults"] += 1
        host["last"] = f.to_dict()
    return out


def history_line(h: dict[str, Any]) -> str | None:
    if h["error"]:
        return f"node history: {h['error']}"
    if not h["hosts"]:
        return None
    said = "; ".join(f"{name} {v['faults']} fault(s), last {v['last']['kind']} {_clock(v['last']['time'])}"
                     + (" (refused at the pre-check)" if v["refused"] else "") for name, v in sorted(h["hosts"].items()))
    return f"node history: {said}"


def _clock(t: float | None) -> str:
    return "-" if t is None else datetime.fromtimestamp(t).strftime("%H:%M:%S")


def _ms(s: float | None) -> str:
    return "-" if s is None else f"{s * 1000:.1f} ms"


def _cut(text: str, n: int) -> str:
    text = " ".join(text.split())
    return text if len(text) <= n else text[: n - 1] + "…"


def _counts(snap: dict[str, Any]) -> str:
    mx = snap["max_restarts"]
    return (f"max restarts {mx if mx is not None else '-'}, restarts used {snap['restarts_used']}, "
            f"reschedules for hardware faults {snap['hardware_reschedules']}, hangs {snap['hangs']}")


def rank_cells(r: dict[str, Any]) -> list[str]:
    ev = r["last_event"]
    score = r["straggler_score"]
    mark = " (straggler)" if r["straggler"] else ""
    return [
        str(r["rank"]),
        r["node"] or "-",
        str(r["pid"] or "-"),
        "-" if r["step"] is None else str(r["step"]),
        _ms(r["step_time"]),
        ("-" if score is None else f"{score:.2f}") + mark,
        "-" if ev is None else f"{_clock(ev['time'])} {ev['kind']}: {_cut(ev['message'], 70)}",
    ]


HEADERS = ["rank", "node", "pid", "step", "step time", "straggler", "last event"]


def render_text(run_dir: str, snap: dict[str, Any]) -> str:
    lines = [
        f"run dir:     {run_dir}",
        f"job:         {snap['state']}",
        f"faults:      {_counts(snap)}",
        f"checkpoint:  last step {snap['checkpoint_last_step'] if snap['checkpoint_last_step'] is not None else '-'}, "
        f"save stall {_ms(snap['checkpoint_stall_seconds'])}",
        f"{snap['goodput_line']}",
    ]
    for n in snap["nodes"]:
        held = f", held until {_clock(n['held_until'])}" if n["held_until"] else ""
        lines.append(f"node {n['node']}: {n['state']}, attempt {n['attempt']}, ranks {n['ranks']}, "
                     f"restarts used {n['restarts_used']}/{n['max_restarts'] if n['max_restarts'] is not None else '-'}{held}")
    if snap["diagnoses"]:
        d = snap["diagnoses"][-1]
        lines.append(f"diagnosis:   {_clock(d['time'])} {d['category']}: {_cut(str(d['summary']), 100)}")
    if (h := snap.get("node_history")) and (line := history_line(h)):
        lines.append(line)
    for s in snap["stragglers"][-3:]:
        lines.append(f"straggler:   {_clock(s['time'])} {_cut(s['message'], 110)}")
    rows = [HEADERS] + [rank_cells(r) for r in snap["ranks"]]
    widths = [max(len(row[i]) for row in rows) for i in range(len(HEADERS) - 1)]
    lines.append("")
    for row in rows:
        lines.append("  ".join(c.rjust(w) if i in (0, 2, 3, 4) else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths, strict=False)))
                     + "  " + row[-1])
    return "\n".join(lines)


def _rich(run_dir: str, snap: dict[str, Any]):
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    style = {"running": "green", "succeeded": "green", "restarting": "yellow", "recovering": "yellow",
             "held": "magenta", "failed": "red", "excluded": "red"}.get(snap["state"], "")
    head = Text.assemble(("job ", "bold"), (snap["state"], f"bold {style}"), f"   {run_dir}\n", _counts(snap), "\n",
                         snap["goodput_line"])
    table = Table(expand=True)
    for h in HEADERS:
        table.add_column(h, justify="right" if h in ("rank", "pid", "step", "step time") else "left",
                         ratio=3 if h == "last event" else None)
    for r in snap["ranks"]:
        cells = rank_cells(r)
        table.add_row(*cells, style="yellow" if r["straggler"] else None)
    parts: list[Any] = [head, table]
    if (h := snap.get("node_history")) and (line := history_line(h)):
        parts.append(Text(line, style="yellow"))
    if snap["diagnoses"]:
        d = snap["diagnoses"][-1]
        parts.append(Text(f"diagnosis {_clock(d['time'])}: {d['category']}: {d['summary']}", style="red"))
    return Group(*parts)


def main(args: argparse.Namespace) -> int:
    try:
        view = RunView(args.run_dir)
    except NotARunDir as exc:
        print(f"trainguard status: error: {exc}", file=sys.stderr)
        return 2
    try:
        view.refresh()
        if args.json or args.once:
            snap = {**view.snapshot(), "node_history": history_summary(view.run_dir, args)}
            if args.json:
                print(json.dumps(snap, default=str))
            else:
                print(render_text(str(view.run_dir), snap))
            return 0
        from rich.live import Live

        def frame():
            return _rich(str(view.run_dir), {**view.snapshot(), "node_history": history_summary(view.run_dir, args)})

        with Live(frame(), refresh_per_second=4, screen=False) as live:
            while True:
                time.sleep(max(0.2, args.interval))
                view.refresh()
                live.update(frame())
    except KeyboardInterrupt:
        return 0
    finally:
        view.close()
