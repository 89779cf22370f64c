"""Scheduler adapters without a scheduler: Slurm host lists and environment, the exclusion's
side effects (exclude list, resubmit line, --on-exclude hook), Kubernetes exit codes and verdict."""

from __future__ import annotations

import argparse
import json
import signal
import sys
from pathlib import Path

import pytest

from trainguard.agent.cli import make_parser
from trainguard.exitcodes import (
    EXIT_EXCLUDED,
    EXIT_FAILED,
    EXIT_NODE_FAULT,
    EXIT_USAGE,
    retryable,
    signal_exit,
)
from trainguard.options import SettingsError
from trainguard.schedulers import adapter, hostlist, kubernetes, slurm

# ------------------------------------------------------------------------------------ hostlist


@pytest.mark.parametrize(
    ("text", "hosts"),
    [
        ("n1", ["n1"]),
        ("n[1-3,7]", ["n1", "n2", "n3", "n7"]),
        ("n[1-2],gpu[08-10]", ["n1", "n2", "gpu08", "gpu09", "gpu10"]),
        ("rack[1-2]-node[01-02]", ["rack1-node01", "rack1-node02", "rack2-node01", "rack2-node02"]),
        ("a,b, c", ["a", "b", "c"]),
        ("node-[0]", ["node-0"]),
        ("x[9-11]y", ["x9y", "x10y", "x11y"]),
        ("", []),
    ],
)
def test_hostlist_parse(text, hosts):
    assert hostlist.parse(text) == hosts


@pytest.mark.parametrize("bad", ["n[1-3", "n1-3]", "n[3-1]", "n[a-b]", "n[[1]]", "n[0-99999999]"])
def test_hostlist_parse_refuses_bad_syntax(bad):
    with pytest.raises(hostlist.HostlistError):
        hostlist.parse(bad)


def test_hostlist_expand_falls_back_to_the_parser_without_scontrol():
    assert hostlist.expand("n[1-2]", scontrol=None) == ["n1", "n2"]
    assert hostlist.expand("n[1-2]", scontrol="no-such-scontrol-here") == ["n1", "n2"]


# ---------------------------------------------------------------------------------- slurm env

STEP_ENV = {
    "SLURM_JOB_ID": "4711",
    "SLURM_JOB_NODELIST": "n[1-3]",
    "SLURM_JOB_NUM_NODES": "3",
    "SLURM_STEP_ID": "0",
    "SLURM_STEP_NODELIST": "n[1-3]",
    "SLURM_STEP_NUM_NODES": "3",
    "SLURMD_NODENAME": "n2",
    "SLURM_NODEID": "1",
}


def _args(*argv: str) -> argparse.Namespace:
    return make_parser().parse_args([*argv, "train.py"])


def detect(env):
    return slurm.detect(env, expand=hostlist.parse)


def test_detect_outside_slurm_is_none():
    assert detect({"HOME": "/root"}) is None


def test_detect_reads_the_step():
    job = detect(STEP_ENV)
    assert job == slurm.SlurmJob("4711", "0", ["n1", "n2", "n3"], 3, "n2", 0)
    assert job.rdzv_id == "slurm-4711.0" and job.run_name == "slurm-4711"
    assert job.port == slurm.PORT_BASE + 4711 % slurm.PORT_SPREAD


def test_detect_array_task_and_requeue_count():
    job = detect({**STEP_ENV, "SLURM_ARRAY_JOB_ID": "90", "SLURM_ARRAY_TASK_ID": "3", "SLURM_RESTART_COUNT": "2"})
    assert job.job_id == "90_3" and job.rdzv_id == "slurm-90_3.0.r2" and job.run_name == "slurm-90_3"


def test_detect_a_step_on_part_of_the_allocation_uses_the_step_nodes():
    job = detect({**STEP_ENV, "SLURM_STEP_NODELIST": "n[2-3]", "SLURM_STEP_NUM_NODES": "2"})
    assert job.nodes == ["n2", "n3"] and job.nnodes == 2 and job.first_host == "n2"


