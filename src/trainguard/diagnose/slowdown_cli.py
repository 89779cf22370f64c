"""`trainguard slowdown LOG [--follow] [--window 5] [--threshold R]`: warn when training slows down.

Reads step times from a training log (Megatron-LM, HF Trainer / LLaMA-Factory progress and
trainer_log.jsonl, DeepSpeed, ``step=<n> ... t=<unix time>`` lines) and prints, per window of
iterations whose smoothed mean is at least ``1 + R`` times the fastest window so far::

    2025-04-21 15:25:56 Smoothed mean (iters 83-87: 9465.00 ms, baseline: 3101.00 ms), threshold ratio:2.05. Warning

Only one series is followed: ``--rank`` (default: the first rank that shows up in the log), and
of its lines the best source of step times the log offers (``StepObs.source_rank``): a log with
both a training progress bar and evaluation bars, or bars and ``step N`` messages, is not mixed.
"""

from __future__ import annotations

import argparse
import gzip
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO

from trainguard.detect.slowdown import DEFAULT_THRESHOLD, DEFAULT_WINDOW, SlowdownDetector
from trainguard.diagnose.lines import parse_line, rank_in_text
from trainguard.diagnose.sources import describe
from trainguard.diagnose.steplog import StepTimer, parse_step
from trainguard.options import non_negative_int, positive, positive_int

POLL_S = 0.5
MAX_LINE = 1 << 20


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("log", metavar="LOG", help="training log file (.gz too, not with --follow)")
    p.add_argument(
        "--follow", "-f", action="store_true", help="keep reading as the log grows (Ctrl-C to stop)"
    )
    p.add_argument(
        "--window", type=positive_int, default=DEFAULT_WINDOW, help="iterations per smoothed mean (default 5)"
    )
    p.add_argument("--threshold", type=positive, default=DEFAULT_THRESHOLD,
                   help="warn when mean/baseline - 1 reaches this (default 0.8, the seed's)")  # fmt: skip
    p.add_argument(
        "--rank", type=non_negative_int, default=None, help="rank whose steps to follow (default: the first seen)"
    )
    p.add_argument("--json", action="store_true", help="one JSON object per warning")


class SlowdownFollower:
    """Lines in, warnings out; the state of one `trainguard slowdown` run."""

    def __init__(
        self, window: int, threshold: float, rank: int | None, file_rank: int | None, year: int
    ) -> None:
        self.window, self.threshold = window, threshold
        self.detector = SlowdownDetector(window=window, threshold=threshold)
        self.timer = StepTimer()
        self.source: tuple[int, int] | None = None  # the source followed (StepObs.source_rank)
        self.rank = rank
        self.file_rank = file_rank
        self.year = year
        self.samples = 0

    def line(self, raw: str) -> tuple[str | None, object] | None:
        info = parse_line(raw, self.year)
        obs = parse_step(info.message, info.time)
        if obs is None:
            return None
        rank = info.rank if info.rank is not None else (obs.rank if obs.rank is not None else self.file_rank)
        if rank is None and "ank" in info.message:
            rank = rank_in_text(info.message)
        if self.rank is None:
            self.rank = rank
        if rank != self.rank:
            return None
        source = obs.source_rank()
        if self.source is None or source > self.source:  # a better source: start over with it
            self.source = source
            self.detector = SlowdownDetector(window=self.window, threshold=self.threshold)
            self.timer = StepTimer()
        elif source < self.source:
            if obs.bar_total:  # an evaluation or save bar ran: not the training steps' time
                self.timer.interrupt()
            return None
        sample = self.timer.feed(obs)
        if sample is None:
            return None
        self.samples += 1
        w = self.detector.feed(*sample)
        if w is None:
            return None
        stamp = raw[:19].replace("T", " ") if info.time is not None and raw[:4].isdigit() else None
        return stamp, w


def _lines(f: IO[bytes], follow: bool) -> Iterator[str]:
    buf = b""
    while True:
        chunk = f.read(1 << 16)
        if chunk:
            buf += chunk
            parts = buf.replace(b"\r", b"\n").split(b"\n")
            buf = parts.pop()
            if len(buf) > MAX_LINE:
                buf = b""
            for p in parts:
                if p:
                    yield p.decode("utf-8", errors="replace")
            continue
        if not follow:
            break
        try:  # truncated or replaced (log rotation): start over from the new file's beginning
            if os.fstat(f.fileno()).st_size < f.tell():
                f.seek(0)
                buf = b""
        except OSError:
            pass
        time.sleep(POLL_S)
    if buf:
        yield buf.decode("utf-8", errors="replace")


def main(args: argparse.Namespace) -> int:
    import json

    path = Path(args.log)
    if args.window < 1 or args.threshold <= 0:
        print("trainguard slowdown: error: --window must be >= 1 and --threshold > 0", file=sys.stderr)
        return 2
    if not path.is_file():
        what = "is not a regular file" if path.exists() else "no such file"
        print(f"trainguard slowdown: error: {path}: {what}", file=sys.stderr)
        return 2
    if args.follow and path.name.endswith(".gz"):
        print("trainguard slowdown: error: --follow does not work on .gz files", file=sys.stderr)
        return 2
    src = describe(path)
    fol = SlowdownFollower(args.window, args.threshold, args.rank, src.rank, src.year)
    opener = gzip.open if path.name.endswith(".gz") else open
    try:
        with opener(path, "rb") as f:
            for raw in _lines(f, args.follow):
                out = fol.line(raw)
                if out is None:
                    continue
                stamp, w = out
                if args.json:
                    print(json.dumps({"time": stamp, "rank": fol.rank, **w.to_dict()}), flush=True)
                else:
                    print(f"{stamp + ' ' if stamp else ''}{w.format()}", flush=True)
    except KeyboardInterrupt:
        return 0
    except BrokenPipeError:  # `trainguard slowdown ... | head`
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except (OSError, EOFError) as exc:
        print(f"trainguard slowdown: error: {path}: {exc}", file=sys.stderr)
        return 1
    if fol.samples == 0:
        print(f"trainguard slowdown: no step times found in {path}", file=sys.stderr)
    return 0
