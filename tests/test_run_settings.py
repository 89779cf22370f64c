"""`trainguard run`'s options are ONE typed, validated settings object: built once at the
parser (agent/settings.py ``RunSettings.from_args``), each room below getting only its typed part;
a bad value in any part is one line and exit 2 with nothing started; and no room but the parser
and the settings builder takes argparse's Namespace."""

from __future__ import annotations

import argparse
import ast
import dataclasses
import os
from pathlib import Path

import pytest

from trainguard.agent import cli
from trainguard.agent import launch as launch_module
from trainguard.agent.settings import LaunchSettings, RunSettings, TorchRun
from trainguard.events import Severity
from trainguard.exitcodes import EXIT_USAGE
from trainguard.monitors import checks, diagnosis, liveness
from trainguard.monitors.hang import monitor as hang
from trainguard.monitors.profiling import monitor as profiling
from trainguard.policy import PolicySettings
from trainguard.schedulers.adapter import SchedulerSettings

SRC = Path(__file__).resolve().parents[1] / "src" / "trainguard"
NO_ENV = ("TRAINGUARD_HANG_DETECT_TIME", "MA_HANG_DETECT_TIME", "TRAINGUARD_NOTIFY", "MINDX_TASK_ID")


@pytest.fixture
def script(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the default run dir would be made here: nothing may be
    for name in NO_ENV:
        monkeypatch.delenv(name, raising=False)
    path = tmp_path / "train.py"
    path.write_text("")
    return str(path)


def parse(script: str, *argv: str) -> argparse.Namespace:
    return cli.make_parser().parse_args([*argv, script, "--lr", "1"])


def test_each_room_gets_its_own_typed_part(script):
    args = parse(script, "--standalone", "--nproc-per-node", "2", "--exclude-straggler", "--hang-period", "0.5",
                 "--no-diagnose", "--slurm-drain", "--on-exclude", "notify-me now", "--quiet",
                 "--heartbeat-interval", "3", "--node-name", "n1", "--notify-severity", "warning")  # fmt: skip
    s = RunSettings.from_args(args, env={})
    assert isinstance(s.launch, LaunchSettings) and isinstance(s.policy, PolicySettings)
    assert isinstance(s.scheduler, SchedulerSettings) and isinstance(s.torchrun, TorchRun)
    assert s.policy.exclude_straggler and s.policy.nnodes == "1:1"
    assert (s.scheduler.drain, s.scheduler.on_exclude, s.scheduler.job) == (True, ("notify-me", "now"), None)
    assert isinstance(s.monitors["hang"], hang.HangSettings) and s.monitors["hang"].config.period == 0.5
    assert isinstance(s.monitors["diagnosis"], diagnosis.DiagnosisSettings) and not s.monitors["diagnosis"].enabled
    assert isinstance(s.monitors["checks"], checks.ChecksSettings)
    assert isinstance(s.monitors["liveness"], liveness.LivenessSettings) and s.monitors["liveness"].interval_s == 3
    assert isinstance(s.monitors["profiling"], profiling.ProfilingRunSettings)
    assert (s.monitors["profiling"].profiling.aging_fraction, s.monitors["profiling"].profiling.root) == (0.2, "")
    seed_layout = RunSettings.from_args(parse(script, "--standalone", "--profiling-aging-fraction", "0.5",
                                              "--profiling-root", "prof"), env={}).monitors["profiling"].profiling
    assert (seed_layout.aging_fraction, seed_layout.root) == (0.5, "prof")
    assert s.monitors["stacks"] is None  # no settings of its own
    launch = s.launch
    assert launch.run_dir.is_absolute() and launch.node_names == ("n1",) and launch.tee_ranks == frozenset()
    assert launch.target.script == script and launch.script_args == ("--lr", "1")
    assert launch.notify_severity == Severity.parse("warning") and not launch.standby
    standby = RunSettings.from_args(parse(script, "--nnodes", "2:3", "--rdzv-backend", "c10d", "--standby"), env={})
    assert standby.launch.standby
    # torchrun's single-node defaults, set in one place, for torch's config_from_args only
    ns = s.torchrun.args
    assert s.torchrun.single and (ns.rdzv_backend, ns.rdzv_endpoint, ns.master_port) == ("c10d", "localhost:0", 29500)
    assert ns.log_dir == os.devnull and not s.torchrun.torch_files
    for part in (s, s.launch, s.policy, s.scheduler, s.torchrun, s.monitors["hang"]):
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(part, dataclasses.fields(part)[0].name, None)
    assert not (Path.cwd() / "trainguard-runs").exists()


def test_settings_are_built_once_and_launch_gets_them(script, monkeypatch):
    built, launched = [], []
    real = RunSettings.from_args.__func__

    def counting(klass, args, env=os.environ):
        built.append(real(klass, args, env))
        return built[-1]

    monkeypatch.setattr(RunSettings, "from_args", classmethod(counting))
    monkeypatch.setattr(launch_module, "launch", lambda settings: launched.append(settings) or 0)
    assert cli.main(parse(script, "--no-slurm")) == 0
    assert len(built) == 1 and launched == built


@pytest.mark.parametrize(
    "argv,env,needle",
    [
        (["--nproc-per-node", "0"], {}, "--nproc-per-node must be at least 1"),  # torchrun's flags
        (["--nnodes", "2:x"], {}, "--nnodes '2:x': expected a number of nodes"),  # the policy's nnodes
        (["--redirects", "9"], {}, "--redirects '9': expected 0-3"),  # torch would trace back building its config
        (["--tee", "0:1,1:zz"], {}, "--tee '0:1,1:zz': expected 0-3"),
        (["--notify", "nosuchscheme://x"], {}, "notification URL not understood"),  # the launch part
        # a standby waits beyond --nnodes MAX in a c10d rendezvous: neither exists here
        (["--standby", "--standalone"], {}, "--standby joins another agent's rendezvous"),
        (["--standby"], {}, "--standby needs the c10d rendezvous"),  # torchrun's default: static
        (["--standby", "--nnodes", "2:3", "--rdzv-backend", "etcd-v2"], {}, "--standby needs the c10d rendezvous"),
        (["--standby-nodes", "1"], {}, "--standby-nodes picks the standby nodes of a Slurm step"),  # no step here
        ([], {"TRAINGUARD_HANG_DETECT_TIME": "abc"}, "TRAINGUARD_HANG_DETECT_TIME='abc'"),  # a monitor's
        ([], {"MINDX_TASK_ID": ".."}, "MINDX_TASK_ID='..' cannot be a folder name"),  # profiling's task folder
        # the scheduler's: the allocation names this node with a name that is none
        ([], {"SLURM_JOB_ID": "7", "SLURMD_NODENAME": "n1;reboot", "SLURM_JOB_NODELIST": "n1"}, "give --node-name"),
    ],
)
def test_a_bad_value_in_any_part_is_one_line_and_nothing_starts(script, monkeypatch, capsys, argv, env, needle):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(launch_module, "launch", lambda settings: pytest.fail("launched"))
    assert cli.main(parse(script, *argv)) == EXIT_USAGE
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("trainguard run: error: ") and needle in lines[0], lines
    assert not (Path.cwd() / "trainguard-runs").exists()


def test_a_bad_flag_value_is_refused_by_the_parser_in_one_line(script, capsys):
    with pytest.raises(SystemExit) as exited:
        parse(script, "--on-exclude", "")  # the scheduler's flag
    assert exited.value.code == EXIT_USAGE
    assert capsys.readouterr().err.strip().splitlines() == ["trainguard run: error: argument --on-exclude: "
                                                            "expected a command, got an empty string"]


# ------------------------------------------------------------------ no room reads the command line

ROOMS = ["agent/launch.py", "agent/elastic.py", "policy.py", "schedulers", "monitors"]
# The builder's steps: they read (or, for Slurm, fill) the parsed flags, and only the settings
# builder calls them (checked below). Every other function of the rooms gets typed settings.
BUILDER_STEPS = {"from_options", "settings", "read_settings", "config_from", "autodetect", "apply"}
BUILDER = {"agent/settings.py", "monitors/plugins.py", "monitors/profiling/monitor.py"}


def _room_files() -> list[Path]:
    files: list[Path] = []
    for room in ROOMS:
        p = SRC / room
        files += [p] if p.is_file() else sorted(p.rglob("*.py"))
    # other commands' own entry points (`trainguard profile`...) are not `run`'s rooms
    return [f for f in files if f.name != "cli.py" and not f.name.endswith("_cli.py")]


def _functions(path: Path):
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node


def test_no_room_below_the_parser_takes_the_namespace():
    offenders = []
    for path in _room_files():
        for fn in _functions(path):
            annotations = [a.annotation for a in [*fn.args.args, *fn.args.kwonlyargs] if a.annotation is not None]
            if any("Namespace" in ast.unparse(a) for a in annotations) and fn.name not in BUILDER_STEPS:
                offenders.append(f"{path.relative_to(SRC)}:{fn.lineno} {fn.name}")
    assert offenders == [], offenders


def test_the_builder_steps_are_called_by_the_settings_builder_only():
    callers = []
    for path in sorted(SRC.rglob("*.py")):
        rel = str(path.relative_to(SRC))
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(node, ast.Call):
                continue
            name = ast.unparse(node.func)
            if name.endswith(("read_settings", "autodetect", "PolicySettings.from_options",
                              "SchedulerSettings.from_options")) and rel not in BUILDER:
                callers.append(f"{rel}:{node.lineno} {name}")
    assert callers == [], callers
