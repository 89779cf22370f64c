"""trainguard under a real Slurm 22.05: slurmctld and three slurmd ("nodes" n1-n3 on loopback,
tests/scripts/slurm/start.sh, from the project's notes/slurm recipe), munge, sbatch.

- a 2-node job with no rendezvous flag: autodetect from the allocation;
- a node failing its pre-check is drained with a reason (``sinfo -R``), and the job finishes on the
  spare of a 3-node allocation;
- Slurm requeues a running job (what preemption with PreemptMode=REQUEUE does): SIGTERM -> the
  newest in-memory snapshot is persisted, ``job_preempted`` recorded, and the requeued job resumes
  from it with at most one step lost;
- ``--requeue``: a 2-node job that loses a node below its minimum asks Slurm to requeue it without
  that node, and the requeued job finishes on the other two.

In CI (CI=1) a missing Slurm is a failure, never a skip: .ci/run installs it.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from tgtest import DEADLINE, EXAMPLE, REPO, events, free_port, wait_for

from trainguard.exitcodes import EXIT_EXCLUDED
from trainguard.schedulers import hostlist

pytestmark = pytest.mark.slow

SCRIPTS = REPO / "tests" / "scripts" / "slurm"
NODES = ["n1", "n2", "n3"]
PY = sys.executable


def _slurm_missing() -> str | None:
    missing = [t for t in ("slurmctld", "slurmd", "sbatch", "scontrol", "munged") if not shutil.which(t) and not Path(f"/usr/sbin/{t}").exists()]
    if missing:
        return f"Slurm not installed (missing {', '.join(missing)}; apt-get install slurmctld slurmd slurm-client munge)"
    if os.geteuid() != 0:
        return "the test cluster runs its daemons as root"
    return None


class Cluster:
    def __init__(self, base: Path) -> None:
        self.base = base
        self.env = {**os.environ, "BASE": str(base), "SLURM_CONF": str(base / "slurm.conf")}

    def run(self, *argv: str, check: bool = True, timeout: float = 60) -> subprocess.CompletedProcess:
        res = subprocess.run(list(argv), env=self.env, capture_output=True, text=True, timeout=timeout)
        if check and res.returncode != 0:
            raise AssertionError(f"{argv}: exit {res.returncode}: {res.stderr or res.stdout}")
        return res

    def sbatch(self, script: str, workdir: Path, *options: str) -> str:
        path = workdir / "job.sbatch"
        path.write_text(script)
        return self.run("sbatch", "--parsable", f"--chdir={workdir}", *options, str(path)).stdout.strip().split(";")[0]

    def state(self, job: str) -> str:
        return self.run("squeue", "-h", "-j", job, "-o", "%T", check=False).stdout.strip()

    def job_field(self, job: str, name: str) -> str:
        out = self.run("scontrol", "show", "job", "-o", job).stdout
        m = re.search(rf"\b{name}=(\S*)", out)
        return m.group(1) if m else ""

    def wait_done(self, job: str, timeout: float = DEADLINE) -> str:
        """Wait until the job left the queue; its final state (COMPLETED, FAILED...)."""
        wait_for(lambda: self.state(job) == "", timeout, f"slurm job {job} to end")
        return self.job_field(job, "JobState")

    def node_state(self, node: str) -> str:
        return self.run("sinfo", "-h", "-N", "-n", node, "-o", "%T").stdout.strip()

    def resume_all(self) -> None:
        for node in NODES:
            if self.node_state(node) != "idle":
                self.run("scontrol", "update", f"NodeName={node}", "State=RESUME", check=False)
        wait_for(lambda: all(self.node_state(n) == "idle" for n in NODES), 60, "all nodes idle again")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    problem = _slurm_missing()
    if problem:
        if os.environ.get("CI"):
            pytest.fail(f"{problem}: the Slurm tests must run in CI")
        pytest.skip(problem)
    base = tmp_path_factory.mktemp("slurm")
    c = Cluster(base)
    env = {**c.env, "NNODES": str(len(NODES)), "CTLD_PORT": str(free_port()), "PORT0": str(_port_block(len(NODES)))}
    started = subprocess.run([str(SCRIPTS / "start.sh")], env=env, capture_output=True, text=True, timeout=120)
    try:
        assert started.returncode == 0, started.stdout + started.stderr
        yield c
    finally:
        subprocess.run([str(SCRIPTS / "stop.sh")], env={**env, "STOP_MUNGE": "1"}, capture_output=True, timeout=120)


def _port_block(n: int) -> int:
    """A base port with base+1..base+n free (slurmd of node i listens on base+i)."""
    import socket

    for _ in range(50):
        base = free_port()
        if base + n >= 65536:
            continue
        ok = True
        for p in range(base + 1, base + n + 1):
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", p))
                except OSError:
                    ok = False
                    break
        if ok:
            return base
    raise AssertionError("no free port block for the slurmd daemons")


@pytest.fixture
def workdir(cluster, tmp_path):
    yield tmp_path
    cluster.run("scancel", "--user=root", check=False)
    cluster.resume_all()


def _trainguard(*flags: str) -> str:
    return f"{PY} -m trainguard run --nproc-per-node 1 --quiet " + " ".join(flags)


def test_hostlist_parser_agrees_with_scontrol(cluster):
    for text in ["n[1-3,7]", "gpu[08-10],cpu1", "r[1-2]-n[01-02]", "a,b"]:
        out = cluster.run("scontrol", "show", "hostnames", text).stdout.split()
        assert hostlist.parse(text) == out


def test_sbatch_two_node_job_autodetects_the_allocation(cluster, workdir):
    script = f"""#!/bin/bash
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --output=out-%j.txt
srun {_trainguard("--precheck off", str(EXAMPLE), "--steps 4")}
"""
    job = cluster.sbatch(script, workdir)
    assert cluster.wait_done(job) == "COMPLETED", (workdir / f"out-{job}.txt").read_text()
    run = workdir / "trainguard-runs" / f"slurm-{job}"
    started = events(run, "job_started")
    assert {e.node for e in started} == {"n1", "n2"}
    assert all(e.evidence["group_world_size"] == 2 for e in started)
    assert {e.node for e in events(run, "job_succeeded")} == {"n1", "n2"}
    out = (workdir / f"out-{job}.txt").read_text()
    assert f"--rdzv-id slurm-{job}.0" in out and "--rdzv-endpoint n1:" in out, out


def test_precheck_failure_drains_the_node_and_the_job_finishes_on_the_spare(cluster, workdir):
    # n2's pre-check asks for more free disk than any machine has: it fails there only.
    script = f"""#!/bin/bash
