"""`trainguard` command line: one sub-command per module, imported only when used."""

from __future__ import annotations

import argparse
import importlib
import sys

from trainguard.exitcodes import EXIT_USAGE

# name -> (module, one-line help). Each module defines add_arguments(parser) and main(args) -> int.
COMMANDS: dict[str, tuple[str, str]] = {
    "run": ("trainguard.agent.cli", "launch a guarded job (torchrun's flags plus trainguard's)"),
    "events": ("trainguard.events.cli", "show a run's events (table, --json, --follow)"),
    "check": ("trainguard.checks.cli", "pre-flight checks of this node (seed item names and thresholds)"),
    "nodecheck": ("trainguard.checks.nodecheck_cli", "GEMM + collective health check in paired groups"),
    "profile": ("trainguard.monitors.profiling.cli", "switch lightweight profiling on/off at run time"),
    "diagnose": ("trainguard.diagnose.cli", "find the first failure and root cause in rank logs"),
    "slowdown": ("trainguard.diagnose.slowdown_cli", "warn when training slows down, from its logs"),
    "status": ("trainguard.view.status_cli", "live view of a run: ranks, steps, restarts, faults (--once for scripts)"),
    "trace": ("trainguard.view.trace_cli", "a run as a Chrome/Perfetto trace (-o trace.json), plus its goodput"),
    "logs": ("trainguard.view.logs_cli", "every rank's log of a run merged by time (--rank, --node, --attempt, --since, --until, --grep)"),
    "stacks": ("trainguard.view.stacks_cli", "dump every rank's Python stacks now (all nodes of the run)"),
    "chaos": ("trainguard.chaos.cli", "rehearse a failure on a running job: kill, stop, slow, fill-disk, corrupt-ckpt, net-*"),
    "dashboard": ("trainguard.web.server", "serve a run's dashboard on loopback (events, step heatmap, faults)"),
}



class _Parser(argparse.ArgumentParser):
    """argparse that reports bad usage as one clear line and exit code 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(EXIT_USAGE, f"trainguard {self.prog.split()[-1]}: error: {message}\n")


def _top_help() -> str:
    width = max(len(n) for n in COMMANDS)
    lines = ["usage: trainguard COMMAND [ARGS...]", "", "commands:"]
    lines += [f"  {name:<{width}}  {help_}" for name, (_, help_) in COMMANDS.items()]
    lines += ["", "`trainguard COMMAND --help` for a command's flags."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(_top_help())
        return 0
    if argv[0] == "--version":
        from trainguard import __version__

        print(__version__)
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"trainguard: error: unknown command {name!r}; commands: {', '.join(COMMANDS)}", file=sys.stderr)
        return EXIT_USAGE
    if name != "run":
        return _command(name, rest)
    from trainguard.spawn import zygote

    zygote.start_early(rest)  # its import of torch runs beside the agent's own imports
    try:
        return _command(name, rest)
    finally:
        zygote.close_early()  # one the launch never took (it stopped before starting workers)


def _command(name: str, rest: list[str]) -> int:
    module = importlib.import_module(COMMANDS[name][0])
    parser = module.make_parser() if hasattr(module, "make_parser") else _Parser(prog=f"trainguard {name}")
    if not hasattr(module, "make_parser"):
        parser.description = COMMANDS[name][1]
        module.add_arguments(parser)
    args = parser.parse_args(rest)
    try:
        return int(module.main(args) or 0)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
