"""`trainguard run [torchrun flags] [trainguard flags] SCRIPT [ARGS...]`

The parser is torchrun's own (so every torchrun flag means what it means there), extended with
trainguard's flags and each monitor's flags.
"""

from __future__ import annotations

import argparse
import math
import os
import sys

from torch.distributed.run import get_args_parser, parse_min_max_nnodes

from trainguard.events import Severity
from trainguard.exitcodes import EXIT_USAGE
from trainguard.monitors import plugins
from trainguard.options import node_name, seconds
from trainguard.schedulers import adapter as scheduler


def _one_line_error(parser: argparse.ArgumentParser):
    def error(message: str) -> None:
        parser.exit(EXIT_USAGE, f"trainguard run: error: {message}\n")

    return error


def _minutes(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected minutes, got {text!r}") from None
    if not 0 < value < 1e6:
        raise argparse.ArgumentTypeError(f"expected minutes > 0, got {text!r}")
    return value


def add_trainguard_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("trainguard")
    g.add_argument("--run-dir", default=None, help="run directory (default ./trainguard-runs/<job-id>)")
    g.add_argument("--job-id", default=None, help="job id used in the default run dir")
    g.add_argument("--node-name", type=node_name, default=None,
                   help="this node's name in events, exclude lists and Slurm (default: hostname); letters, digits, "
                   "'.', '_', '-'")
    g.add_argument(
        "--notify",
        action="append",
        default=None,
        metavar="URL",
        help="Apprise URL to notify (repeatable; also env TRAINGUARD_NOTIFY)",
    )
    g.add_argument("--notify-severity", default="error", help="least severity that notifies (default error)")
    g.add_argument(
        "--prestart-workers",
        choices=["on", "spawn", "off"],
        default="on",
        help="keep spare workers with torch imported ready for fast (re)starts: on = forked from a zygote "
        "that imported torch once (default); spawn = separate pre-started interpreters; off = none",
    )
    g.add_argument("--worker-stop-timeout", type=seconds, default=15, help="seconds between SIGTERM and SIGKILL")
    g.add_argument("--exit-barrier-timeout", type=float, default=300, help=argparse.SUPPRESS)
    g.add_argument("--quiet", action="store_true", help="do not echo worker output to the console")
    g.add_argument("--restart-on-error", action="store_true",
                   help="restart on the user's own exception too, as torchrun does, while --max-restarts allows "
                   "(default: such a failure stops the job at once: a retry would fail the same way)")
    g.add_argument("--hold-on-failure", type=_minutes, default=None, metavar="MINUTES",
                   help="when the job fails here, keep this node's agent (and its allocation) alive this long for "
                   "inspection; SIGTERM ends the hold early")


def _torchrun_abbreviations(parser: argparse.ArgumentParser) -> None:
    """Accept the abbreviations torchrun's parser accepts (``--redirect=3``, ``--nproc=2``: argparse's
    prefix matching), among torchrun's own flags only: trainguard's flags (and the monitors') need
    their full name, so an abbreviation torchrun takes means the same here however many flags
    trainguard adds, and a script flag such as --ckpt is never taken for our --ckpt-dir. One that
    fits several of torchrun's flags is not an option (argparse then says it is unrecognized)."""
    torch_options = set(parser._option_string_actions)
    find = parser._get_option_tuples

    def option_tuples(option_string: str) -> list:
        if not option_string.startswith("--"):
            return find(option_string)  # single-dash: argparse's own rules (-r3)
        parser.allow_abbrev = True
        try:
            found = [t for t in find(option_string) if t[1] in torch_options]
        finally:
            parser.allow_abbrev = False
        return found[:1] if len({id(t[0]) for t in found}) == 1 else []  # --a-b and --a_b: one action

    parser._get_option_tuples = option_tuples  # type: ignore[method-assign]


def make_parser() -> argparse.ArgumentParser:
    parser = get_args_parser()
    parser.allow_abbrev = False  # prefixes: torchrun's flags only (_torchrun_abbreviations)
    _torchrun_abbreviations(parser)
    parser.prog = "trainguard run"
    parser.description = "Launch a guarded distributed job. Accepts every torchrun flag."
    add_trainguard_arguments(parser)
    plugins.add_run_arguments(parser)
    scheduler.add_run_arguments(parser)
    parser.error = _one_line_error(parser)  # type: ignore[method-assign]
    return parser


def validate(args: argparse.Namespace) -> str | None:
    """A clear message for input we can reject before starting anything."""
    if not args.module and not args.no_python:
        script = args.training_script
        if not os.path.isfile(script):
            return f"training script not found: {script}"
    try:
        parse_min_max_nnodes(args.nnodes)
    except (RuntimeError, ValueError):
        return f"--nnodes {args.nnodes!r}: expected a number of nodes N or MIN:MAX"
    nproc = str(args.nproc_per_node).strip()
    if nproc.lstrip("-").isdigit() and int(nproc) < 1:
        return f"--nproc-per-node must be at least 1 (or auto, gpu, cpu), got {nproc}"
    if not (args.monitor_interval > 0 and math.isfinite(args.monitor_interval)):
        return f"--monitor-interval must be a number of seconds > 0, got {args.monitor_interval}"
    try:
        Severity.parse(args.notify_severity)
    except ValueError as exc:
        return f"--notify-severity: {exc}"
    return None


def main(args: argparse.Namespace) -> int:
    problem = validate(args)
    if problem:
        print(f"trainguard run: error: {problem}", file=sys.stderr)
        return EXIT_USAGE
    from trainguard.agent.launch import launch

    return launch(args)