#SBATCH --nodes=3
#SBATCH --ntasks-per-node=1
#SBATCH --output=out-%j.txt
srun bash -c 'extra=; [ "$SLURMD_NODENAME" = n2 ] && extra="--check-disk-root-gb 100000000"
exec {_trainguard("--nnodes 2:3 --slurm-drain --rdzv-conf last_call_timeout=1 $extra", str(EXAMPLE), "--steps 4")}'
"""
    job = cluster.sbatch(script, workdir)
    cluster.wait_done(job)
    out = (workdir / f"out-{job}.txt").read_text()
    assert f"Exited with exit code {EXIT_EXCLUDED}" in out, out  # n2: excluded (retryable code)
    run = workdir / "trainguard-runs" / f"slurm-{job}"
    assert [e.node for e in events(run, "node_excluded")] == ["n2"]
    assert {e.node for e in events(run, "job_succeeded")} == {"n1", "n3"}, out
    assert (run / "exclude-nodes").read_text() == "n2\n"
    assert f"sbatch --exclude=n2 {workdir / 'job.sbatch'}" in out
    [drained] = events(run, "node_drained")
    assert drained.node == "n2"
    reasons = cluster.run("sinfo", "-R", "-h", "-o", "%N|%E").stdout.strip().splitlines()
    assert len(reasons) == 1 and reasons[0].startswith("n2|trainguard: ") and "disk" in reasons[0], reasons
    assert cluster.node_state("n2") in ("drained", "draining")


def _steps_and_resumes(out: str) -> list[tuple[str, int]]:
    return [(m.group(1), int(m.group(2))) for m in re.finditer(r"\[rank0\]: (resume step|step)=(\d+)", out)]


# The requeue tests' training: the first run cannot end before the signal reaches it (it would
# not be requeued then, whatever the load), the requeued run trains to step 30 from where it resumed.
STEPS = "$(( ${SLURM_RESTART_COUNT:-0} > 0 ? 30 : 100000 ))"


def _requeued_run_resumed(cluster: Cluster, job: str, log: Path) -> str:
    """Start the requeued job, wait for it to complete, and check that its second run resumed
    from the first run's last step, or the one before (at most one step lost). Returns the log."""
    # Slurm starts the requeued job once its previous run's credentials expired (cred_expire=10 in
    # tests/scripts/slurm/start.sh); forcing StartTime=now raced that ("Job credential revoked").
    assert cluster.wait_done(job) == "COMPLETED", log.read_text()
    out = log.read_text()
    seen = _steps_and_resumes(out)
    resumes = [i for i, (kind, _) in enumerate(seen) if kind == "resume step"]
    assert len(resumes) == 2, out
    last_before = max(step for kind, step in seen[: resumes[1]] if kind == "step")
    resumed_at = seen[resumes[1]][1]
    assert 0 < resumed_at and last_before - 1 <= resumed_at <= last_before, (last_before, resumed_at)
    return out


