"""A run dir used again, by two jobs at once, by several nodes at once, or filled up (its files
and per-node event databases), with real jobs."""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import subprocess
import threading

import pytest
from tgtest import (
    EXAMPLE,
    alive,
    events,
    free_port,
    processes_of,
    rank_log,
    trainguard_cmd,
    wait_event,
    wait_for,
)

pytestmark = pytest.mark.slow


def _run(run_dir, *extra):
    return ["run", "--standalone", "--nproc-per-node", "2", "--max-restarts", "2", "--quiet", "--run-dir", run_dir,
            EXAMPLE, *extra]


def test_a_resumed_run_is_diagnosed_on_its_own_lines(tmp_path, jobs):
    """The second run into the same dir fails differently; its diagnosis must not read the
    first run's ZeroDivisionError (that made the policy stop a job it should restart)."""
    run_dir = tmp_path / "R"
    first = jobs(*_run(run_dir, "--steps", "8", "--fail-rank", "1", "--fail-step", "3", "--fail-mode", "zerodiv"))
    assert first.wait() == 1, first.output()
    second = jobs(*_run(run_dir, "--steps", "8", "--fail-rank", "1", "--fail-step", "5", "--fail-mode", "exit"))
    assert second.wait() == 0, second.output()

    diagnoses = events(run_dir, "diagnosis")
    assert len(diagnoses) == 2
    assert diagnoses[0].evidence["category"] == "python_exception"
    assert "ZeroDivisionError" not in str(diagnoses[1].evidence), diagnoses[1].message
    started = events(run_dir, "job_started")
    runs = [e.evidence["run_id"] for e in started]
    assert runs[0] != runs[-1] and [e.evidence["attempt"] for e in started] == [0, 1, 2]
    assert started[1].evidence["first_attempt_of_run"] == 1
    # Each attempt's rank log holds one attempt's lines: the second run's first attempt injected
    # its failure (TRAINGUARD_RESTART_COUNT is 0 on every run's first attempt).
    assert "ZeroDivisionError" in rank_log(run_dir, 0, 1).read_text()
    second_run = rank_log(run_dir, 1, 1).read_text()
    assert "injecting failure (exit) at step=5" in second_run and "ZeroDivisionError" not in second_run
    assert "resume step=0" in rank_log(run_dir, 2, 1).read_text()


def test_a_second_job_on_a_run_dir_is_refused_until_the_first_is_gone(tmp_path, jobs):
    """One job per node on a run dir; the kernel frees the lock even after SIGKILL."""
    run_dir = tmp_path / "R"
    first = jobs(*_run(run_dir, "--steps", "100000", "--step-time-ms", "50"), name="first")
    wait_event(run_dir, "job_started")
    second = jobs(*_run(run_dir, "--steps", "3"), name="second")
    assert second.wait() == 2
    lines = second.output().strip().splitlines()
    assert len(lines) == 1 and "in use by another job" in lines[0] and f"pid {first.proc.pid} " in lines[0], lines
    assert first.proc.poll() is None
    assert {e.node for e in events(run_dir)} == {first_node(run_dir)}
    assert len(events(run_dir, "job_started")) == 1  # the refused job wrote nothing

    workers = processes_of(run_dir)
    first.proc.send_signal(signal.SIGKILL)  # no cleanup at all: only the kernel releases the lock
    first.proc.wait(timeout=60)
    wait_for(lambda: not alive(workers), 60, "the killed agent's workers to die with it")
    third = jobs(*_run(run_dir, "--steps", "3"), name="third")
    assert third.wait() == 0, third.output()


def first_node(run_dir):
    return events(run_dir, "job_started")[0].node


