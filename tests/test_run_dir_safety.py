"""Nothing in a run dir is written through a symlink or into a special
file, and damaged run-dir files never crash or hang a reader. Real files, FIFOs, devices, SQLite."""

from __future__ import annotations

import json
import os
import sqlite3
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from tgtest import trainguard_cmd

from trainguard.events import EventBus, EventStore
from trainguard.events.store import node_db_path


def make_run(run) -> None:
    store = EventStore(node_db_path(run, "n0"))
    bus = EventBus(store, node="n0")
    bus.emit("job_started", "go", evidence={"pids": {"0": 1}, "attempt": 0})
    bus.emit("restart", "again", evidence={"max_restarts": 3})
    store.close()


def tg(*args, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(trainguard_cmd(*args), capture_output=True, text=True, timeout=timeout,
                          stdin=subprocess.DEVNULL)


def one_line_refusal(done: subprocess.CompletedProcess) -> str:
    assert done.returncode == 2, (done.returncode, done.stdout, done.stderr)
    assert "Traceback" not in done.stderr + done.stdout
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    return lines[0]


def fingerprint(path) -> tuple:
    st = os.lstat(path)
    return st.st_mode, st.st_ino, st.st_size


def test_trace_output_never_replaces_what_is_not_its_own_regular_file(tmp_path):
    """Item 3: -o at a symlink (live or dangling), a FIFO, a device or the run's own event database
    is refused with one line, and the thing at that path is left exactly as it was."""
    run = tmp_path / "run"
    make_run(run)
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me\n")
    targets = {"link": tmp_path / "link.json", "dangling": tmp_path / "dangling.json", "fifo": tmp_path / "fifo",
               "db": node_db_path(run, "n0")}
    targets["link"].symlink_to(victim)
    targets["dangling"].symlink_to(tmp_path / "nowhere" / "x.json")
    os.mkfifo(targets["fifo"])
    if os.geteuid() == 0:  # a character device like /dev/null, made here: root replacing one is the harm
        targets["device"] = tmp_path / "null"
        os.mknod(targets["device"], stat.S_IFCHR | 0o666, os.makedev(1, 3))
    before = {k: fingerprint(p) for k, p in targets.items()}
    for name, path in targets.items():
        line = one_line_refusal(tg("trace", run, "-o", path))
        assert "refused" in line and str(path) in line, (name, line)
        assert fingerprint(path) == before[name], f"{name} was replaced"
    assert victim.read_text() == "keep me\n"
    assert not (tmp_path / "nowhere").exists()
    assert [r[0] for r in sqlite3.connect(targets["db"]).execute("SELECT kind FROM events")] == ["job_started", "restart"]
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []  # no temporary left


def test_trace_output_read_only_and_regular(tmp_path):
    """Item 3: a target that cannot be written gives one line; a regular file is replaced whole."""
    run = tmp_path / "run"
    make_run(run)
    ro = tmp_path / "ro"
    ro.mkdir()
    (ro / "t.json").write_text("old")
    ro.chmod(0o555)
    try:
        if os.geteuid() == 0:
            subprocess.run(["chattr", "+i", str(ro)], check=True, capture_output=True)
        line = one_line_refusal(tg("trace", run, "-o", ro / "t.json"))
        assert "cannot write" in line
        assert (ro / "t.json").read_text() == "old"
    finally:
        if os.geteuid() == 0:
            subprocess.run(["chattr", "-i", str(ro)], capture_output=True)
        ro.chmod(0o755)
    out = tmp_path / "t.json"
    out.write_text("old")
    done = tg("trace", run, "-o", out)
    assert done.returncode == 0, done.stderr
    assert json.loads(out.read_text())["otherData"]["events"] == 2


def test_event_database_is_never_written_through_a_symlink(tmp_path):
    """Item 6: another application's SQLite file behind a symlink is not modified, and a dangling
    link's target is not created outside the run dir; the writer says why in one error."""
    other = tmp_path / "other.db"
    conn = sqlite3.connect(other)
    conn.execute("CREATE TABLE mine (x)")
    conn.commit()
    conn.close()
    before = other.read_bytes()
    db = node_db_path(tmp_path / "run", "n0")
    db.parent.mkdir(parents=True)
    db.symlink_to(other)
    with pytest.raises(OSError, match="symlink"):
        EventStore(db)
    assert other.read_bytes() == before
    db.unlink()
    db.symlink_to(tmp_path / "outside.db")  # dangling
    with pytest.raises(OSError, match="symlink"):
        EventStore(db)
    assert not (tmp_path / "outside.db").exists()
    db.unlink()
    journal = db.with_name(db.name + "-journal")
    journal.symlink_to(tmp_path / "outside-journal")  # SQLite would write its journal there
    with pytest.raises(OSError, match="symlink"):
        EventStore(db)
    assert not (tmp_path / "outside-journal").exists()
    journal.unlink()
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "run2").mkdir()
    (tmp_path / "run2" / "events").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(OSError, match="not a directory"):
        EventStore(node_db_path(tmp_path / "run2", "n0"))
    assert list((tmp_path / "elsewhere").iterdir()) == []
    chaos = tg("chaos", tmp_path / "run2", "kill", "--rank", "0")  # no run dir to read: one line, nothing made
    one_line_refusal(chaos)
    assert list((tmp_path / "elsewhere").iterdir()) == []


