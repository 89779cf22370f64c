"""Checks and policy through `trainguard run` agents: a node failing the node check is excluded and
the job goes on with 3 of 4 nodes; a user-code error on healthy nodes fails the job at once."""

from __future__ import annotations

import socket
import subprocess
import textwrap

import pytest
from tgtest import EXAMPLE, events, free_port, tmpfs, trainguard_cmd, wait_for

from trainguard.checks.bench import CHAOS_ENV
from trainguard.rundir import chaos_hold


def _listening(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


def _four_agents(jobs, run, failing_env=None):
    """Four `trainguard run --node-check` agents of one job; node2 gets ``failing_env``."""
    port = free_port()
    common = [
        "--nnodes", "3:4", "--nproc-per-node", "1", "--rdzv-backend", "c10d",
        "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "nodecheck", "--rdzv-conf", "last_call_timeout=1",
        "--max-restarts", "1", "--run-dir", run, "--node-check",
    ]  # fmt: skip

    def agent(i: int):
        env = failing_env if i == 2 else None
        return jobs(
            "run", *common, "--node-name", f"node{i}", EXAMPLE, "--steps", "8", env=env, name=f"node{i}"
        )

    # node0 first, so that it (not the node that leaves) hosts the rendezvous store.
    agents = [agent(0)]
    wait_for(lambda: _listening(port), 120, "the rendezvous store")
    return agents + [agent(i) for i in (1, 2, 3)]


def _node2_excluded_and_the_job_goes_on(agents, run):
    codes = [a.wait() for a in agents]
    outs = [a.output() for a in agents]
    assert codes[2] == 200 and "The node is down." in outs[2], outs[2]
    assert [codes[i] for i in (0, 1, 3)] == [0, 0, 0], outs
    assert {e.node for e in events(run, "node_excluded")} == {"node2"}
    assert {e.node for e in events(run, "job_succeeded")} == {"node0", "node1", "node3"}


@pytest.mark.slow
def test_four_agents_one_fails_the_node_check_and_the_job_continues_on_three(jobs, tmp_path):
    run = tmp_path / "run"
    agents = _four_agents(jobs, run, {CHAOS_ENV: "fail"})  # fault injection: node2's check process dies
    _node2_excluded_and_the_job_goes_on(agents, run)

    first = [e for e in events(run, "nodecheck_result") if e.evidence["verdict"]["nodes"] == [0, 1, 2, 3]]
    assert len(first) == 4  # every agent reached the verdict ...
    for e in first:  # ... and the same one, naming node2
        faulty = e.evidence["verdict"]["faulty"]
        assert len(faulty) == 1
        (rank,) = faulty
        assert e.evidence["verdict"]["names"][rank] == "node2"
    excluded = events(run, "node_excluded")
    assert excluded and {e.node for e in excluded} == {"node2"}
    decisions = events(run, "policy_decision")
    assert {e.node for e in decisions if e.evidence["action"] == "exclude_node"} == {"node2"}
    assert {e.node for e in decisions if e.evidence["action"] == "rerendezvous"} == {
        "node0",
        "node1",
        "node3",
    }
    started = events(run, "job_started")
    assert {e.node for e in started} == {"node0", "node1", "node3"}
    assert all(e.evidence["group_world_size"] == 3 for e in started)
    assert {e.node for e in events(run, "job_succeeded")} == {"node0", "node1", "node3"}


@pytest.mark.slow
def test_zerodivision_on_healthy_nodes_fails_the_job_without_restart(jobs, tmp_path):
    run = tmp_path / "run"
    job = jobs(
        "run", "--standalone", "--nproc-per-node", "2", "--max-restarts", "3", "--run-dir", run,
        EXAMPLE, "--steps", "20", "--fail-mode", "zerodiv", "--fail-rank", "1", "--fail-step", "5",
    )  # fmt: skip
    assert job.wait() != 0
    out = job.output()
    assert "item disk-size root ... ok" in out and "item gpu-check ... skipped" in out  # seed `item` lines
    assert [e.kind for e in events(run, "precheck_passed")] == ["precheck_passed"]
    hw = events(run, "hardware_check")
    assert hw and hw[0].evidence["healthy"] is True
    (decision,) = events(run, "policy_decision")
    assert decision.evidence["action"] == "stop_job"
    assert decision.evidence["scenario"] == 4
    assert decision.evidence["cause"]["kind"] == "user_code"
    assert decision.rank == 1
    assert not events(run, "restart")
    failed = events(run, "job_failed")
    assert len(failed) == 1 and "user code failed on healthy hardware" in failed[0].message


@pytest.mark.slow
def test_a_gpu_job_on_a_node_without_gpus_is_refused_by_the_precheck(jobs, tmp_path):
    """--nproc-per-node gpu under the default --check-gpu auto: the node is refused with the seed's
    line and exit 200 (not torch's usage error, not a skipped gpu-check)."""
    run = tmp_path / "run"
    job = jobs("run", "--standalone", "--nproc-per-node", "gpu", "--run-dir", run, EXAMPLE, "--steps", "2")
    assert job.wait() == 200, job.output()
    out = job.output()
    assert "item gpu-check ... failed (GPUs were requested (--nproc-per-node gpu) but NVML sees none: " in out
    assert "The node is down." in out and "Cuda is not available" not in out
    (excluded,) = events(run, "node_excluded")
    assert excluded.evidence["source"] == "precheck" and excluded.evidence["scenario"] == 1
    assert not events(run, "job_started")


# Attempt 0 fills the disk the pre-check watches, then dies (as a job writing checkpoints or a
# dataset cache would fill it); a later attempt would succeed.
FILL_THEN_DIE = textwrap.dedent("""
    import os, signal, sys
    if os.environ["TORCHELASTIC_RESTART_COUNT"] == "0":
        with open(os.path.join(sys.argv[1], "fill"), "wb") as f:
            f.write(bytes(1_500_000))
        os.kill(os.getpid(), signal.SIGKILL)
    print("attempt", os.environ["TORCHELASTIC_RESTART_COUNT"], "trains", flush=True)
""")


@pytest.fixture
def small_disk(tmp_path):
    """A real 2 MB filesystem (needs root, as in the dev container); unmounted after the test."""
    with tmpfs(tmp_path / "disk", "2M") as mnt:
        yield mnt


@pytest.mark.slow
def test_a_disk_filled_during_training_fails_the_restarts_precheck(jobs, tmp_path, small_disk):
    """The cheap pre-check items run again before the restart: the disk the first attempt filled
    fails disk-size root, and the policy excludes the node with the item line."""
    run = tmp_path / "run"
    script = tmp_path / "fill_then_die.py"
    script.write_text(FILL_THEN_DIE)
    job = jobs(
        "run", "--standalone", "--nproc-per-node", "1", "--max-restarts", "2", "--run-dir", run,
        "--check-root-dir", small_disk, "--check-disk-root-gb", "0.001", script, small_disk,
    )  # fmt: skip
    assert job.wait() == 200, job.output()
    out = job.output()
    assert "item disk-size root ... ok (2.1 MB free at" in out
    assert "item disk-size root ... failed (0.6 MB free at" in out and "The node is down." in out
    assert "trains" not in out  # no worker started after the disk filled
    passed_, failed = events(run, "precheck_passed"), events(run, "precheck_failed")
    assert len(passed_) == 1 and len(failed) == 1
    assert failed[0].message.startswith("pre-check failed before attempt 1 (rechecked: disk-size root, disk-size shm, "
                                        "disk-size cache, rdma, gpu-check): disk-size root: 0.6 MB free at")
    assert len(events(run, "job_started")) == 1 and len(events(run, "restart")) == 1
    (excluded,) = events(run, "node_excluded")
    assert excluded.evidence["source"] == "precheck" and excluded.evidence["scenario"] == 2
    assert "item disk-size root ... failed" in excluded.evidence["reason"]


@pytest.mark.slow
def test_chaos_nodecheck_kill_makes_the_node_down_and_the_job_goes_on(jobs, tmp_path):
    """Seed 004's drill: kill the node-check process of one node of four. The checks wait at the
    drill's hold file (a loaded machine may finish a check before anyone aims at it); node2's
    process is killed there, and every later one its agent starts while the fault lasts."""
    run = tmp_path / "run"
    hold = chaos_hold.nodecheck_hold_path(run)
    hold.parent.mkdir(parents=True, mode=0o700)
    run.chmod(0o700)
    hold.touch()
    agents = _four_agents(jobs, run)
    wait_for(lambda: {e.node for e in events(run, "nodecheck_started")} == {f"node{i}" for i in range(4)}, 240,
             "the four node-check processes")  # fmt: skip
    chaos = subprocess.run(trainguard_cmd("chaos", run, "nodecheck-kill", "--node", "node2", "--duration", "300"),
                           capture_output=True, text=True, timeout=120)  # fmt: skip
    hold.unlink()
    assert chaos.returncode == 0, chaos.stderr
    assert chaos.stdout.startswith("chaos nodecheck-kill injected into node node2; signal=SIGKILL; what=node-check process; pid=")
    holder = int(chaos.stdout.split("holder=")[1].split(";")[0])
    try:
        _node2_excluded_and_the_job_goes_on(agents, run)
    finally:
        wait_for(lambda: not _alive(holder), 120, "the chaos holder to end with node2's agent")
    (verdict,) = {json_key(e.evidence["verdict"]["faulty"]) for e in events(run, "nodecheck_result")
                  if e.evidence["verdict"]["nodes"] == [0, 1, 2, 3]}  # fmt: skip
    assert "exit -9" in verdict
    (injected,) = events(run, "chaos_injected")
    assert injected.node == "node2" and injected.evidence["fault"] == "nodecheck-kill"
    bad = subprocess.run(trainguard_cmd("chaos", run, "nodecheck-kill", "--node", "node9"), capture_output=True, text=True,
                         timeout=120)  # fmt: skip
    assert bad.returncode == 2 and "node 'node9' has started no node-check process" in bad.stderr


def json_key(faulty: dict) -> str:
    (why,) = faulty.values()
    return why


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1][0] != "Z"
    except OSError:
        return False
