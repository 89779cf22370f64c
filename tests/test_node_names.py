"""Node names are data that ends up in Slurm lists, shell lines and files:
refused at the parser unless letters, digits, '.', '_', '-' (tests/test_run_usage.py); the
exclude-nodes file is one name a line; a name that is not one is never drained or listed; two
agents under one name in one job stop it with a clear message."""

from __future__ import annotations

import shlex
import socket

import pytest
from tgtest import EXAMPLE, SCRIPTS, events, free_port

from trainguard.agent import node_names
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


def _two_agents(jobs, tmp_path, port: int, *extra: str, fail_until: int = 0):
    """Two launchers of one 2-node job on this host, each with its own run dir (torch's
    test_launch_elastic_multiple_agents, plus --run-dir each); their workers fail while
    TORCHELASTIC_RESTART_COUNT is below ``fail_until``."""
    # --max-restarts: one spare, for a node whose healthy workers a new round restarted (count unchanged)
    common = ["--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
              "--rdzv-id", f"pair-{port}", "--max-restarts", str(fail_until + 1), "--restart-on-error", "--precheck", "off",
              "--quiet", *extra]  # fmt: skip
    script = [SCRIPTS / "restart_count_worker.py", "--gloo", "--fail-until", str(fail_until)]
    return [jobs("run", *common, "--run-dir", tmp_path / name, *script, name=name) for name in ("a", "b")]


@pytest.mark.slow
def test_two_agents_on_one_host_with_their_own_run_dirs_get_distinct_default_names(jobs, tmp_path):
    """Without --node-name both agents would be the host: the second in rendezvous order becomes
    <host>-2, the job runs as under torchrun (a failed first attempt restarted), and the events of
    the two run dirs name two nodes, each the same in both attempts."""
    a, b = _two_agents(jobs, tmp_path, free_port(), fail_until=1)
    assert (a.wait(), b.wait()) == (0, 0), (a.output(), b.output())
    started = [[e.node for e in events(tmp_path / d, "job_started")] for d in ("a", "b")]
    assert all(len(s) >= 2 for s in started), started  # the first attempt and its restart(s)
    names = [set(s) for s in started]
    assert all(len(n) == 1 for n in names) and names[0] != names[1], names
    host = socket.gethostname()
    assert names[0] | names[1] == {host, f"{host}-2"}, names


@pytest.mark.slow
def test_two_agents_given_one_node_name_both_exit_with_a_clear_line(jobs, tmp_path):
    """--node-name given twice is refused as bad input: both launchers exit 2 (neither left
    waiting, nor its workers started), each saying which name collides."""
    a, b = _two_agents(jobs, tmp_path, free_port(), "--node-name", "same")
    codes = (a.wait(), b.wait())  # tgtest's deadline: a launcher left running fails here
    assert codes == (2, 2), (a.output(), b.output())
    assert not events(tmp_path / "a", "job_started") and not events(tmp_path / "b", "job_started")
    for j in (a, b):
        out = j.output()
        assert "two agents of this job are named 'same'" in out and "give each node its own --node-name" in out, out


def _claim(rank, name, *, given=False, decided=False, host="vm"):
    return node_names.Claim(rank, name, host, given, decided, f"host {host}, agent {rank}")


def test_default_names_on_one_host_follow_the_rendezvous_order():
    names, collisions = node_names.assign([_claim(2, "vm"), _claim(0, "vm"), _claim(1, "vm")])
    assert names == {0: "vm", 1: "vm-2", 2: "vm-3"} and not collisions


def test_a_default_name_yields_to_a_given_one_and_kept_names_stay():
    # rank 0 kept "vm-2" from an earlier round; rank 1 was given "vm"; rank 2 is new
    names, collisions = node_names.assign([_claim(0, "vm-2", decided=True), _claim(1, "vm", given=True), _claim(2, "vm")])
    assert names == {0: "vm-2", 1: "vm", 2: "vm-3"} and not collisions


def test_a_default_name_from_a_shared_run_dirs_lock_is_kept_when_free():
    names, collisions = node_names.assign([_claim(0, "vm-2"), _claim(1, "vm")])
    assert names == {0: "vm-2", 1: "vm"} and not collisions


def test_only_a_fixed_name_on_two_agents_is_refused():
    _, collisions = node_names.assign([_claim(0, "twin", given=True), _claim(1, "twin", given=True), _claim(2, "twin")])
    (c,) = collisions
    assert c.name == "twin" and [x.rank for x in c.claims] == [0, 1]
    assert c.message().startswith("two agents of this job are named 'twin' (host vm, agent 0; host vm, agent 1)")