@pytest.fixture
def small_fs(tmp_path):
    """A 6 MB tmpfs, unmounted whatever happens."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mnt = tmp_path / "small"
    mnt.mkdir()
    res = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=6M", "tmpfs", str(mnt)], capture_output=True, text=True)
    if res.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {res.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False, capture_output=True)


def _fill(path) -> None:
    """Append to ``path`` until the filesystem has no byte left (ENOSPC at 64 KB, then at 1 byte)."""
    with open(path, "ab", buffering=0) as f:
        for size in (64 << 10, 4 << 10, 1):
            while True:
                try:
                    f.write(b"\0" * size)
                except OSError as exc:
                    assert exc.errno == errno.ENOSPC, exc
                    break


@contextlib.contextmanager
def _kept_full(directory):
    """The filesystem of ``directory`` full, and filled again whenever something frees room, until
    the block ends. A checkpoint write that the fill interrupts fails and removes its partial file,
    which frees what it had taken: an event stored just then found room, and if every event did, the
    store never used its reserve (CI, 2026-11-28). Writes that start on a full disk free nothing."""
    stop = threading.Event()

    def keep() -> None:
        for _ in range(100_000):  # bounded: 10 ms apart, well past any job of this file
            if stop.wait(0.01):
                return
            _fill(directory / "filler")

    _fill(directory / "filler")
    keeper = threading.Thread(target=keep, daemon=True)
    keeper.start()
    try:
        yield
    finally:
        stop.set()
        keeper.join()


def test_a_full_run_dir_keeps_the_job_record(small_fs, jobs):
    """The run dir fills up mid-job. Training finishes; its end and every checkpoint failure
    are still events (the store's reserve), each write failure is said once, not per line."""
    run_dir = small_fs / "R"
    job = jobs("run", "--standalone", "--nproc-per-node", "2", "--max-restarts", "0", "--run-dir", run_dir,
               EXAMPLE, "--steps", "60", "--step-time-ms", "40", "--ckpt", "trainguard", "--ckpt-every", "5",
               "--hidden", "256")  # fmt: skip
    wait_event(run_dir, "job_started")
    wait_for(lambda: "step=3 " in (rank_log(run_dir, 0, 0).read_text() if rank_log(run_dir, 0, 0).exists() else ""),
             what="rank 0 at step 3")
    with _kept_full(small_fs):
        assert job.wait() == 0, job.output()[-3000:]

    out = job.output()
    assert "Traceback" not in out and "Logging error" not in out, out[-3000:]
    assert events(run_dir, "job_succeeded"), "the run's end was lost"
    failed = events(run_dir, "checkpoint_failed")
    assert failed, out[-3000:]
    assert out.count("[checkpoint_failed]") == len(failed)  # every one the console saw is stored
    assert out.count("events are stored in the space the store reserved") == 1  # the disk did fill: said once
    for rank in (0, 1):  # said once per rank log, not once per line
        assert out.count(f"cannot write {rank_log(run_dir, 0, rank)}") <= 1
    assert out.count("cannot write the agent log") <= 1


def test_several_agents_on_one_run_dir_each_write_their_own_event_database(tmp_path, jobs):
    """Per-node event databases: three agents (nodes on loopback) share one run dir, as on a shared
    filesystem; each writes only events/<node>.db, every reader merges them, and all three agree on
    one run id and attempt numbering."""
    run_dir = tmp_path / "R"
    port = free_port()
    common = ["--nnodes", "3", "--nproc-per-node", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint",
              f"127.0.0.1:{port}", "--rdzv-id", "shared", "--max-restarts", "0", "--run-dir", run_dir,
              "--precheck", "off", "--quiet"]  # fmt: skip
    nodes = ["node0", "node1", "node2"]
    started = [jobs("run", *common, "--node-name", n, EXAMPLE, "--steps", "15", name=n) for n in nodes]
    for job in started:
        assert job.wait() == 0, job.output()[-3000:]

    assert sorted(p.name for p in (run_dir / "events").iterdir() if p.suffix == ".db") == [f"{n}.db" for n in nodes]
    assert not (run_dir / "events.db").exists()
    for n in nodes:  # each database holds the events its own node recorded only: an event about
        # another node (the straggler leader names the slow node, which a loaded machine may make
        # of any of the three) says who recorded it
        recorded = {e.evidence.get("recorded_by", e.node) for e in events(run_dir / "events" / f"{n}.db")}
        assert recorded == {n}
    merged = events(run_dir)
    assert [e.time for e in merged] == sorted(e.time for e in merged)
    assert sorted(e.node for e in events(run_dir, "job_succeeded")) == nodes
    started_ev = events(run_dir, "job_started")
    assert sorted(e.node for e in started_ev) == nodes
    assert len({e.evidence["run_id"] for e in started_ev}) == 1 and {e.evidence["attempt"] for e in started_ev} == {0}
    res = subprocess.run(trainguard_cmd("events", run_dir, "--kind", "job_succeeded"), capture_output=True, text=True,
                         timeout=120)  # fmt: skip
    assert res.returncode == 0 and all(n in res.stdout for n in nodes), res.stdout + res.stderr