def damaged_run(run) -> None:
    """A run dir as a careless or hostile hand leaves it: rows of the wrong types, records out of
    range, a FIFO and a directory among the profiling records, odd hang reports."""
    store = EventStore(node_db_path(run, "n0"))
    bus = EventBus(store, node="n0")
    bus.emit("job_started", "go", evidence={"pids": {"0": os.getpid(), "1": "abc"}, "attempt": "zero"})
    bus.emit("job_started", "go", evidence={"pids": [1, 2], "max_restarts": "many"})
    bus.emit("hang_detected", "h", evidence={"nodes": 5})
    bus.emit("node_excluded", "x", evidence={"source": "worker_exit", "cause": "text"})
    bus.emit("node_held", "held", evidence={"until": "tomorrow"})
    rows = [("abc", "job_started", "info", "n0", "r0", "text time", "{}"),
            (1e300, "restart", "info", "n0", 10**15, "far future", "[1, 2]"),
            (1.5, 5, 7, 8, -5, b"\x00\xff", "not json")]
    store._conn.executemany("INSERT INTO events(time, kind, severity, node, rank, message, evidence) "
                            "VALUES (?,?,?,?,?,?,?)", rows)
    store.close()
    prof = run / "profiling" / "0"
    prof.mkdir(parents=True)
    far = {"rank": 0, "kind": "Step", "step": 1, "start_ns": 10**30, "end_ns": 10**31}
    (prof / "1000").write_text(json.dumps(far) + "\n" + json.dumps({"rank": 10**20, "kind": "FP", "step": 1,
                               "start_ns": 1, "end_ns": 2}) + "\n[1, 2]\n{\"rank\": {}}\n")
    os.mkfifo(prof / "2000")  # nobody writes it: an open() for reading would block for ever
    (prof / "3000").mkdir()
    (run / "profiling" / "1").write_text("not a rank dir")
    (run / "hang-dir.txt").mkdir()
    (run / "hang-dangling.txt").symlink_to(run / "gone")
    (run / "hang-passwd.txt").symlink_to("/etc/passwd")
    os.mkfifo(run / "hang-fifo.txt")


@pytest.mark.parametrize("argv", [("status", "--once"), ("status", "--json"), ("events",), ("trace", "-o", "-"),
                                  ("stacks", "--timeout", "1"), ("chaos", "kill", "--rank", "0")],
                         ids=lambda a: " ".join(a))
def test_damaged_run_dir_gets_an_answer(tmp_path, argv):
    """Item 10: wrong-typed details, text in a time column, out-of-range numbers, a FIFO and a
    directory where records go: an answer or one line, never a traceback or a hang."""
    run = tmp_path / "run"
    damaged_run(run)
    cmd, *rest = argv
    done = tg(cmd, run, *rest, timeout=120)
    assert "Traceback" not in done.stdout + done.stderr, done.stderr
    assert done.returncode in (0, 1, 2), done.stderr
    if done.returncode == 2:
        assert len(done.stderr.strip().splitlines()) == 1, done.stderr


def test_status_counts_what_it_could_read_of_a_damaged_run(tmp_path):
    run = tmp_path / "run"
    damaged_run(run)
    done = tg("status", "--json", run)
    assert done.returncode == 0, done.stderr
    snap = json.loads(done.stdout)
    n0 = next(n for n in snap["nodes"] if n["node"] == "n0")
    assert n0["state"] == "excluded" or n0["state"] == "held"
    assert [r["rank"] for r in snap["ranks"]] == [0]  # "1": "abc" is no pid; [1, 2] are no pids


def test_trace_streams_span_records(tmp_path):
    """Item 10: trace writes span records as it reads them. 60 MB of records are traced in far
    less memory than the records take as Python objects (the old code held them all, and their
    JSON text, at once: 2.3 GB for a 400 MB run dir)."""
    run = tmp_path / "run"
    make_run(run)
    store = EventStore(node_db_path(run, "n0"))
    t0 = 1_800_000_000
    store._conn.execute("UPDATE events SET time = ?", (t0,))
    store.close()
    prof = run / "profiling" / "0"
    prof.mkdir(parents=True)
    line = '{"rank":0,"kind":"FP","name":"forward pass of a model with a long name","step":%d,"start_ns":%d,"end_ns":%d}\n'
    for f in range(4):
        with open(prof / str(1000 + f), "w") as out:
            base = (t0 + 1 + f * 1000) * 10**9
            out.writelines(line % (k, base + k * 1000, base + k * 1000 + 500) for k in range(150_000))
    code = ("import resource, sys; from trainguard.cli import main; rc = main(sys.argv[1:]); "
            "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024, file=sys.stderr); sys.exit(rc)")

    def trace(run_dir: Path) -> tuple[int, str]:
        """(peak RSS in MB, stdout) of `trainguard trace run_dir`."""
        done = subprocess.run([sys.executable, "-c", code, "trace", str(run_dir), "-o", str(tmp_path / "t.json")],
                              capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr
        return int(done.stderr.strip().splitlines()[-1]), done.stdout

    # The same command on the same run without records: what the interpreter and its imports take
    # here (it differs with the environment a test session leaves), so only the records' share counts.
    empty = tmp_path / "empty"
    make_run(empty)
    base_mb, _ = trace(empty)
    peak_mb, out = trace(run)
    assert "600000 span(s)" in out
    records_mb = sum(p.stat().st_size for p in prof.iterdir()) >> 20
    assert peak_mb - base_mb < 2 * records_mb, (peak_mb, base_mb, records_mb)
