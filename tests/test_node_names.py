"""Node names are data that ends up in Slurm lists, shell lines and files (issue 28, item 14):
refused at the parser unless letters, digits, '.', '_', '-' (tests/test_run_usage.py); the
exclude-nodes file is one name a line; a name that is not one is never drained or listed; two
agents under one name in one job stop it with a clear message."""

from __future__ import annotations

import shlex

import pytest
from tgtest import EXAMPLE, free_port

from trainguard.options import node_name_problem
from trainguard.schedulers import adapter, hostlist, slurm

STEP_ENV = {"SLURM_JOB_ID": "4711", "SLURM_JOB_NODELIST": "n[1-3]", "SLURM_JOB_NUM_NODES": "3", "SLURM_STEP_ID": "0",
            "SLURM_STEP_NODELIST": "n[1-3]", "SLURM_NODEID": "1", "SLURMD_NODENAME": "n2"}  # fmt: skip


class Recorder:
    """Stands in for subprocess.run: scontrol is not installed here (the scheduler side is data)."""

    def __init__(self) -> None:
        self.calls: list[list[str]] = []

    def __call__(self, argv, **kw):
        import subprocess

        self.calls.append(list(argv))
        return subprocess.CompletedProcess(argv, 0, stdout="", stderr="")


@pytest.mark.parametrize("name", ["n1", "gpu-07.rack2", "node_3", "N9"])
def test_ordinary_node_names_pass(name):
    assert node_name_problem(name) is None


@pytest.mark.parametrize("name", ["", "n1,n2", "n1 n2", "n1\nn2", "a;b", "$(id)", "`id`", "-n1", "a/b", "x" * 254, "n'2"])
def test_names_that_would_name_other_nodes_or_run_commands_are_refused(name):
    assert node_name_problem(name)


def test_a_name_that_is_not_one_is_never_drained_nor_listed(tmp_path, capsys):
    job = slurm.detect(STEP_ENV, expand=hostlist.parse)
    sched = adapter.Scheduler(tmp_path, lambda *a, **k: None, job, drain=True, runner=Recorder())
    sched.on_excluded("n2", "faulty", 2, 2)
    sched.on_excluded("n1,n3", "faulty", 1, 2)  # only through a path that skipped the parser
    assert (tmp_path / adapter.EXCLUDE_FILE).read_text() == "n2\n"
    out = capsys.readouterr().out
    assert "not draining: 'n1,n3' is not a node name" in out
    assert "NodeName=n1,n3" not in out


def test_the_resubmit_line_splits_back_into_its_words(tmp_path):
    sched = adapter.Scheduler(tmp_path, lambda *a, **k: None, None)
    line = sched.resubmit_line(["n2", "n3"])
    assert shlex.split(line)[:2] == ["sbatch", "--exclude=n2,n3"]


def test_the_exclude_file_is_one_name_a_line(tmp_path):
    (tmp_path / adapter.EXCLUDE_FILE).write_text("n1\nn2 n3\n$(reboot)\n\n  n4  \nn1\n")
    sched = adapter.Scheduler(tmp_path, lambda *a, **k: None, None)
    assert sched.excluded_nodes() == ["n1", "n4"]  # never "n2", "n3" split out of a damaged line


@pytest.mark.slow
def test_two_agents_under_one_node_name_stop_the_job_with_a_clear_message(jobs, tmp_path):
    port = free_port()
    common = ["--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
              "--rdzv-id", "twins", "--max-restarts", "0", "--precheck", "off", "--quiet", "--node-name", "twin"]  # fmt: skip
    script = [EXAMPLE, "--steps", "30", "--step-time-ms", "20"]
    a = jobs("run", *common, "--run-dir", tmp_path / "a", *script, name="a")
    b = jobs("run", *common, "--run-dir", tmp_path / "b", *script, name="b")
    codes = (a.wait(), b.wait())
    assert 0 not in codes, (a.output(), b.output())
    for j in (a, b):  # both say why: the second to claim the name, and the other, stopped by it
        out = j.output()
        assert "two agents of this job are named 'twin'" in out and "give each node its own --node-name" in out, out
        assert "DistStoreError" not in out and "Traceback" not in out, out
