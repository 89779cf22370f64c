"""`trainguard run` as DLRover's and ModelArts' users write and read it: dlrover-run's own command
line (--network-check, no rendezvous flag) runs as two agents; the rendezvous comes from what the
environment says (MASTER_ADDR/MASTER_PORT, a host file, Volcano's host files, PET_*, one node);
--exclude-straggler also drops a node-check straggler; the restart budget comes from the pod's
``fault-tolerance/job-retry-num`` annotation; the console carries "Command running..." and
"error,exiting"; a node whose peers never come exits 201 after --rdzv-wait-minutes."""

from __future__ import annotations

import os

import pytest
from tgtest import EXAMPLE, events, free_port

from trainguard import policy as P
from trainguard.agent.cli import make_parser
from trainguard.agent.settings import RunSettings
from trainguard.checks.bench import CHAOS_ENV
from trainguard.evidence import CheckOutcome
from trainguard.exitcodes import EXIT_EXCLUDED, EXIT_NODE_FAULT, EXIT_USAGE
from trainguard.policy import Action
from trainguard.schedulers import environment

RENDEZVOUS_ENV = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "PET_RDZV_ENDPOINT", "PET_RDZV_BACKEND",
                  "PET_MASTER_ADDR", "PET_MASTER_PORT", "PET_STANDALONE", "PET_NNODES", "PET_MAX_RESTARTS",
                  "SLURM_JOB_ID", "SLURM_JOBID", "TRAINGUARD_POD_ANNOTATIONS")


@pytest.fixture
def clean_env(tmp_path, monkeypatch):
    """No rendezvous or budget variable of the machine running the tests leaks in."""
    monkeypatch.chdir(tmp_path)
    for name in RENDEZVOUS_ENV:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("TRAINGUARD_POD_ANNOTATIONS", str(tmp_path / "no-annotations"))
    return {k: v for k, v in os.environ.items() if k not in RENDEZVOUS_ENV} | {
        "TRAINGUARD_POD_ANNOTATIONS": str(tmp_path / "no-annotations")}


def settings(argv: list[str], env: dict[str, str]) -> RunSettings:
    return RunSettings.from_args(make_parser().parse_args([*argv, str(EXAMPLE)]), env)


def agent_env(**extra: str) -> dict[str, str]:
    """An agent's environment with only the variables the test means (a job started from a shell
    under Slurm or PyTorchJob would otherwise pick up that scheduler's)."""
    env = {name: "" for name in RENDEZVOUS_ENV if not name.startswith("PET_")}  # torchrun reads PET_* "" as given
    env.update(extra)
    return env


# ---------------------------------------------------------------- DLRover's spellings


@pytest.mark.slow
def test_the_dlrover_command_line_runs_as_two_agents_from_master_addr(jobs, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the agents' default run dir is made in their working directory
    port = free_port()
    env = agent_env(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                    TRAINGUARD_POD_ANNOTATIONS=str(tmp_path / "none"))
    # dlrover-run's example, verbatim but for the launcher's name and the training script
    argv = ["--network-check", "--nnodes=2:3", "--nproc_per_node=2", "--max_restarts=3", EXAMPLE, "--steps", "6"]
    agents = [jobs("run", *argv, env=env, name=f"agent{i}") for i in range(2)]
    codes = [a.wait(timeout=420) for a in agents]
    outs = [a.output() for a in agents]
    assert codes == [0, 0], outs
    for out in outs:
        assert f"rendezvous from MASTER_ADDR/MASTER_PORT: c10d at 127.0.0.1:{port}" in out, out
        assert f"Command running...: {EXAMPLE} --steps 6" in out, out
    run_dir = tmp_path / "trainguard-runs" / f"master-127.0.0.1-{port}"  # one run dir: the job id is the endpoint's
    checked = [e for e in events(run_dir, "nodecheck_result") if len(e.evidence["verdict"]["nodes"]) == 2]
    assert len({e.node for e in checked}) == 2, [e.message for e in events(run_dir)]  # --network-check ran
    started = events(run_dir, "job_started")
    assert started and all(e.evidence["group_world_size"] == 2 for e in started)
    assert len({e.node for e in events(run_dir, "job_succeeded")}) == 2


@pytest.mark.slow
def test_exclude_straggler_drops_the_slow_node_the_network_check_finds(jobs, tmp_path):
    port = free_port()
    run_dir = tmp_path / "run"
    argv = ["--network-check", "--exclude-straggler", "--nnodes=2:3", "--nproc_per_node=1", "--run-dir", run_dir]
    agents = []
    for i in range(3):  # node2's benchmark runs 10x slower (fault injection)
        env = agent_env(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), **({CHAOS_ENV: "slow:10"} if i == 2 else {}))
        agents.append(jobs("run", *argv, "--node-name", f"n{i}", EXAMPLE, "--steps", "6", env=env, name=f"n{i}"))
    codes = [a.wait(timeout=420) for a in agents]
    outs = [a.output() for a in agents]
    assert codes == [0, 0, EXIT_EXCLUDED], outs
    assert "The node is a straggler and exits." in outs[2]
    assert {e.node for e in events(run_dir, "node_excluded")} == {"n2"}
    assert {e.node for e in events(run_dir, "job_succeeded")} == {"n0", "n1"}


