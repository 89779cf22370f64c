"""`trainguard run` refuses what cannot be right with one line on stderr and exit code 2, before
anything starts (no run dir, no worker): bad flag values, and a monitor that cannot
start — unless the user switched that monitor off."""

from __future__ import annotations

import os
import subprocess

import pytest
from tgtest import EXAMPLE, trainguard_cmd


def run(tmp_path, *argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    full = trainguard_cmd("run", "--standalone", "--run-dir", tmp_path / "run", *argv, EXAMPLE, "--steps", "2")
    environ = {k: v for k, v in os.environ.items() if k not in ("TRAINGUARD_HANG_DETECT_TIME", "MA_HANG_DETECT_TIME")}
    return subprocess.run(full, capture_output=True, text=True, timeout=120, cwd=tmp_path, env={**environ, **(env or {})})


def assert_refused(res: subprocess.CompletedProcess, tmp_path, needle: str) -> None:
    assert res.returncode == 2, res
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1, res.stderr  # one line, no traceback
    assert lines[0].startswith("trainguard run: error: ") and needle in lines[0], lines[0]
    assert not (tmp_path / "run").exists(), "nothing may start: no run dir"


@pytest.mark.parametrize(
    "argv,needle",
    [
        (["--nproc-per-node", "0"], "--nproc-per-node must be at least 1"),
        (["--monitor-interval", "0"], "--monitor-interval must be a number of seconds > 0"),
        (["--notify-severity", "bogus"], "unknown severity 'bogus'"),
        (["--node-name", "a/b"], "--node-name: 'a/b' is not a node name"),
        # a comma would drain and exclude other Slurm nodes; spaces and shell characters
        # end up in the printed sbatch line and the exclude-nodes file
        (["--node-name", "n1,n2"], "--node-name: 'n1,n2' is not a node name"),
        (["--node-name", "n1 n2"], "--node-name: 'n1 n2' is not a node name"),
        (["--node-name", "n1;reboot"], "--node-name: 'n1;reboot' is not a node name"),
        (["--node-name", "$(id)"], "--node-name: '$(id)' is not a node name"),
    ],
)
def test_bad_run_flag_values_are_one_line_exit_2(tmp_path, argv, needle):
    assert_refused(run(tmp_path, *argv), tmp_path, needle)


def test_bad_hang_detect_time_in_the_environment_stops_the_launch(tmp_path):
    res = run(tmp_path, env={"TRAINGUARD_HANG_DETECT_TIME": "abc"})
    assert_refused(res, tmp_path, "TRAINGUARD_HANG_DETECT_TIME='abc'")
    assert "--no-hang-detect" in res.stderr  # says how to switch it off instead


def test_missing_diagnose_rules_file_stops_the_launch(tmp_path):
    res = run(tmp_path, "--diagnose-rules", str(tmp_path / "missing.toml"))
    assert_refused(res, tmp_path, "missing.toml")
    assert "--no-diagnose" in res.stderr


@pytest.mark.slow
def test_a_monitor_switched_off_does_not_read_its_settings(tmp_path):
    res = run(
        tmp_path, "--no-hang-detect", "--no-diagnose", "--diagnose-rules", str(tmp_path / "missing.toml"),
        "--nproc-per-node", "1", "--precheck", "off", env={"TRAINGUARD_HANG_DETECT_TIME": "abc"},
    )  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    assert "Traceback" not in res.stderr
