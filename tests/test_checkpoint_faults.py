"""Real processes, real faults: SIGKILL a worker right after a snapshot, a worker dying inside a
save, the agent killed while persisting. The checkpoint monitor is driven by hand as the agent
would drive it (a MonitorContext built here), or runs in a stand-in agent process."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from tgtest import SCRIPTS, free_port, kill_tree, wait_for

sys.path.insert(0, str(SCRIPTS))

from trainguard.checkpoint import disk
from trainguard.checkpoint.client import Checkpointer
from trainguard.checkpoint.shm import read_header, slot_files
from trainguard.events import EventBus, EventStore
from trainguard.events.store import read_all
from trainguard.monitors.api import MonitorContext, StepTracker, WorkerInfo
from trainguard.monitors.checkpoint import CheckpointMonitor

WORKER = SCRIPTS / "checkpoint_worker.py"
AGENT = SCRIPTS / "checkpoint_agent.py"


class Workers:
    """A DDP job of `n` worker processes started the way the agent would start them."""

    def __init__(self, out: Path, env: dict[str, str], n: int, args_for: dict[int, list[str]]) -> None:
        port = str(free_port())
        self.out = out
        self.procs: dict[int, subprocess.Popen] = {}
        out.mkdir(parents=True, exist_ok=True)
        for rank in range(n):
            wenv = dict(
                os.environ,
                **env,
                RANK=str(rank),
                LOCAL_RANK=str(rank),
                WORLD_SIZE=str(n),
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=port,
                OMP_NUM_THREADS="1",
            )
            with open(out / f"rank{rank}.log", "wb") as log:
                self.procs[rank] = subprocess.Popen(
                    [sys.executable, str(WORKER), *args_for.get(rank, [])],
                    env=wenv,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )

    def text(self, rank: int) -> str:
        return (self.out / f"rank{rank}.log").read_text(errors="replace")

    def last(self, rank: int, pattern: str) -> re.Match | None:
        matches = list(re.finditer(pattern, self.text(rank)))
        return matches[-1] if matches else None

    def saved(self, rank: int) -> dict[int, str]:
        return {
            int(m[1]): m[2] for m in re.finditer(r"saved step=(\d+) digest=(\w+) ok=True", self.text(rank))
        }

    def resume(self, rank: int) -> tuple[int, str]:
        m = wait_for(lambda: self.last(rank, r"resume step=(\d+) digest=(\S+)"), what=f"rank {rank} resume")
        return int(m[1]), m[2]

    def kill(self) -> None:
        for p in self.procs.values():
            kill_tree(p.pid)
            p.wait()

    def failures(self) -> dict[int, dict]:
        return {
            r: {
                "local_rank": r,
                "pid": p.pid,
                "exitcode": p.returncode,
                "signal": None,
                "error_file_data": None,
                "log_tail": [],
            }
            for r, p in self.procs.items()
            if p.returncode
        }

    def infos(self) -> list[WorkerInfo]:
        return [WorkerInfo(r, r, p.pid) for r, p in self.procs.items()]


def assert_digests(step: int, got: dict[int, str], saved: dict[int, dict[int, str]]) -> None:
    """The resumed state is bit-identical to what the rank saved at that step (where it printed it:
    a kill can land between a save and its print)."""
    compared = 0
    for rank, digest in got.items():
        if step in saved[rank]:
            assert digest == saved[rank][step], f"rank {rank} resumed a different state at step {step}"
            compared += 1
    assert compared, f"no rank printed the digest of step {step}"


def memory_steps(env: dict[str, str], rank: int) -> set[int]:
    """Steps of a rank's complete in-memory snapshots."""
    steps = set()
    for path, r in slot_files(Path(env["TRAINGUARD_CKPT_SHM_DIR"])):
        hdr = read_header(path) if r == rank else None
        if hdr is not None and hdr.complete:
            steps.add(hdr.step)
    return steps


def available_steps(env: dict[str, str], rank: int) -> set[int]:
    """Steps a rank could resume: complete in-memory snapshots and committed checkpoints."""
    return set(disk.list_steps(Path(env["TRAINGUARD_CKPT_DIR"]), rank)) | memory_steps(env, rank)