def test_network_check_is_the_node_check(clean_env):
    s = settings(["--network-check"], clean_env)
    assert s.monitors["checks"].node_check is True
    assert settings([], clean_env).monitors["checks"].node_check is False


@pytest.mark.parametrize("flag", ["--exclude-straggler", "--node-check-exclude-straggler"])
def test_exclude_straggler_also_drops_a_straggler_the_node_check_finds(clean_env, flag):
    policy = settings(["--network-check", "--nnodes", "2:4", flag], clean_env).policy
    slow_node = CheckOutcome("node_check", {}, {3: "2.5x slower than its partner"})
    d = P.decide_before_start(slow_node, 3, 4, policy.min_nodes(4),
                              exclude_stragglers=policy.node_check_exclude_straggler)
    assert d is not None and d.action == Action.EXCLUDE_NODE
    kept = settings(["--network-check", "--nnodes", "2:4"], clean_env).policy
    assert not kept.node_check_exclude_straggler  # without either flag the straggler is only reported


# ---------------------------------------------------------------- the rendezvous from the environment


def test_master_addr_and_port_configure_a_c10d_rendezvous(clean_env):
    env = {**clean_env, "MASTER_ADDR": "10.0.0.7", "MASTER_PORT": "23456", "WORLD_SIZE": "4", "RANK": "1"}
    s = settings([], env)
    args = s.torchrun.args
    assert (args.rdzv_backend, args.rdzv_endpoint, args.rdzv_id, args.nnodes) == (
        "c10d", "10.0.0.7:23456", "master-10.0.0.7-23456", "4")
    assert "is_host=false" in args.rdzv_conf  # RANK 0's pod (MASTER_ADDR) serves the store
    assert any("from MASTER_ADDR/MASTER_PORT" in line for line in s.scheduler.sources)


def test_a_hostfile_configures_a_c10d_rendezvous_on_its_first_host(clean_env, tmp_path):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("# the job's hosts\nnode-a slots=8\nnode-b slots=8\n\nnode-c\n")
    s = settings(["--hostfile", str(hostfile)], clean_env)
    args = s.torchrun.args
    assert (args.rdzv_backend, args.rdzv_endpoint, args.nnodes) == ("c10d", "node-a:29400", "3")
    assert any(f"from --hostfile {hostfile}" in line for line in s.scheduler.sources)


def test_volcano_host_files_configure_the_rendezvous_on_the_master(clean_env, tmp_path):
    (tmp_path / "master.host").write_text("job-master-0\n")
    (tmp_path / "worker.host").write_text("job-worker-0\njob-worker-1\n")
    args = make_parser().parse_args([str(EXAMPLE)])
    files = sorted(tmp_path.glob("*.host"))
    said = environment.apply(args, clean_env, volcano=lambda: files)
    assert (args.rdzv_backend, args.rdzv_endpoint, args.nnodes) == ("c10d", "job-master-0:29400", "3")
    assert "Volcano" in said


def test_one_node_gets_a_standalone_rendezvous_and_says_so(clean_env):
    for argv in ([], ["--nnodes", "1"]):
        s = settings(argv, {**clean_env, "MASTER_ADDR": "10.0.0.7", "MASTER_PORT": "23456"})
        assert s.torchrun.single and s.torchrun.args.rdzv_endpoint == "localhost:0"
        assert s.scheduler.sources[0] == "rendezvous: one node, standalone on 127.0.0.1"


def test_given_rendezvous_flags_and_pet_variables_win(clean_env, monkeypatch):
    env = {**clean_env, "MASTER_ADDR": "10.0.0.7", "MASTER_PORT": "23456", "WORLD_SIZE": "4"}
    s = settings(["--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", "h:1"], env)
    assert s.torchrun.args.rdzv_endpoint == "h:1" and s.scheduler.sources == ()
    monkeypatch.setenv("PET_RDZV_ENDPOINT", "pet-host:29400")  # torchrun's parser reads PET_* itself
    monkeypatch.setenv("PET_RDZV_BACKEND", "c10d")
    monkeypatch.setenv("PET_NNODES", "2")
    s = settings([], {**env, "PET_RDZV_ENDPOINT": "pet-host:29400"})
    assert s.torchrun.args.rdzv_endpoint == "pet-host:29400"
    assert s.scheduler.sources == ("rendezvous from torchrun's PET_* variables (PyTorchJob)",)


