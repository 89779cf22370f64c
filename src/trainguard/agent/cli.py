"""`trainguard run [torchrun flags] [trainguard flags] SCRIPT [ARGS...]`

The parser is torchrun's own (so every torchrun flag means what it means there), extended with
trainguard's flags, each monitor's flags and the scheduler's. ``main`` turns the parsed flags into
one typed, checked ``RunSettings`` (agent/settings.py) and launches with it: nothing below reads
the command line.
"""

from __future__ import annotations

import argparse
import os
import sys

from torch.distributed.run import get_args_parser

from trainguard.agent.settings import RunSettings
from trainguard.cluster.node_history import DEFAULT_NAME
from trainguard.exitcodes import EXIT_USAGE
from trainguard.monitors import plugins
from trainguard.options import SettingsError, node_name, non_negative, non_negative_int, seconds
from trainguard.policy import PolicySettings
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
    g.add_argument("--nan-replays", type=non_negative_int, default=None, metavar="N",
                   help="NaN triage: replay up to N NaN/inf failures per run from the newest finite snapshot, with "
                   "every rank's gradients checked, before stopping on them (0: stop at once; default "
                   f"{PolicySettings.nan_replays})")
    g.add_argument("--restart-loop-attempts", type=non_negative_int, default=None, metavar="K",
                   help="stop the job (exit 1) when K consecutive attempts fail the same way without passing the "
                   "step the attempt before failed at; when the failures follow one node of several, exclude "
                   "that node instead (0: off, default 3)")
    g.add_argument("--node-history", default=None, metavar="PATH",
                   help="the site's record of failed hosts (SQLite, in a directory the nodes share; default "
                   f"{DEFAULT_NAME} next to the run dir)")
    g.add_argument("--node-history-faults", type=non_negative_int, default=None, metavar="K",
                   help="refuse a host at the pre-check that had K hardware-class faults in the window (0: off, default 2)")
    g.add_argument("--node-history-window", type=non_negative, default=None, metavar="SECONDS",
                   help="how far back the node history counts (default 604800: a week)")
    g.add_argument("--standby", action="store_true",
                   help="run this agent as a warm standby node: it joins the job's c10d rendezvous once the job's "
                   "round has formed, waits with torch imported and trains nothing, and takes the place of the next "
                   "node lost, so the world size stays the same (start one extra agent per standby node, with the "
                   "job's --nnodes MIN:MAX and its own --node-name)")
    g.add_argument("--hold-on-failure", type=_minutes, default=None, metavar="MINUTES",
                   help="when the job fails here, keep this node's agent (and its allocation) alive this long for "
                   "inspection; SIGTERM ends the hold early")
    g.add_argument("--rdzv-wait-minutes", type=_minutes, default=30.0, metavar="MINUTES",
                   help="how long a node (a replacement for a lost one included) waits in the rendezvous for its "
                   "peers before it exits 201 (torch's join_timeout, where --rdzv-conf does not set it; default 30, "
                   "ModelArts' queueing limit for a re-dispatched job)")


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


def _restarts_left_unset(parser: argparse.ArgumentParser) -> None:
    """--max-restarts not given (nor PET_MAX_RESTARTS) is None, not torchrun's 0: the settings
    then read the restart budget from the pod's annotations (schedulers/kubernetes.py)."""
    for action in parser._actions:
        if action.dest == "max_restarts":
            action.help = (f"{action.help.rstrip('.')} (not given: the pod annotation fault-tolerance/job-retry-num "
                           "in the downward API file $TRAINGUARD_POD_ANNOTATIONS or /etc/podinfo/annotations, else 0)")
            if "PET_MAX_RESTARTS" not in os.environ:
                action.default = None


def make_parser() -> argparse.ArgumentParser:
    try:
        parser = get_args_parser()
    except ValueError as exc:  # torch reads its PET_* switches as int(value) while building the parser
        raise SystemExit(_bad_switch(str(exc))) from None
    _restarts_left_unset(parser)
    parser.allow_abbrev = False  # prefixes: torchrun's flags only (_torchrun_abbreviations)
    _torchrun_abbreviations(parser)
    parser.prog = "trainguard run"
    parser.description = (
        "Launch a guarded distributed job. Accepts every torchrun flag. Without --rdzv-* flags the rendezvous "
        "comes from the environment: Slurm, PET_*, --hostfile, MASTER_ADDR/MASTER_PORT, Volcano's host files; "
        "one node: standalone."
    )
    add_trainguard_arguments(parser)
    plugins.add_run_arguments(parser)
    scheduler.add_run_arguments(parser)
    parser.error = _one_line_error(parser)  # type: ignore[method-assign]
    return parser


def _bad_switch(error: str) -> int:
    """One line for a PET_* switch (PET_STANDALONE, PET_NO_PYTHON...) torch's parser cannot read."""
    literal = error.rpartition(": ")[2]
    bad = [(k, v) for k, v in sorted(os.environ.items()) if k.startswith("PET_") and repr(v) == literal]
    which = f"{bad[0][0]}={bad[0][1]!r}" if bad else "a PET_* variable"
    print(f"trainguard run: error: {which}: expected 0 or 1 ({error})", file=sys.stderr)
    return EXIT_USAGE


def main(args: argparse.Namespace) -> int:
    """Build the run's settings once (every check: one line, exit EXIT_USAGE, nothing started),
    then launch with them: below this point no room reads the command line."""
    try:
        settings = RunSettings.from_args(args)
    except SettingsError as exc:
        print(f"trainguard run: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    from trainguard.agent.launch import launch

    return launch(settings)