def context(run_dir: Path, store: EventStore, restart: int, workers: list[WorkerInfo]) -> MonitorContext:
    return MonitorContext(
        run_dir=run_dir,
        node="n0",
        node_rank=0,
        nnodes=1,
        nproc_per_node=2,
        world_size=2,
        restart_count=restart,
        workers=workers,
        events=EventBus(store, "n0"),
        steps=StepTracker(),
    )


@pytest.mark.slow
def test_checkpoint_sigkill_after_snapshot_and_death_inside_save(tmp_path, shm_root):
    run_dir = tmp_path / "run"
    mon = CheckpointMonitor(keep=3, shm_root=shm_root)
    store = EventStore(run_dir)
    jobs: list[Workers] = []
    try:
        env = mon.worker_env(run_dir)
        ckpt_dir = Path(env["TRAINGUARD_CKPT_DIR"])
        mon.on_before_start(context(run_dir, store, 0, []))

        # Attempt 0: snapshot every step; SIGKILL rank 1 right after one.
        job = Workers(tmp_path / "a0", env, 2, {})
        jobs.append(job)
        mon.on_workers_started(context(run_dir, store, 0, job.infos()))
        wait_for(
            lambda: job.last(1, r"saved step=(\d+)") and int(job.last(1, r"saved step=(\d+)")[1]) >= 8,
            what="rank 1 saved step 8",
        )
        os.kill(job.procs[1].pid, signal.SIGKILL)
        job.procs[1].wait()
        job.kill()
        last_trained = int(job.last(1, r"step=(\d+)\n")[1])
        saved = {r: job.saved(r) for r in (0, 1)}
        mon.on_workers_failed(context(run_dir, store, 0, job.infos()), job.failures())

        # Attempt 1: resumes from memory at the last snapshot, <= 1 step lost, bit-identical.
        # Rank 1 then dies inside its 3rd save (bytes copied, never committed).
        job = Workers(tmp_path / "a1", env, 2, {1: ["--die-in-save", "3"]})
        jobs.append(job)
        mon.on_workers_started(context(run_dir, store, 1, job.infos()))
        (r0, d0), (r1, d1) = job.resume(0), job.resume(1)
        assert r0 == r1, "ranks must agree on the step"
        resumed = r0
        assert 0 <= last_trained - resumed <= 1, f"lost {last_trained - resumed} steps"
        assert_digests(resumed, {0: d0, 1: d1}, saved)
        for r in (0, 1):  # persisted at breakpoint, before the restart
            assert resumed in disk.list_steps(ckpt_dir, r)
        wait_for(lambda: "dying in save" in job.text(1), what="rank 1 dying in a save")
        job.procs[1].wait()
        job.kill()
        saved = {r: {**saved[r], **job.saved(r)} for r in (0, 1)}  # steps of both attempts
        mon.on_workers_failed(context(run_dir, store, 1, job.infos()), job.failures())

        # Attempt 2: the torn snapshot is ignored; both ranks agree on the newest step both have
        # (in memory or on disk): resumed + 2, rank 1's last complete snapshot. A slot the agent
        # pins while persisting it never makes a save go over a rank's newest snapshot (three
        # slots per rank), so rank 0 still holds that step in memory.
        expected = max(available_steps(env, 0) & available_steps(env, 1))
        assert expected == resumed + 2
        assert expected in memory_steps(env, 0) and expected in memory_steps(env, 1)
        job = Workers(tmp_path / "a2", env, 2, {r: ["--steps", str(resumed + 5)] for r in (0, 1)})
        jobs.append(job)
        mon.on_workers_started(context(run_dir, store, 2, job.infos()))
        (r0, d0), (r1, d1) = job.resume(0), job.resume(1)
        assert r0 == r1 == expected
        assert_digests(r0, {0: d0, 1: d1}, saved)
        for r in (0, 1):
            assert job.procs[r].wait(timeout=120) == 0, job.text(r)
        mon.on_workers_stopped(context(run_dir, store, 2, job.infos()))
        assert disk.list_steps(ckpt_dir, 1)[0] == resumed + 5
        loaded = [e for e in store.query(kinds=["checkpoint_loaded"])]
        assert [e.evidence["source"] for e in loaded] == ["memory", "memory"]
        assert store.query(kinds=["checkpoint_persisted"])
    finally:
        for j in jobs:
            j.kill()
        mon.close()
        store.close()
    assert not any(shm_root.iterdir()), "shared memory left behind"


