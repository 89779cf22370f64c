"""The readers of a run (events, status, trace, dashboard, chaos, stacks) open its
event databases read-only and never need write access: after the writer is SIGKILLed in the
middle of a transaction (a hot journal SQLite must roll back), and while a writer holds the
database locked for longer than SQLite's busy timeout. Real processes, real SQLite, real signals."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import urllib.request

import pytest
from tgtest import kill_tree, trainguard_cmd, wait_for

from trainguard.events.store import node_db_path

JOURNAL_MAGIC = bytes.fromhex("d9d505f920a163d7")  # a rollback journal's header once it was synced

KILLED_WRITER = r"""
import os, sys, time
from trainguard.events import EventBus, EventStore
from trainguard.events.store import node_db_path
store = EventStore(node_db_path(sys.argv[1], "n0"))
EventBus(store, node="n0").emit("job_started", "go", evidence={"pids": {"0": os.getpid()}, "attempt": 0})
store._conn.execute("BEGIN IMMEDIATE")
# More than SQLite's page cache: changed pages spill into the database file, the journal is synced.
for i in range(20000):
    store._conn.execute("INSERT INTO events(time, kind, severity, node, rank, message, evidence) "
                        "VALUES (1, 'torn', 'info', 'n0', 0, ?, '{}')", ("x" * 500,))
print("ready", flush=True)
time.sleep(600)
"""

LOCKING_WRITER = r"""
import sys, time
from trainguard.events import EventBus, EventStore
from trainguard.events.store import node_db_path
store = EventStore(node_db_path(sys.argv[1], "n0"))
EventBus(store, node="n0").emit("job_started", "go", evidence={"pids": {"0": 1}, "attempt": 0})
store._conn.execute("BEGIN EXCLUSIVE")  # what a long commit on a slow filesystem holds
store._conn.execute("INSERT INTO events(time, kind, severity, node, rank, message, evidence) "
                    "VALUES (2, 'restart', 'info', 'n0', NULL, 'late', '{}')")
print("ready", flush=True)
sys.stdin.readline()  # held until the test says
store._conn.execute("COMMIT")
print("committed", flush=True)
"""


def digest(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def tg(*args, timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run(trainguard_cmd(*args), capture_output=True, text=True, timeout=timeout,
                          stdin=subprocess.DEVNULL)


@pytest.fixture
def killed_run(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    w = subprocess.Popen([sys.executable, "-c", KILLED_WRITER, str(run)], stdout=subprocess.PIPE, text=True)
    try:
        assert w.stdout.readline().strip() == "ready"
        os.kill(w.pid, signal.SIGKILL)
        w.wait(timeout=60)
    finally:
        kill_tree(w.pid)
        w.stdout.close()
    db = node_db_path(run, "n0")
    journal = db.with_name(db.name + "-journal")
    assert journal.read_bytes()[:8] == JOURNAL_MAGIC, "the journal is hot: SQLite must roll it back"
    return run, db, journal


@pytest.mark.parametrize("argv", [("events", "{run}"), ("status", "--once", "{run}"),
                                  ("trace", "{run}", "-o", "{tmp}/t.json"), ("stacks", "{run}", "--timeout", "1"),
                                  ("chaos", "{run}", "kill", "--rank", "0")], ids=lambda a: a[0])
def test_readers_after_the_writer_was_killed_mid_transaction(killed_run, tmp_path, argv):
    run, db, journal = killed_run
    before = digest(db), digest(journal)
    done = tg(*(a.replace("{run}", str(run)).replace("{tmp}", str(tmp_path)) for a in argv))
    out = done.stdout + done.stderr
    assert "readonly" not in out and "Traceback" not in out, out
    if argv[0] == "events":
        assert done.returncode == 0 and "job_started" in done.stdout and "torn" not in done.stdout
    elif argv[0] == "status":
        assert done.returncode == 0 and "node n0: running, attempt 0" in done.stdout
    elif argv[0] == "trace":
        assert done.returncode == 0 and json.loads((tmp_path / "t.json").read_text())["otherData"]["events"] == 1
    elif argv[0] == "stacks":  # rank 0's worker (the killed writer) is gone: its agent is asked, none answers
        assert done.returncode == 1 and "no answer from the agent of node n0" in done.stderr
    else:  # chaos finds rank 0's worker gone: one line, exit 2
        assert done.returncode == 2 and "cannot be acted on from here" in done.stderr  # no identity recorded: refused
    assert (digest(db), digest(journal)) == before, "a reader wrote the run dir"


def test_dashboard_after_the_writer_was_killed_mid_transaction(killed_run):
    run, db, journal = killed_run
    before = digest(db), digest(journal)
    dash = subprocess.Popen(trainguard_cmd("dashboard", run, "--port", "0"), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        line = dash.stdout.readline()
        assert " on http://" in line, line + dash.stderr.read()
        base, _, query = line.split(" on ", 1)[1].split()[0].partition("?")
        with urllib.request.urlopen(f"{base}api/state?{query}", timeout=60) as r:  # query: the token
            state = json.load(r)
        assert [e["kind"] for e in state["events"]] == ["job_started"]
    finally:
        kill_tree(dash.pid)
        dash.communicate(timeout=60)
    assert (digest(db), digest(journal)) == before


def test_events_waits_out_a_writer_holding_the_lock(tmp_path):
    """A writer holding the database past SQLite's busy timeout (5 s for readers) made a plain
    `events` fail with "database is locked"; it now waits and answers."""
    run = tmp_path / "run"
    run.mkdir()
    w = subprocess.Popen([sys.executable, "-c", LOCKING_WRITER, str(run)], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True)
    reader = None
    try:
        assert w.stdout.readline().strip() == "ready"
        reader = subprocess.Popen(trainguard_cmd("events", run), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                  text=True)
        # Released only once the reader has waited past the busy timeout (5 s) after its start (~2 s).
        wait_for(lambda: _older_than(reader.pid, 15.0), timeout=120, what="the reader to wait on the lock")
        w.stdin.write("go\n")
        w.stdin.flush()
        assert w.stdout.readline().strip() == "committed"
        out, err = reader.communicate(timeout=120)
        assert reader.returncode == 0, err
        assert "job_started" in out and "restart" in out and "locked" not in err
    finally:
        for p in (w, reader):
            if p is not None:
                kill_tree(p.pid)
                p.communicate()


def _older_than(pid: int, seconds: float) -> bool:
    """Whether process ``pid`` was started more than ``seconds`` ago."""
    import time

    import psutil

    try:
        return time.time() - psutil.Process(pid).create_time() > seconds
    except psutil.NoSuchProcess:
        return True