def test_detect_in_the_batch_script_uses_the_job():
    env = {k: v for k, v in STEP_ENV.items() if not k.startswith("SLURM_STEP")}
    job = detect(env)
    assert job.step_id is None and job.nnodes == 3 and job.rdzv_id == "slurm-4711.batch"


def test_apply_fills_rendezvous_node_and_run_dir():
    args = _args("--nproc-per-node", "2")
    job = detect(STEP_ENV)
    done = slurm.apply(args, job)
    assert args.nnodes == "3"
    assert args.rdzv_backend == "c10d" and args.rdzv_endpoint == f"n1:{job.port}"
    assert args.rdzv_id == "slurm-4711.0"
    assert args.node_name == "n2" and args.job_id == "slurm-4711"
    assert args.rdzv_conf == "is_host=false"  # n2 is not the first host
    assert any(d.startswith("--nnodes 3") for d in done)


def test_apply_the_first_host_serves_the_store_and_keeps_the_users_rdzv_conf():
    args = _args("--rdzv-conf", "last_call_timeout=3")
    slurm.apply(args, detect({**STEP_ENV, "SLURMD_NODENAME": "n1"}))
    assert args.rdzv_conf == "last_call_timeout=3,is_host=true"


def test_apply_explicit_flags_win():
    args = _args("--nnodes", "2:3", "--rdzv-backend", "c10d", "--rdzv-endpoint", "head:29400", "--rdzv-id", "mine",
                 "--node-name", "me", "--run-dir", "/tmp/x")  # fmt: skip
    slurm.apply(args, detect(STEP_ENV))
    assert (args.nnodes, args.rdzv_endpoint, args.rdzv_id, args.node_name, args.job_id) == (
        "2:3", "head:29400", "mine", "me", None)  # fmt: skip
    assert args.rdzv_conf == ""


def test_apply_single_node_step_leaves_the_rendezvous_to_standalone_defaults():
    args = _args()
    slurm.apply(args, detect({**STEP_ENV, "SLURM_STEP_NODELIST": "n1", "SLURM_STEP_NUM_NODES": "1"}))
    assert args.rdzv_backend == "static" and args.rdzv_endpoint == "" and args.nnodes == "1"


def test_no_slurm_ignores_the_environment():
    args = _args("--no-slurm")
    assert adapter.autodetect(args, env=STEP_ENV) is None
    assert args.nnodes == "1:1" and args.node_name is None and args.rdzv_id == "none"


def test_drain_argv_is_a_list_with_the_reason_as_one_argument():
    argv = slurm.drain_argv("n2", "node 1 (n2) failed its checks:\n gemm  slow; rm -rf /")
    assert argv == ["update", "NodeName=n2", "State=DRAIN", "Reason=trainguard: node 1 (n2) failed its checks: gemm slow; rm -rf /"]
    long = slurm.drain_argv("n2", "x" * 1000)[-1]
    assert len(long) == len("Reason=") + slurm.REASON_MAX and long.endswith("...")


# ------------------------------------------------------------------------ exclusion side effects


def test_on_excluded_keeps_an_exclude_list_and_prints_the_resubmit_line(tmp_path, capsys):
    events = []
    sched = adapter.Scheduler(tmp_path, lambda *a, **k: events.append((a, k)), detect(STEP_ENV))
    sched.on_excluded("n2", "node 1 (n2) failed its checks", 2, 2)
    sched.on_excluded("n3", "straggler", 1, 2)
    sched.on_excluded("n2", "again", 1, 2)
    assert (tmp_path / adapter.EXCLUDE_FILE).read_text() == "n2\nn3\n"
    out = capsys.readouterr().out.splitlines()
    assert "sbatch --exclude=n2 " in out[0] and "sbatch --exclude=n2,n3 " in out[1]
    assert sched._requeue is None  # --requeue not given


def test_requeue_is_planned_only_below_the_minimum(tmp_path):
    sched = adapter.Scheduler(tmp_path, lambda *a, **k: None, detect(STEP_ENV), requeue_on_shortfall=True)
    sched.on_excluded("n3", "faulty", 2, 2)
    assert sched._requeue is None
    sched.on_excluded("n2", "faulty", 1, 2)
    assert sched._requeue == ["n3", "n2"]