@pytest.mark.slow
@pytest.mark.parametrize("next_job", ["same", "another"])
def test_checkpoint_agent_killed_while_persisting_keeps_previous_checkpoint_and_next_agent_rescues_newer(
        tmp_path, shm_root, next_job):
    """The agent is SIGKILLed in the middle of a persist: the previous checkpoint stays intact. The
    newer snapshots it held in shared memory are not lost: the next agent starting on
    the node persists them before it removes the dead agent's directory. When that agent belongs
    to another job (another run dir, the same checkpoint dir), the rescue is not reported as its
    own, and not written into the dead job's run either (a path read from the directory)."""
    run_dir, ckpt_dir = tmp_path / "run", tmp_path / "ckpt"
    # A stand-in agent that persists at 8 MB/s: a 4 MB snapshot takes about half a second to write.
    agent = subprocess.Popen(
        [sys.executable, str(AGENT), str(run_dir), str(ckpt_dir), str(shm_root), "8"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        start_new_session=True,
    )
    job = None
    try:
        env = json.loads(agent.stdout.readline())
        agent_shm = Path(env["TRAINGUARD_CKPT_SHM_DIR"])
        job = Workers(tmp_path / "w", env, 1, {0: ["--big-mb", "4", "--step-sleep", "0.05"]})

        def persisting_after_a_commit():
            committed = disk.list_steps(ckpt_dir, 0)
            temps = [
                p
                for p in ckpt_dir.glob("step-*/*.tmp-*")
                if committed and p.parent.name > f"step-{committed[0]:010d}"
            ]
            return temps if temps else None

        temps = wait_for(
            persisting_after_a_commit, what="a persist in progress after a committed one", every=0.02
        )
        kill_tree(agent.pid)
        agent.wait()
        job.kill()
        assert temps[0].exists(), "the interrupted persist left its temp file (the test's premise)"
        committed = disk.list_steps(ckpt_dir, 0)[0]
        meta, _ = disk.read_checkpoint(ckpt_dir, 0, committed)  # intact, verifies
        saved = job.saved(0)
        held = memory_steps({"TRAINGUARD_CKPT_SHM_DIR": str(agent_shm)}, 0)
        assert max(held) > committed, "the dead agent held a newer snapshot (the test's premise)"

        # The next agent on the node: rescues the newer snapshots, then removes the dead directory
        # and the interrupted persist's temp file.
        next_run = run_dir if next_job == "same" else tmp_path / "another-run"
        store = EventStore(next_run)
        mon = CheckpointMonitor(ckpt_dir=ckpt_dir, shm_root=shm_root)
        try:
            mon.on_before_start(context(next_run, store, 0, []))
            env2 = mon.worker_env(next_run)
            assert not agent_shm.exists()
            assert not list(ckpt_dir.glob("step-*/*.tmp-*"))
            assert disk.list_steps(ckpt_dir, 0)[0] == max(held)
            rescues = [e for e in read_all(run_dir) if e.kind == "checkpoint_rescued"]
            if next_job == "same":
                [rescued] = rescues
                assert max(held) in rescued.evidence["steps"] and rescued.severity.label == "warning"
            else:  # one log line: no event DB is written at a run dir read from the dead agent's dir
                assert rescues == []
                assert not store.query(kinds=["checkpoint_rescued"]), "another job's rescue reported as this job's"
            state = Checkpointer(Path(env2["TRAINGUARD_CKPT_SHM_DIR"]), ckpt_dir, 0, 1).load_latest()
        finally:
            mon.close()
            store.close()
        assert state["step"] == max(held) and bool((state["big"] == max(held)).all())
        from checkpoint_worker import digest

        if max(held) in saved:  # a kill can land between the save and its print
            assert digest(state) == saved[max(held)]
    finally:
        kill_tree(agent.pid)
        if job is not None:
            job.kill()


@pytest.mark.slow
def test_checkpoint_sharded_dtensor_state_and_cross_rank_fallback(tmp_path, shm_root):
    port = str(free_port())
    procs = []
    try:
        for rank in range(2):
            env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                       MASTER_PORT=port, OMP_NUM_THREADS="1", TRAINGUARD_CKPT_DIR=str(tmp_path / "ckpt"),
                       SHM_ROOT=str(shm_root), TRAINGUARD_CKPT_SHM_ROOT=str(shm_root))
            env.pop("TRAINGUARD_CKPT_SHM_DIR", None)
            procs.append(subprocess.Popen([sys.executable, str(SCRIPTS / "checkpoint_dtensor.py")], env=env,
                                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                          start_new_session=True))
        outs = [p.communicate(timeout=180)[0] for p in procs]
    finally:
        for p in procs:
            kill_tree(p.pid)
    results = []
    for p, out in zip(procs, outs, strict=True):
        assert p.returncode == 0, out
        results.append(json.loads(out.strip().splitlines()[-1]))
    for r in results:
        assert r["step"] == 2 and r["is_dtensor"] and r["full_ok"], r
        assert r["placements"] == ["S(0)"] and r["local_rows"] == 4
        # Rank 1's step 2 is corrupt: every rank resumes step 1, not just rank 1.
        assert r["after_corruption_step"] == 1 and r["after_corruption_ok"], r
    assert results[1]["reports"] == 1  # rank 1 reported the fallback
    # Resumed from step 1: each rank's step 2 (rank 0's good one, rank 1's rotten one) is from the
    # abandoned timeline, moved aside so a later restart cannot agree on it
    assert [r["abandoned"] for r in results] == [[[2]], [[2]]], results
    # Rank 1's files gone (its node's disk): no step every rank holds; both start fresh, and rank 0,
    # which holds steps, says so (never a silent fresh start)
    assert results[0]["after_loss"] is None and results[1]["after_loss"] is None, results
    assert len(results[0]["unshared_reports"]) == 1 and "holds step(s) [1] but no step is held by every rank" in \
        results[0]["unshared_reports"][0], results[0]
    assert results[1]["unshared_reports"] == [], results[1]


