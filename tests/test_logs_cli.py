"""`trainguard logs`: every attempt's rank logs of a run merged by time, filtered by worker and time
(pick a worker and read its logs around a moment, to the second)."""

from __future__ import annotations

import subprocess
from datetime import UTC, datetime, timedelta

import pytest
from tgtest import EXAMPLE, free_port, trainguard_cmd, wait_for

from trainguard.view.logs_cli import parse_time

pytestmark = pytest.mark.slow


def logs(*args) -> subprocess.CompletedProcess:
    return subprocess.run(trainguard_cmd("logs", *args), capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def two_node_run(tmp_path_factory):
    """A real job: two agents (node0, node1) sharing one run dir, one rank each; rank 1 is killed at
    step 5 of attempt 0 and both nodes restart it (attempt 1)."""
    tmp = tmp_path_factory.mktemp("logs")
    run, port = tmp / "run", free_port()
    common = ["--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint",
              f"127.0.0.1:{port}", "--rdzv-id", "logs", "--max-restarts", "2", "--run-dir", str(run)]
    procs = [subprocess.Popen(trainguard_cmd("run", *common, "--node-name", f"node{i}", EXAMPLE, "--steps", "8",
                                             "--fail-rank", "1", "--fail-step", "5", "--fail-mode", "kill"),
                              stdout=(tmp / f"node{i}.out").open("wb"), stderr=subprocess.STDOUT) for i in (0, 1)]
    try:
        for i, p in enumerate(procs):
            assert p.wait(timeout=300) == 0, (tmp / f"node{i}.out").read_text()
    finally:
        for p in procs:
            p.kill()
            p.wait()
    return run


def _lines(result: subprocess.CompletedProcess) -> list[str]:
    assert result.returncode == 0, result.stderr
    return result.stdout.splitlines()


def test_every_attempt_of_every_node_merged_by_time_with_node_rank_attempt(two_node_run):
    lines = _lines(logs(two_node_run))
    times = [ln.split(" ", 1)[0] for ln in lines]
    assert times == sorted(times)
    assert any(ln.endswith("[node1/rank1/attempt0] injecting failure (kill) at step=5 rank=1") for ln in lines)
    for prefix in ("[node0/rank0/attempt0] resume step=0", "[node0/rank0/attempt1] resume step=0",
                   "[node1/rank1/attempt1] step=8 rank=1"):
        assert any(prefix in ln for ln in lines), prefix
    assert all("[rank" not in ln.split("] ", 1)[1][:7] for ln in lines)  # the file's own [rankN]: is dropped


def test_one_worker_one_attempt_and_node_filters(two_node_run):
    one = _lines(logs(two_node_run, "--rank", "1", "--attempt", "0"))
    assert one and all("[node1/rank1/attempt0]" in ln for ln in one)
    assert "injecting failure" in one[-1]
    node0 = _lines(logs(two_node_run, "--node", "node0"))
    assert node0 and all("[node0/rank0/" in ln for ln in node0)
    assert _lines(logs(two_node_run, "--node", "node7")) == []


def test_time_window_to_the_second_and_grep(two_node_run):
    lines = _lines(logs(two_node_run, "--rank", "1"))
    failed = next(ln for ln in lines if "injecting failure" in ln)
    when = datetime.fromisoformat(failed.split(" ", 1)[0])
    window = _lines(logs(two_node_run, "--rank", "1", "--since", when.isoformat(), "--until",
                         (when + timedelta(microseconds=1)).isoformat()))
    assert window == [failed]
    later = _lines(logs(two_node_run, "--since", (when + timedelta(microseconds=1)).isoformat()))
    assert later and all(datetime.fromisoformat(ln.split(" ", 1)[0]) > when for ln in later)
    steps = _lines(logs(two_node_run, "--grep", r"^step=[67] rank=\d"))  # after the kill at step 5: attempt 1 only
    assert {ln.split("] ", 1)[0].split("[", 1)[1] for ln in steps} == {"node0/rank0/attempt1", "node1/rank1/attempt1"}


def test_follow_prints_lines_written_after_it_started(tmp_path):
    attempt = tmp_path / "logs" / "attempt-0"
    attempt.mkdir(parents=True)
    log = attempt / "rank-0.log"
    log.write_text("2026-12-08T02:12:32.064428 [rank0]: resume step=0\n")
    out = tmp_path / "follow.out"
    with out.open("wb") as sink:
        proc = subprocess.Popen(trainguard_cmd("logs", tmp_path, "--follow", "--interval", "0.1"), stdout=sink)
    try:
        wait_for(lambda: "resume step=0" in out.read_text(), 60, "the existing line")
        with log.open("a") as f:
            f.write("2026-12-08T02:12:33.000001 [rank0]: step=1 rank=0\n2026-12-08T02:12:33.5")  # the last one unfinished
        wait_for(lambda: "[?/rank0/attempt0] step=1 rank=0" in out.read_text(), 60, "the appended line")
        assert "02:12:33.5" not in out.read_text()
    finally:
        proc.kill()
        proc.wait()


def test_time_forms_iso_clock_and_relative():
    now = datetime(2026, 12, 8, 2, 30, 0)
    assert parse_time("-5m", now) == datetime(2026, 12, 8, 2, 25, 0)
    assert parse_time("-90s", now) == datetime(2026, 12, 8, 2, 28, 30)
    assert parse_time("01:02:03", now) == datetime(2026, 12, 8, 1, 2, 3)
    assert parse_time("2026-12-07T23:59:59.5", now) == datetime(2026, 12, 7, 23, 59, 59, 500000)
    utc = datetime(2026, 12, 8, 1, 0, tzinfo=UTC)
    assert parse_time("2026-12-08T01:00:00+00:00", now) == utc.astimezone().replace(tzinfo=None)


@pytest.mark.parametrize("args, says", [
    (["--since", "yesterday"], "bad time 'yesterday'"),
    (["--until", "25:00:00"], "bad time '25:00:00'"),
    (["--grep", "(?=step)"], "bad --grep pattern"),
    (["--rank", "x"], "bad rank 'x'"),
    (["--since", "02:00:00", "--until", "01:00:00"], "--since is after --until"),
])
def test_bad_input_is_one_line_and_exit_2(tmp_path, args, says):
    (tmp_path / "logs").mkdir()
    result = logs(tmp_path, *args)
    assert result.returncode == 2 and result.stdout == ""
    assert len(result.stderr.splitlines()) == 1 and says in result.stderr, result.stderr


def test_not_a_run_dir(tmp_path):
    result = logs(tmp_path / "none")
    assert result.returncode == 2 and len(result.stderr.splitlines()) == 1 and "no logs/ directory" in result.stderr