def test_on_exclude_hook_gets_node_and_reason_in_its_environment_not_a_shell(tmp_path):
    out = tmp_path / "hook.json"
    code = f"import json,os,sys; json.dump([sys.argv[1:], os.environ['{adapter.ENV_NODE}'], os.environ['{adapter.ENV_REASON}']], open({str(out)!r}, 'w'))"
    args = _args("--on-exclude", f"{sys.executable} -c \"{code}\" fixed-arg")
    events = []
    sched = adapter.Scheduler.from_settings(adapter.SchedulerSettings.from_options(args), tmp_path, lambda *a, **k: events.append(a))
    reason = "rank 1 hardware fault; $(touch pwned) `id`"
    sched.on_excluded("n'2", reason, None, None)
    assert json.loads(out.read_text()) == [["fixed-arg"], "n'2", reason]
    assert events[-1][0] == "exclude_hook" and "ok" in events[-1][1]
    assert not (Path.cwd() / "pwned").exists()


def test_on_exclude_failing_hook_is_recorded_not_raised(tmp_path):
    events = []
    sched = adapter.Scheduler(tmp_path, lambda *a, **k: events.append((a, k)), None, on_exclude=["/no/such/hook"])
    sched.on_excluded("n1", "faulty", None, None)
    (kind, message), kw = events[-1]
    assert kind == "exclude_hook" and "failed" in message and kw["severity"] == "warning"


def test_on_exclude_refuses_an_empty_command():
    with pytest.raises(SystemExit) as exc:
        _args("--on-exclude", "")
    assert exc.value.code == EXIT_USAGE


def test_preemption_records_job_preempted_and_requeues_only_from_the_first_host_on_usr1(tmp_path):
    events = []
    first = adapter.Scheduler(tmp_path, lambda *a, **k: events.append((a, k)), detect({**STEP_ENV, "SLURMD_NODENAME": "n1"}),
                              requeue_on_shortfall=True)  # fmt: skip
    first.on_preempted(signal.SIGTERM, "n1")
    assert events[-1][0][0] == "job_preempted" and first._requeue is None  # SIGTERM: Slurm requeues itself
    first.on_preempted(signal.SIGUSR1, "n1")
    assert first._requeue == [] and events[-1][1]["evidence"]["requeue"] is True
    other = adapter.Scheduler(tmp_path, lambda *a, **k: None, detect(STEP_ENV), requeue_on_shortfall=True)
    other.on_preempted(signal.SIGUSR1, "n2")
    assert other._requeue is None


# ---------------------------------------------------------------------------------- kubernetes


def test_exit_codes_follow_the_pytorchjob_convention():
    assert not retryable(EXIT_FAILED) and not retryable(EXIT_USAGE)
    assert retryable(EXIT_EXCLUDED) and retryable(EXIT_NODE_FAULT)
    assert signal_exit(signal.SIGTERM) == 143 and retryable(143) and retryable(signal_exit(signal.SIGUSR1))
    # trainguard's own codes never read as a signal death (128 + n, n up to SIGRTMAX)
    assert min(EXIT_EXCLUDED, EXIT_NODE_FAULT) > signal_exit(signal.SIGRTMAX) and max(EXIT_EXCLUDED, EXIT_NODE_FAULT) <= 255
    assert not retryable(0)


def test_verdict_is_one_bounded_line():
    line = kubernetes.verdict(EXIT_EXCLUDED, "The node is down.\nnode 1 (n2) failed its checks")
    assert line == "trainguard: exit 200 (retryable): The node is down. node 1 (n2) failed its checks"
    assert kubernetes.verdict(1, "user code failed").startswith("trainguard: exit 1 (permanent): ")
    assert len(kubernetes.verdict(1, "é" * 5000).encode()) <= kubernetes.MESSAGE_MAX