@pytest.mark.slow
def test_checkpoint_end_to_end_under_trainguard_run(tmp_path, jobs, shm_root):
    """`trainguard run`: rank 1 is SIGKILLed right after its step-8 snapshot; the restarted job
    resumes from memory at step 8 with the exact state, and the agent leaves no shared memory."""
    run_dir = tmp_path / "run"
    job = jobs("run", "--standalone", "--nproc-per-node", "2", "--max-restarts", "1", "--run-dir", str(run_dir),
               "--ckpt-shm-dir", str(shm_root), "--quiet", str(WORKER), "--steps", "14", "--every", "1", "--step-sleep", "0.02",
               "--kill-after-save", "8")
    assert job.wait() == 0, job.output()
    first = {r: (run_dir / "logs" / "attempt-0" / f"rank-{r}.log").read_text() for r in (0, 1)}
    second = {r: (run_dir / "logs" / "attempt-1" / f"rank-{r}.log").read_text() for r in (0, 1)}
    saved8 = re.search(r"saved step=8 digest=(\w+)", first[1])[1]
    for r in (0, 1):
        assert f"resume step=8 digest={saved8}" in second[r] if r == 1 else "resume step=8 " in second[r]
        assert "done" in second[r]
    ev = {e.kind: e for e in _events(run_dir)}
    assert ev["checkpoint_loaded"].evidence == {"step": 8, "source": "memory"}
    assert "checkpoint_persisted" in ev
    shm_dir = Path(re.search(r"shm_dir=(\S+)", second[0])[1])
    assert shm_dir.parent == shm_root and not shm_dir.exists()  # the agent cleaned up
    assert disk.list_steps(run_dir / "checkpoints", 0)[0] == 14


def _events(run_dir: Path):
    return read_all(run_dir)  # every node's database of the run dir