def test_requeue_persists_the_snapshot_and_the_requeued_job_resumes_from_it(cluster, workdir):
    script = f"""#!/bin/bash
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --output=out-%j.txt
#SBATCH --open-mode=append
srun {_trainguard("--precheck off --local-ranks-filter 0", str(EXAMPLE), f"--steps {STEPS} --step-time-ms 100 --ckpt trainguard --ckpt-every 1")}
"""
    job = cluster.sbatch(script, workdir)
    log = workdir / f"out-{job}.txt"
    wait_for(lambda: log.exists() and "[rank0]: step=5 " in log.read_text(), DEADLINE, "step 5 of the first run")
    cluster.run("scontrol", "requeue", job)  # SIGTERM to every task, the job back in the queue
    wait_for(lambda: cluster.state(job) == "PENDING", DEADLINE, "the job requeued")
    out = _requeued_run_resumed(cluster, job, log)
    run = workdir / "trainguard-runs" / f"slurm-{job}"
    preempted = events(run, "job_preempted")
    assert {e.node for e in preempted} == {"n1", "n2"} and all(e.evidence["signal"] == "SIGTERM" for e in preempted)
    assert "Exited with exit code 143" in out  # 128 + SIGTERM: retryable
    assert len({e.node for e in events(run, "job_succeeded")}) == 2


def test_requeue_flag_requeues_a_job_below_its_minimum_without_the_bad_node(cluster, workdir):
    script = f"""#!/bin/bash
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --output=out-%j.txt
#SBATCH --open-mode=append
srun bash -c 'extra=; [ "$SLURMD_NODENAME" = n2 ] && extra="--check-disk-root-gb 100000000"
exec {_trainguard("--requeue $extra", str(EXAMPLE), "--steps 4")}'
"""
    job = cluster.sbatch(script, workdir)  # all nodes idle: Slurm allocates n1 and n2
    log = workdir / f"out-{job}.txt"

    def requeued() -> bool:
        # released by trainguard: pending on Slurm's delay for requeued jobs (BeginTime), not held
        return cluster.job_field(job, "Restarts") not in ("", "0") and cluster.job_field(job, "Reason") == "BeginTime"

    wait_for(requeued, DEADLINE, "trainguard to requeue the job")
    assert "n2" in log.read_text(), log.read_text()  # the first run had n2
    assert cluster.job_field(job, "ExcNodeList") == "n2"
    assert cluster.wait_done(job) == "COMPLETED", log.read_text()
    run = workdir / "trainguard-runs" / f"slurm-{job}"
    [requeue] = events(run, "job_requeued")
    assert requeue.node == "n2" and requeue.evidence["exclude"] == ["n2"]
    assert {e.node for e in events(run, "job_succeeded")} == {"n1", "n3"}, log.read_text()
    assert cluster.node_state("n2") == "idle"  # not drained: only excluded from this job


def test_usr1_warning_with_requeue_persists_then_requeues_and_the_job_resumes(cluster, workdir):
    """sbatch --signal=USR1@N sends SIGUSR1 to the step's tasks before the time limit; scancel
    --signal=USR1 sends the same signal now."""
    script = f"""#!/bin/bash
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --output=out-%j.txt
#SBATCH --open-mode=append
srun {_trainguard("--precheck off --requeue --local-ranks-filter 0", str(EXAMPLE), f"--steps {STEPS} --step-time-ms 100 --ckpt trainguard --ckpt-every 1")}
"""
    job = cluster.sbatch(script, workdir)
    log = workdir / f"out-{job}.txt"
    wait_for(lambda: log.exists() and "[rank0]: step=5 " in log.read_text(), DEADLINE, "step 5 of the first run")
    cluster.run("scancel", "--signal=USR1", job)
    wait_for(lambda: cluster.job_field(job, "Restarts") not in ("", "0") and cluster.state(job) == "PENDING",
             DEADLINE, "trainguard to requeue the job")  # fmt: skip
    _requeued_run_resumed(cluster, job, log)
    run = workdir / "trainguard-runs" / f"slurm-{job}"
    preempted = events(run, "job_preempted")
    assert {e.evidence["signal"] for e in preempted} == {"SIGUSR1"}
    assert {e.node for e in preempted if e.evidence["requeue"]} == {"n1"}  # the first host asks, once
    [requeued] = events(run, "job_requeued")
    assert requeued.node == "n1"