def test_a_bad_master_port_or_empty_hostfile_is_one_line_and_exit_2(jobs, tmp_path):
    (tmp_path / "empty").write_text("\n# nobody\n")
    bad = [
        (["--hostfile", str(tmp_path / "empty")], {}, "lists no host"),
        ([], {"MASTER_ADDR": "h", "MASTER_PORT": "x", "WORLD_SIZE": "2"}, "MASTER_PORT='x'"),
    ]
    for argv, env, needle in bad:
        job = jobs("run", *argv, EXAMPLE, env=agent_env(**env))
        assert job.wait() == EXIT_USAGE
        out = job.output()
        assert needle in out and len(out.strip().splitlines()) == 1, out


# ---------------------------------------------------------------- ModelArts' restart budget annotation


def test_the_retry_num_annotation_is_the_restart_budget(jobs, tmp_path):
    annotations = tmp_path / "annotations"
    annotations.write_text('app="train"\nfault-tolerance/job-retry-num="2"\nnote="a=b"\n')
    script = tmp_path / "fails_once.py"
    script.write_text("import os, sys\nsys.exit(3 if os.environ['TORCHELASTIC_RESTART_COUNT'] == '0' else 0)\n")
    run_dir = tmp_path / "run"
    job = jobs("run", "--restart-on-error", "--run-dir", run_dir, script, "x", "--y=1",
               env=agent_env(TRAINGUARD_POD_ANNOTATIONS=str(annotations)))
    assert job.wait() == 0, job.output()
    out = job.output()
    assert f"restart budget 2 from the pod annotation fault-tolerance/job-retry-num=2 in {annotations}" in out
    assert f"Command running...: {script} x --y=1" in out  # what ModelArts' log opens with
    restarts = events(run_dir, "restart")
    assert len(restarts) == 1 and "restart 1/2" in restarts[0].message


def test_without_the_annotation_the_budget_is_zero_and_a_flag_wins(clean_env, tmp_path):
    assert settings([], clean_env).torchrun.args.max_restarts == 0
    annotations = tmp_path / "annotations"
    annotations.write_text('fault-tolerance/job-retry-num="3"\n')
    env = {**clean_env, "TRAINGUARD_POD_ANNOTATIONS": str(annotations)}
    assert settings([], env).torchrun.args.max_restarts == 3
    assert settings(["--max-restarts", "0"], env).torchrun.args.max_restarts == 0


@pytest.mark.parametrize("value", ['"0"', '"4"', '"two"', '"1.5"', '""'])
def test_a_retry_num_outside_1_to_3_is_one_line_and_exit_2(jobs, tmp_path, value):
    annotations = tmp_path / "annotations"
    annotations.write_text(f"fault-tolerance/job-retry-num={value}\n")
    job = jobs("run", EXAMPLE, env=agent_env(TRAINGUARD_POD_ANNOTATIONS=str(annotations)))
    assert job.wait() == EXIT_USAGE
    out = job.output().strip()
    assert len(out.splitlines()) == 1 and "fault-tolerance/job-retry-num" in out and "1-3" in out, out


# ---------------------------------------------------------------- the end of a job, for the log searches


def test_the_final_failure_line_says_error_exiting(jobs, tmp_path):
    script = tmp_path / "fails.py"
    script.write_text("import sys\nsys.exit(3)\n")
    job = jobs("run", "--max-restarts", "0", "--run-dir", tmp_path / "run", script, env=agent_env())
    assert job.wait() == 1
    failed = [ln for ln in job.output().splitlines() if "[job_failed]" in ln]
    assert len(failed) == 1 and failed[0].endswith("error,exiting"), job.output()


def test_a_node_whose_peers_never_come_exits_201_after_the_wait(jobs, tmp_path):
    port = free_port()
    job = jobs("run", "--nnodes", "2", "--rdzv-wait-minutes", "0.1", "--run-dir", tmp_path / "run",
               EXAMPLE, env=agent_env(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)))
    assert job.wait() == EXIT_NODE_FAULT, job.output()
    out = job.output()
    assert "did not get 2 node(s) in 6 s (--rdzv-wait-minutes)" in out, out
    assert "error,exiting" in out


def test_the_rendezvous_wait_is_30_minutes_unless_rdzv_conf_says(clean_env):
    multi = ["--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", "h:1"]
    assert "join_timeout=1800" in settings(multi, clean_env).torchrun.args.rdzv_conf
    assert "join_timeout=300" in settings([*multi, "--rdzv-wait-minutes", "5"], clean_env).torchrun.args.rdzv_conf
    conf = settings([*multi, "--rdzv-conf", "join_timeout=42"], clean_env).torchrun.args.rdzv_conf
    assert conf == "join_timeout=42"
