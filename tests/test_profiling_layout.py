"""Seed 002's profiling layout: records in <root>/$MINDX_TASK_ID/<rank> (root /user/cluster-info/profiling,
or --profiling-root; default_task_id_<timestamp> without the task id), found by the run dir's readers;
the aging fraction configurable; agents sharing a profiling folder age it one at a time."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time

import pytest
from tgtest import EXAMPLE, trainguard_cmd, wait_for

from trainguard.monitors.profiling.monitor import ProfilingMonitor, ProfilingSettings
from trainguard.rundir import profiling as pf
from trainguard.rundir.readers import SpanTail, iter_spans


def test_where_the_records_go(tmp_path):
    run = tmp_path / "run"
    assert pf.place(run) == pf.ProfilingPlace(run / "profiling", run / "profiling", False)  # as before
    assert pf.place(run, task_id="job-42").data == pf.Path("/user/cluster-info/profiling/job-42")
    assert pf.place(run, str(tmp_path / "p"), "job-42") == pf.ProfilingPlace(tmp_path / "p" / "job-42", tmp_path / "p", True)
    default = pf.place(run, str(tmp_path / "p"), now=time.mktime((2026, 12, 8, 2, 30, 5, 0, 0, -1)))
    assert default.data == tmp_path / "p" / "default_task_id_20261208023005"
    run.mkdir()
    pf.prepare(run, default)
    assert pf.data_dir(run) == default.data and oct(default.data.stat().st_mode & 0o777) == "0o700"
    # another node's agent (or this one after a restart) of the same run dir joins that folder
    assert pf.place(run, str(tmp_path / "p")).data == default.data
    pf.prepare(run, pf.place(run))  # back to the run dir: the location file goes
    assert pf.data_dir(run) == run / "profiling"


@pytest.mark.parametrize("bad", ["..", ".", "a/b", "x" * 256])
def test_a_task_id_that_is_not_one_folder_name_is_refused(bad):
    assert pf.task_id_problem(bad) is not None
    assert pf.task_id_problem("job-42_ok") is None


def _files(folder, names, start=1_000_000):
    folder.mkdir(parents=True, exist_ok=True)
    for i, name in enumerate(names):
        p = folder / name
        p.write_text("x" * 100)
        os.utime(p, ns=((start + i) * 10**9, (start + i) * 10**9))
    return [folder / n for n in names]


def test_aging_the_root_covers_every_tasks_rank_folders_with_the_configured_fraction(tmp_path):
    a = _files(tmp_path / "job-a" / "0", ["1", "2", "3", "4"], start=1_000_000)
    b = _files(tmp_path / "default_task_id_20261208023005" / "1", ["5", "6", "7", "8"], start=1_000_100)
    kept = _files(tmp_path / "job-a" / "0", ["notes.txt"]) + _files(tmp_path / "job-a" / "misc", ["9"])
    res = pf.age(tmp_path, cap_bytes=100, fraction=0.5, nested=True)
    assert sorted(res.deleted) == sorted(a)  # the oldest half of the 8 numbered files
    assert all(p.exists() for p in b + kept)


def test_only_the_agent_holding_the_aging_lock_ages_a_shared_folder(tmp_path):
    files = _files(tmp_path / "job-a" / "0", [str(i) for i in range(1, 11)])
    settings = ProfilingSettings(dir_cap_mb=1e-6, root=str(tmp_path), task_id="job-a")
    first, second = ProfilingMonitor(settings), ProfilingMonitor(settings)
    where = pf.place(tmp_path / "run", str(tmp_path), "job-a")
    try:
        first._age(where)  # takes the lock: 20 % of 10
        second._age(where)  # the lock is taken: does not age
        assert [p.exists() for p in files] == [False] * 2 + [True] * 8
        first._aging.release()  # its agent ended
        second._age(where)  # takes over
        assert sum(p.exists() for p in files) == 6
    finally:
        for m in (first, second):
            if m._aging is not None:
                m._aging.release()


def test_the_aging_lock_is_held_across_processes(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", (
        "import sys, time; from trainguard.rundir import profiling as pf; lock = pf.AgingLock(sys.argv[1]); "
        "assert lock.held(); print('held', flush=True); sys.stdin.read()"), str(tmp_path)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        mine = pf.AgingLock(tmp_path)
        assert not mine.held()
        holder.stdin.close()  # the holder ends: its lock goes with it
        holder.wait(timeout=60)
        wait_for(mine.held, 60, "the lock free after its holder ended")
        assert oct((tmp_path / pf.AGING_LOCK).stat().st_mode & 0o777) == "0o600"
        mine.release()
    finally:
        holder.kill()
        holder.wait()


@pytest.mark.slow
def test_a_job_with_a_task_id_writes_the_seeds_layout_and_its_readers_find_it(jobs, tmp_path):
    root, run = tmp_path / "cluster-info" / "profiling", tmp_path / "run"
    job = jobs("run", "--standalone", "--nproc-per-node", "2", "--max-restarts", "1", "--run-dir", run,
               "--profiling-root", root, "--profiling-aging-fraction", "0.5", EXAMPLE, "--steps", "12",
               "--fail-rank", "1", "--fail-step", "5", "--fail-mode", "kill", env={"MINDX_TASK_ID": "job-42"})
    assert job.wait() == 0, job.output()
    assert sorted(p.name for p in (root / "job-42").iterdir()) == ["0", "1"]
    assert all(re.fullmatch(r"\d+", f.name) for d in (root / "job-42").iterdir() for f in d.iterdir())
    assert not (run / "profiling").exists()
    spans = list(iter_spans(run))
    assert {s.rank for s in spans} == {0, 1} and max(s.step for s in spans if s.kind == "Step") == 12
    assert {s.rank for s in SpanTail(run).read()} == {0, 1}
    trace = subprocess.run(trainguard_cmd("trace", run, "-o", tmp_path / "t.json"), capture_output=True, text=True, timeout=120)
    assert trace.returncode == 0 and "of 2 rank(s)" in trace.stdout, trace.stdout + trace.stderr


@pytest.mark.parametrize("argv, says", [
    (["--profiling-aging-fraction", "0"], "expected a fraction > 0 and <= 1, got '0'"),
    (["--profiling-aging-fraction", "1.5"], "expected a fraction > 0 and <= 1, got '1.5'"),
    (["--profiling-root", "/etc/passwd"], "/etc/passwd is not a directory"),
])
def test_bad_profiling_flags_are_one_line_and_exit_2(tmp_path, argv, says):
    r = subprocess.run(trainguard_cmd("run", "--standalone", *argv, EXAMPLE), capture_output=True, text=True,
                       timeout=120, cwd=tmp_path)
    assert r.returncode == 2 and len(r.stderr.splitlines()) == 1 and says in r.stderr, r.stderr