def test_termination_log_written_where_it_exists(tmp_path):
    path = tmp_path / "termination-log"
    assert kubernetes.termination_log_path({kubernetes.ENV_TERMINATION_LOG: str(path)}) == path
    assert kubernetes.write_verdict(143, "stopped by SIGTERM", path) == "trainguard: exit 143 (retryable): stopped by SIGTERM"
    assert path.read_text() == "trainguard: exit 143 (retryable): stopped by SIGTERM\n"
    assert kubernetes.write_verdict(1, "x", None) is None
    assert kubernetes.write_verdict(1, "x", tmp_path / "no" / "dir") is None  # never raises


@pytest.mark.slow
def test_trainguard_run_writes_its_verdict_and_a_permanent_code_for_a_user_error(jobs, tmp_path):
    from tgtest import EXAMPLE

    term = tmp_path / "termination-log"
    job = jobs("run", "--standalone", "--nproc-per-node", "1", "--quiet", "--precheck", "off", "--run-dir", tmp_path / "run",
               EXAMPLE, "--steps", "3", "--fail-rank", "0", "--fail-step", "2", "--fail-mode", "zerodiv",
               env={kubernetes.ENV_TERMINATION_LOG: str(term)})  # fmt: skip
    assert job.wait() == EXIT_FAILED, job.output()
    line = term.read_text()
    assert line.startswith("trainguard: exit 1 (permanent): user code failed") and line.count("\n") == 1, line


def test_job_state_reads_scontrol(monkeypatch):
    """The agent asks Slurm whether its job is ending when its workers died of a stop signal it
    never got itself: JobState from `scontrol show job -o`, None when Slurm cannot say."""
    import subprocess

    monkeypatch.setattr(slurm.shutil, "which", lambda name: "/usr/bin/scontrol")
    line = "JobId=7 JobName=train UserId=root(0) Priority=1 JobState=COMPLETING Reason=None Restarts=0"
    calls = []

    def run(argv, **kw):
        calls.append(argv)
        return subprocess.CompletedProcess(argv, 0, line, "")

    assert slurm.job_state("7", run) == "COMPLETING" and calls[0][1:] == ["show", "job", "-o", "7"]
    gone = lambda argv, **kw: subprocess.CompletedProcess(argv, 1, "", "slurm_load_jobs error: Invalid job id")  # noqa: E731
    assert slurm.job_state("7", gone) is None
    # the batch script for the resubmit line comes from the same answer; an srun job has none
    line += " Command=/home/u/train.sbatch WorkDir=/home/u"
    assert slurm.batch_script("7", run) == "/home/u/train.sbatch"
    line = line.replace("Command=/home/u/train.sbatch", "Command=(null)")
    assert slurm.batch_script("7", run) is None and slurm.batch_script("7", gone) is None
    monkeypatch.setattr(slurm.shutil, "which", lambda name: None)
    assert slurm.job_state("7", run) is None


def test_standby_nodes_make_the_last_nodes_of_the_step_standbys():
    """--standby-nodes 1 on a step of three: n1 and n2 train (--nnodes 2), n3 waits as a standby
    (agent/standby.py); the first host, which serves the rendezvous store, always trains."""
    env = {**STEP_ENV, "SLURMD_NODENAME": "n3"}
    args = _args("--standby-nodes", "1")
    done = slurm.apply(args, detect(env))
    assert (args.nnodes, args.standby, args.standby_nodes) == ("2", True, 0) and "--standby" in done
    args = _args("--standby-nodes", "1")
    slurm.apply(args, detect(STEP_ENV))  # n2
    assert (args.nnodes, args.standby) == ("2", False) and args.rdzv_conf == "is_host=false"
    args = _args("--standby-nodes", "1", "--nnodes", "1:2")  # the user's --nnodes wins
    slurm.apply(args, detect(env))
    assert (args.nnodes, args.standby) == ("1:2", True)
    for bad, needle in ((_args("--standby-nodes", "3"), "none would be left to train"),
                        (_args("--standby-nodes", "1"), "not in the step's node list")):  # fmt: skip
        with pytest.raises(SettingsError, match=needle):
            slurm.apply(bad, detect({**env, "SLURMD_NODENAME": "x9"} if "node list" in needle else env))
