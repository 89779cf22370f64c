"""Bad input against every command: each case must give an answer or one line on stderr with exit
code 2 — never a traceback, never a hang.

    python bench/badinput.py            # every case, one line each, then the outcome counts
    python bench/badinput.py --only check

Cases run as real processes (``python -m trainguard ...``) on real files made in a temporary
directory: garbage and directory event databases, read-only run dirs, crafted logs, out-of-range
ports and numbers; every reader of a run dir against every run-dir file damaged, missing, a
FIFO, a symlink or a directory, the dashboard served and fetched; ``trace -o`` and
``profile`` targets that must be left as they were (an after-check says so). ``run`` cases stop
before any worker starts (their flags are refused). tests/test_badinput.py runs the same table.

    python bench/badinput.py --jobs 3 --match "hot journal"

Outcomes: ``answer`` (exit 0 or 1, no traceback), ``usage`` (exit 2, one line on stderr), ``traceback``
(a Python traceback anywhere in the output), ``hang`` (still running after the time limit), and
``other`` (anything else: exit 2 with several lines, a signal).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "train_mlp.py"
TIME_LIMIT_S = 60.0
OUTCOMES = ("answer", "usage", "traceback", "hang", "other")


@dataclass(frozen=True)
class Case:
    name: str
    argv: tuple[str, ...]  # "{d}" is the case's temporary directory
    setup: Callable[[Path], None] | None = None
    expect: str = "usage"  # what a right answer is: "usage", "answer", or "answer|usage" (either)
    env: dict[str, str] = field(default_factory=dict)
    # after the command: None when what it must leave alone is as it was, else what is wrong
    after: Callable[[Path], str | None] | None = None
    serve: tuple[str, ...] = ()  # a dashboard case: these paths are fetched, then the server is stopped
    says: str = ""  # text the output must hold (a diagnose case's verdict or note)
    beside: str = ""  # a process run beside the case (see SLEEPER)


def _garbage_db(d: Path) -> None:
    (d / "events.db").write_bytes(b"this is not an SQLite database\n" * 10)


def _dir_db(d: Path) -> None:
    (d / "events.db").mkdir()


def _empty_dir(d: Path) -> None:
    (d / "run").mkdir()


def _a_file(d: Path) -> None:
    (d / "afile").write_text("x\n")


def _run_dir(d: Path) -> None:
    from trainguard.events import EventBus, EventStore
    from trainguard.events.store import node_db_path

    store = EventStore(node_db_path(d / "run", "n0"))
    EventBus(store, node="n0").emit("job_started", "go", evidence={"pids": {"0": 1}, "attempt": 0})
    store.close()


def _read_only_run_dir(d: Path) -> None:
    _run_dir(d)
    make_read_only(d / "run")


def make_read_only(path: Path) -> None:
    """A directory nobody may write, root included (chattr +i); chmod where not root."""
    if os.geteuid() == 0:
        subprocess.run(["chattr", "+i", str(path)], check=True, capture_output=True)
    else:
        path.chmod(0o555)


def undo_read_only(path: Path) -> None:
    if os.geteuid() == 0:
        subprocess.run(["chattr", "-i", str(path)], capture_output=True)
    else:
        path.chmod(0o755)


def _log(text: str) -> Callable[[Path], None]:
    def write(d: Path) -> None:
        (d / "train.log").write_text(text)

    return write


def _deep_tree(d: Path, levels: int = 2000) -> None:
    """``deep/d/d/.../d/train.log``: made level by level with relative paths (the whole path is
    near PATH_MAX)."""
    fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for name in ["deep"] + ["d"] * levels:
            os.mkdir(name, dir_fd=fd)
            nxt = os.open(name, os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
            os.close(fd)
            fd = nxt
        with open(os.open("train.log", os.O_WRONLY | os.O_CREAT, 0o600, dir_fd=fd), "w") as f:
            f.write("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB\n")
    finally:
        os.close(fd)


def _binary_log(d: Path) -> None:
    (d / "train.log").write_bytes(bytes(range(256)) * 64)


# ---- helpers of the "run flags, environment and run-dir commands" block ------------------------
RUN_ANY_NPROC = ("run", "--standalone", "--run-dir", "{d}/r", "--precheck", "off")
RUN = (*RUN_ANY_NPROC, "--nproc-per-node", "1")
SCRIPT = (str(EXAMPLE), "--steps", "2")  # a job a case lets start ends at once


def _later_events(d: Path) -> None:
    _events(d)  # defined below, with the run-dir damage


def _events_naming_beside(d: Path) -> None:
    """A run whose rank 0 had the pid the process beside the case has now (a pid reused)."""
    _events(d, {"pids": {"0": int((d / "beside.pid").read_text())}, "attempt": 0})


def _beside_alive(d: Path) -> str | None:
    pid = (d / "beside.pid").read_text()
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        state = "gone"
    return None if state not in ("Z", "X", "gone") else f"the unrelated process {pid} was killed"


# Processes beside a case (``Case.beside``, python -c code run with the case's directory as its
# argument): each holds what another program holds in real use, prints "ready [value]" ("{port}"
# in the case's argv is the value), and is killed once the case is done.
SLEEPER = ("import os, sys, time\nopen(sys.argv[1] + '/beside.pid', 'w').write(str(os.getpid()))\n"
           "print('ready', flush=True)\ntime.sleep(600)\n")
HOLD_LOCK = ("import fcntl, os, sys, time\nos.mkdir(sys.argv[1] + '/r', 0o700)\n"
             "fd = os.open(sys.argv[1] + '/r/agent-n0.lock', os.O_RDWR | os.O_CREAT, 0o600)\n"
             "fcntl.flock(fd, fcntl.LOCK_EX)\nprint('ready', flush=True)\ntime.sleep(600)\n")
HOLD_DB = ("import sqlite3, sys, time\nfrom pathlib import Path\nfrom trainguard.events import EventBus, EventStore\n"
           "from trainguard.events.store import node_db_path\ndb = node_db_path(Path(sys.argv[1]) / 'run', 'n0')\n"
           "s = EventStore(db)\nEventBus(s, node='n0').emit('job_started', 'go', evidence={'attempt': 0})\n"
           "s.close()\nc = sqlite3.connect(db, isolation_level=None)\nc.execute('BEGIN EXCLUSIVE')\n"
           "print('ready', flush=True)\ntime.sleep(600)\n")
LISTEN = ("import socket, time\ns = socket.socket()\ns.bind(('127.0.0.1', 0))\ns.listen()\n"
          "print('ready', s.getsockname()[1], flush=True)\ntime.sleep(600)\n")


CASES: list[Case] = [
    # events
    Case("events: garbage events.db", ("events", "{d}/events.db"), _garbage_db),
    Case("events: run dir with a garbage events.db", ("events", "{d}"), _garbage_db),
    Case("events: events.db is a directory", ("events", "{d}/events.db"), _dir_db),
    Case("events: unknown severity", ("events", "{d}/run", "--severity", "bogus"), _run_dir),
    Case("events: missing run dir", ("events", "{d}/nope")),
    Case("events: a plain file", ("events", "{d}/afile"), _a_file),
    Case("events: empty dir", ("events", "{d}/run"), _empty_dir),
    Case("events: --interval 0", ("events", "{d}/run", "--interval", "0"), _run_dir),
    Case("events: good run dir", ("events", "{d}/run"), _run_dir, expect="answer"),
    # check
    Case("check: --master-port 70000", ("check", "--master-port", "70000")),
    Case("check: --master-port -1", ("check", "--master-port", "-1")),
    Case("check: --check-disk-shm-gb nan", ("check", "--check-disk-shm-gb", "nan")),
    Case("check: --check-disk-root-gb inf", ("check", "--check-disk-root-gb", "inf")),
    Case("check: --check-disk-root-gb -5", ("check", "--check-disk-root-gb", "-5")),
    Case("check: a file as --shm-dir", ("check", "--shm-dir", "{d}/afile"), _a_file),
    Case("check: a file as --root-dir", ("check", "--root-dir", "{d}/afile"), _a_file),
    Case("check: --nproc-per-node 0", ("check", "--nproc-per-node", "0")),
    Case("check: --dns-timeout 0", ("check", "--dns-timeout", "0")),
    Case("check: --ulimit-nofile abc", ("check", "--ulimit-nofile", "abc")),
    # nodecheck
    Case("nodecheck: --master-port 70000", ("nodecheck", "--master-port", "70000")),
    Case("nodecheck: --nnodes 0", ("nodecheck", "--nnodes", "0")),
    Case("nodecheck: --node-rank -1", ("nodecheck", "--node-rank", "-1")),
    Case("nodecheck: --timeout nan", ("nodecheck", "--local", "2", "--timeout", "nan")),
    Case("nodecheck: --iters 0", ("nodecheck", "--local", "2", "--iters", "0")),
    Case("nodecheck: --chaos on a node that is not there", ("nodecheck", "--local", "2", "--chaos", "5=fail")),
    # profile
    Case("profile: read-only run dir", ("profile", "{d}/run", "on"), _read_only_run_dir),
    Case("profile: missing run dir", ("profile", "{d}/nope", "on")),
    Case("profile: off --comm on", ("profile", "{d}/run", "off", "--comm", "on"), _run_dir),
    # slowdown
    Case("slowdown: '(ms): .'", ("slowdown", "{d}/train.log"),
         _log(" iteration 1/ 10 | elapsed time per iteration (ms): . |\n" * 30), expect="answer"),
    Case("slowdown: missing log", ("slowdown", "{d}/nope.log")),
    Case("slowdown: a directory", ("slowdown", "{d}")),
    Case("slowdown: binary log", ("slowdown", "{d}/train.log"), _binary_log, expect="answer"),
    Case("slowdown: --window 0", ("slowdown", "{d}/train.log", "--window", "0"), _log("x\n")),
    # diagnose
    Case("diagnose: missing path", ("diagnose", "{d}/nope.log")),
    Case("diagnose: truncated .gz", ("diagnose", "{d}/t.log.gz"),
         lambda d: (d / "t.log.gz").write_bytes(b"\x1f\x8b\x08\x00" + b"\0" * 20), expect="answer"),
    Case("diagnose: rules file missing", ("diagnose", "--rules", "{d}/nope.toml", "{d}/train.log"), _log("x\n")),
    Case("diagnose: binary log", ("diagnose", "{d}/train.log"), _binary_log, expect="answer"),
    # status / trace / stacks / dashboard
    Case("status: not a run dir", ("status", "--once", "{d}/run"), _empty_dir),
    Case("status: garbage events.db", ("status", "--once", "{d}"), _garbage_db),
    Case("trace: not a run dir", ("trace", "{d}/run", "-o", "-"), _empty_dir),
    Case("trace: read-only output", ("trace", "{d}/run", "-o", "{d}/run/t.json"), _read_only_run_dir),
    Case("stacks: not a run dir", ("stacks", "{d}/run"), _empty_dir),
    Case("stacks: --timeout -1", ("stacks", "{d}/run", "--timeout", "-1"), _run_dir),
    Case("dashboard: --port 70000", ("dashboard", "{d}/run", "--port", "70000"), _run_dir),
    Case("dashboard: not a run dir", ("dashboard", "{d}/run"), _empty_dir),
    # run (refused before any worker starts)
    Case("run: --nproc-per-node 0", ("run", "--standalone", "--run-dir", "{d}/r", "--nproc-per-node", "0", str(EXAMPLE))),
    Case("run: --monitor-interval 0", ("run", "--standalone", "--run-dir", "{d}/r", "--monitor-interval", "0", str(EXAMPLE))),
    Case("run: --notify-severity bogus", ("run", "--standalone", "--run-dir", "{d}/r", "--notify-severity", "bogus", str(EXAMPLE))),
    Case("run: --node-name a/b", ("run", "--standalone", "--run-dir", "{d}/r", "--node-name", "a/b", str(EXAMPLE))),
    Case("run: a file as --run-dir", ("run", "--standalone", "--run-dir", "{d}/afile", str(EXAMPLE)), _a_file),
    Case("run: TRAINGUARD_HANG_DETECT_TIME=abc", ("run", "--standalone", "--run-dir", "{d}/r", str(EXAMPLE)),
         env={"TRAINGUARD_HANG_DETECT_TIME": "abc"}),
    Case("run: missing --diagnose-rules", ("run", "--standalone", "--run-dir", "{d}/r", "--diagnose-rules",
                                           "{d}/nope.toml", str(EXAMPLE))),
    Case("run: missing script", ("run", "--standalone", "--run-dir", "{d}/r", "--nproc-per-node", "1",
                                 "--precheck", "off", "{d}/nope.py")),
    # run flags, environment and run-dir commands: more bad input
    *(Case(f"run: {flag} {value}", (*RUN, flag, value, *SCRIPT), expect=expect) for flag, value, expect in (
        ("--nproc-per-node", "99999999999999999999", "usage"), ("--nnodes", "1:99999999999999999999", "usage"),
        ("--nnodes", "3:1", "usage"), ("--rdzv-conf", "join_timeout=abc", "usage"),
        ("--rdzv-conf", "read_timeout=99999999999999999999", "usage"), ("--rdzv-conf", "a=1,,b=2", "usage"),
        ("--monitor-interval", "1e308", "usage"), ("--node-name", "a\nb", "usage"), ("--node-name", "\udcff", "usage"),
        ("--run-dir", "", "usage"), ("-m", "", "usage"), ("-m", "no such module", "usage"),
        # torchrun takes these as they are, and so does trainguard: the job runs
        ("--max-restarts", "99999999999999999999", "answer"), ("--hang-detect-time", "1e308", "answer"),
        ("--rdzv-id", "\x01\x1b[31m", "answer"))),
    Case("run: --master-port 99999999999", ("run", "--run-dir", "{d}/r", "--nnodes", "1", "--master-port",
                                            "99999999999", "--precheck", "off", *SCRIPT)),
    Case("run: the script is a directory", (*RUN, "{d}/pkg"), lambda d: (d / "pkg").mkdir()),
    Case("run: the script is a FIFO", (*RUN, "{d}/fifo.py"), lambda d: _fifo(d, "fifo.py"),
         after=lambda d: _kept("fifo.py", "fifo")(d)),
    Case("run: --no-python with a directory", (*RUN, "--no-python", "{d}/pkg"), lambda d: (d / "pkg").mkdir()),
    Case("run: --run-dir is a FIFO", ("run", "--standalone", "--run-dir", "{d}/fifo", "--precheck", "off", *SCRIPT),
         lambda d: _fifo(d, "fifo"), after=lambda d: _kept("fifo", "fifo")(d)),
    Case("run: --run-dir is a dangling link", ("run", "--standalone", "--run-dir", "{d}/link", "--precheck", "off",
                                               *SCRIPT), lambda d: (d / "link").symlink_to(d / "nowhere"),
         after=lambda d: "the link's target was created" if (d / "nowhere").exists() else None),
    *(Case(f"run: {name}={value!r}", (*RUN_ANY_NPROC, *SCRIPT), env={name: value}, expect=expect)
      for name, value, expect in (
        ("TRAINGUARD_HANG_DETECT_TIME", "nan", "usage"), ("TRAINGUARD_HANG_DETECT_TIME", "-1", "usage"),
        ("MA_HANG_DETECT_TIME", "abc", "usage"), ("MA_HANG_DETECT_TIME", "0", "usage"),
        ("TRAINGUARD_HANG_ACTION", "bogus", "usage"), ("TRAINGUARD_NOTIFY", "notaurl", "usage"),
        ("PET_NPROC_PER_NODE", "abc", "usage"), ("PET_NPROC_PER_NODE", "0", "usage"),
        ("PET_NPROC_PER_NODE", "99999999999999999999", "usage"), ("PET_MAX_RESTARTS", "abc", "usage"),
        ("PET_NNODES", "3:1", "usage"), ("PET_MONITOR_INTERVAL", "nan", "usage"), ("PET_NO_PYTHON", "maybe", "usage"),
        ("PET_STANDALONE", "yes", "usage"), ("PET_MASTER_PORT", "-1", "usage"), ("PET_RDZV_CONF", "timeout=soon", "usage"),
        # an empty variable is an unset one; a huge detect time is a long one
        ("TRAINGUARD_HANG_DETECT_TIME", "", "answer"), ("TRAINGUARD_HANG_DETECT_TIME", "1e308", "answer"))),
    *(Case(f"run: SLURM_JOB_ID=5 {name}={value!r}", ("run", "--run-dir", "{d}/r", "--nproc-per-node", "1",
                                                    "--precheck", "off", *SCRIPT), env={"SLURM_JOB_ID": "5", name: value})
      for name, value in (("SLURM_JOB_NODELIST", "n[1-99999999]"), ("SLURM_JOB_NODELIST", "n[9-1]"),
                          ("SLURM_JOB_NUM_NODES", "99999999999999999999"), ("SLURM_JOB_NODELIST", "\x01,\x02"),
                          ("SLURM_JOB_NODELIST", "n1;rm,n2"))),
    Case("run: SLURM_JOB_ID=5 SLURM_RESTART_COUNT=99999999999999999999", ("run", "--run-dir", "{d}/r", "--nproc-per-node",
         "1", "--precheck", "off", *SCRIPT), env={"SLURM_JOB_ID": "5", "SLURM_RESTART_COUNT": "9" * 20}, expect="answer"),
    Case("run: the run dir is held by another job", (*RUN, "--node-name", "n0", *SCRIPT), beside=HOLD_LOCK),
    *(Case(f"{argv[0]}: the run dir is a FIFO", argv, lambda d: _fifo(d, "run")) for argv in (
        ("events", "{d}/run"), ("status", "--once", "{d}/run"), ("trace", "{d}/run", "-o", "-"),
        ("stacks", "{d}/run"), ("profile", "{d}/run", "on"), ("chaos", "{d}/run", "kill", "--rank", "0"))),
    Case("events: --kind of 100,000 characters", ("events", "{d}/run", "--kind", "k" * 100_000), _later_events, expect="answer"),
    Case("status: --node-history-faults 0", ("status", "--once", "{d}/run", "--node-history-faults", "0"), _later_events,
         expect="answer"),
    Case("status: --node-history-window nan", ("status", "--once", "{d}/run", "--node-history-window", "nan"), _later_events),
    Case("status: --node-history is a directory", ("status", "--once", "{d}/run", "--node-history", "{d}"), _later_events,
         expect="answer"),  # the view, with a line saying it goes on without node history
    Case("stacks: --node-name a/b", ("stacks", "{d}/run", "--node-name", "a/b"), _later_events),
    Case("profile: state bogus", ("profile", "{d}/run", "bogus"), _later_events),
    *(Case(f"chaos: {' '.join(extra)}", ("chaos", "{d}/run", *extra), _later_events) for extra in (
        ("kill", "--rank", "99999999999999999999"), ("kill", "--rank", "-1"), ("kill", "--node", ""),
        ("net-delay", "--rank", "0", "--delay-ms", "nan"), ("net-loss", "--rank", "0", "--loss", "1000"),
        ("net-slow", "--rank", "0", "--rate-kbit", "0"), ("hang", "--rank", "0", "--duration", "99999999999999999999"))),
    Case("chaos: kill a rank whose pid is now another process", ("chaos", "{d}/run", "kill", "--rank", "0"),
         _events_naming_beside, expect="answer|usage", beside=SLEEPER, after=_beside_alive),
    Case("stacks: a rank whose pid is now another process", ("stacks", "{d}/run", "--timeout", "1"),
         _events_naming_beside, expect="answer|usage", beside=SLEEPER, after=_beside_alive),
    Case("status: the event database locked by a writer", ("status", "--once", "{d}/run"), expect="answer|usage",
         beside=HOLD_DB),
    Case("dashboard: --port taken by another server", ("dashboard", "{d}/run", "--port", "{port}"), _later_events,
         beside=LISTEN),
    Case("dashboard: --token with a line break", ("dashboard", "{d}/run", "--port", "0", "--token", "a" * 20 + "\nb"),
         _later_events),
    Case("dashboard: --allow-host ''", ("dashboard", "{d}/run", "--port", "0", "--allow-host", ""), _later_events),
    # no command / unknown command
    Case("unknown command", ("frobnicate",)),
]


# ---- run-dir files: every reader against every way a file can be damaged ------------------------
VICTIM = "victim.txt"  # a file outside the run dir that links point to: it must never change
VICTIM_TEXT = "another application's file\n"


def _dead_pid() -> int:
    """A pid nobody has now: a job's workers that are gone (no command may act on an unrelated one)."""
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def _events(d: Path, evidence: dict | None = None, rows: list[tuple] = ()) -> Path:
    from trainguard.events import EventBus, EventStore
    from trainguard.events.store import node_db_path

    db = node_db_path(d / "run", "n0")
    store = EventStore(db)
    bus = EventBus(store, node="n0")
    bus.emit("job_started", "go", evidence=evidence or {"pids": {"0": _dead_pid()}, "attempt": 0, "max_restarts": 3})
    bus.emit("restart", "again", evidence={"max_restarts": 3})
    if rows:
        store._conn.executemany("INSERT INTO events(time, kind, severity, node, rank, message, evidence) "
                                "VALUES (?,?,?,?,?,?,?)", rows)
    store.close()
    return db


def _victim(d: Path) -> Path:
    v = d / VICTIM
    v.write_text(VICTIM_TEXT)
    return v


def _victim_unchanged(d: Path) -> str | None:
    v = d / VICTIM
    if not v.is_file() or v.read_text() != VICTIM_TEXT:
        return f"{v} was changed through a link"
    return None


def _records(d: Path, rank: int = 0) -> Path:
    prof = d / "run" / "profiling" / str(rank)
    prof.mkdir(parents=True, exist_ok=True)
    return prof


def _span(rank: object = 0, start: object = 1_800_000_001 * 10**9, end: object = 1_800_000_001 * 10**9 + 5 * 10**8) -> str:
    import json

    return json.dumps({"rank": rank, "kind": "Step", "step": 1, "start_ns": start, "end_ns": end}) + "\n"


def _hot_journal(d: Path) -> None:
    """The event writer SIGKILLed in the middle of a transaction: a hot journal beside the database."""
    _events(d)
    code = ("import sys, time\nfrom trainguard.events import EventStore\nfrom trainguard.events.store import node_db_path\n"
            "s = EventStore(node_db_path(sys.argv[1], 'n0'))\ns._conn.execute('BEGIN IMMEDIATE')\n"
            "for i in range(20000):\n    s._conn.execute(\"INSERT INTO events(time, kind, severity, node, rank, message, "
            "evidence) VALUES (1, 'torn', 'info', 'n0', 0, ?, '{}')\", ('x' * 500,))\nprint('ready', flush=True)\n"
            "time.sleep(600)\n")
    w = subprocess.Popen([sys.executable, "-c", code, str(d / "run")], stdout=subprocess.PIPE, text=True)
    w.stdout.readline()
    w.kill()
    w.wait()
    w.stdout.close()


def _sqlite(d: Path, sql: str) -> None:
    import sqlite3

    db = d / "run" / "events" / "n0.db"
    db.parent.mkdir(parents=True, exist_ok=True)
    conn = sqlite3.connect(db)
    conn.executescript(sql)
    conn.commit()
    conn.close()


def _then(*steps: Callable[[Path], object]) -> Callable[[Path], None]:
    def setup(d: Path) -> None:
        for step in steps:
            step(d)

    return setup


def _db(d: Path) -> Path:
    return d / "run" / "events" / "n0.db"


# name -> setup: a run dir ("{d}/run") with one file damaged, missing, or not a file
DAMAGE: dict[str, Callable[[Path], None]] = {
    "a good run dir": _events,
    "events/ is a file": lambda d: ((d / "run").mkdir(), (d / "run" / "events").write_text("x")),
    "events/n0.db is a directory": lambda d: _db(d).mkdir(parents=True),
    "events/n0.db is a FIFO": lambda d: (_db(d).parent.mkdir(parents=True), os.mkfifo(_db(d))),
    "events/n0.db links to another file": lambda d: (_db(d).parent.mkdir(parents=True), _db(d).symlink_to(_victim(d))),
    "events/n0.db is a dangling link": lambda d: (_db(d).parent.mkdir(parents=True), _db(d).symlink_to(d / "nowhere.db")),
    "events/n0.db is empty": lambda d: (_db(d).parent.mkdir(parents=True), _db(d).write_bytes(b"")),
    "events/n0.db is garbage": lambda d: (_db(d).parent.mkdir(parents=True), _db(d).write_bytes(os.urandom(8192))),
    "events/n0.db cut in half": lambda d: (_events(d), _db(d).write_bytes(_db(d).read_bytes()[:4096])),
    "events/n0.db has a hot journal": _hot_journal,
    "events/n0.db has no events table": lambda d: _sqlite(d, "CREATE TABLE other (x);"),
    "events table misses columns": lambda d: _sqlite(d, "CREATE TABLE events (id INTEGER PRIMARY KEY, kind TEXT);"
                                                        "INSERT INTO events(kind) VALUES ('job_started');"),
    "text in the time column": lambda d: _events(d, rows=[("noon", "job_started", "info", "n0", "r0", "m", "{}")]),
    "out-of-range times and ranks": lambda d: _events(d, rows=[(1e300, "restart", "info", "n0", 10**15, "m", "{}"),
                                                              (-1e300, "job_started", "info", "n0", -5, "m", "{}")]),
    "wrong column types": lambda d: _events(d, rows=[(1.5, 5, 7, 8, "x", b"\x00\xff", "not json")]),
    "wrong-typed event details": lambda d: _events(d, {"pids": {"0": "abc", "x": 5}, "attempt": "zero",
                                                      "max_restarts": [1]}),
    "details not an object": lambda d: _events(d, rows=[(1.0, "job_started", "info", "n0", None, "m", "[1, 2]"),
                                                       (2.0, "node_held", "info", "n0", None, "m", '{"until": "x"}')]),
    "pids a list": lambda d: _events(d, {"pids": [1, 2], "attempt": 0}),
    "deeply nested details": lambda d: _events(d, rows=[(1.0, "diagnosis", "info", "n0", 0, "m", "[" * 100000)]),
    "old run-wide events.db is garbage": lambda d: ((d / "run").mkdir(), (d / "run" / "events.db").write_bytes(b"junk" * 100)),
    "profiling/ is a file": lambda d: (_events(d), (d / "run" / "profiling").write_text("x")),
    "profiling/0 is a file": lambda d: (_events(d), (d / "run" / "profiling").mkdir(),
                                        (d / "run" / "profiling" / "0").write_text("x")),
    "a record file is a directory": lambda d: (_events(d), (_records(d) / "1000").mkdir()),
    "a record file is a FIFO": lambda d: (_events(d), os.mkfifo(_records(d) / "1000")),
    "a record file links outside": lambda d: (_events(d), (_records(d) / "1000").symlink_to(_victim(d))),
    "a record file is binary": lambda d: (_events(d), (_records(d) / "1000").write_bytes(os.urandom(65536))),
    "records with out-of-range numbers": lambda d: (_events(d), (_records(d) / "1000").write_text(
        _span(rank=10**20) + _span(start=10**40, end=10**41) + _span(start="x") + _span(rank=-1) + "[1]\n{}\n")),
    "records of a rank never started": lambda d: (_events(d), (_records(d, 7) / "1000").write_text(_span(rank=7) * 3)),
    "profiling-switch.json is a directory": lambda d: (_events(d), (d / "run" / "profiling-switch.json").mkdir()),
    "profiling-switch.json is a FIFO": lambda d: (_events(d), os.mkfifo(d / "run" / "profiling-switch.json")),
    "profiling-switch.json links outside": lambda d: (_events(d), (d / "run" / "profiling-switch.json").symlink_to(_victim(d))),
    "profiling-switch.json is a JSON list": lambda d: (_events(d), (d / "run" / "profiling-switch.json").write_text("[1]")),
    "a hang report is a directory": lambda d: (_events(d), (d / "run" / "hang-1.txt").mkdir()),
    "a hang report is a FIFO": lambda d: (_events(d), os.mkfifo(d / "run" / "hang-1.txt")),
    "a hang report links outside": lambda d: (_events(d), (d / "run" / "hang-1.txt").symlink_to(_victim(d))),
    "a hang report is a dangling link": lambda d: (_events(d), (d / "run" / "hang-1.txt").symlink_to(d / "gone")),
    "stacks/ is a file": lambda d: (_events(d), (d / "run" / "stacks").write_text("x")),
    "chaos/ is a file": lambda d: (_events(d), (d / "run" / "chaos").write_text("x")),
    "the run dir is a link to a run dir": lambda d: (_events(d), (d / "real").mkdir(), (d / "run").rename(d / "real" / "run"),
                                                      (d / "run").symlink_to(d / "real" / "run")),
}

# the readers of a run dir (the dashboard is served and fetched: see _serve)
READERS: dict[str, tuple[str, ...]] = {
    "events": ("events", "{d}/run"),
    "status": ("status", "--once", "{d}/run"),
    "status --json": ("status", "--json", "{d}/run"),
    "trace": ("trace", "{d}/run", "-o", "{d}/trace.json"),
    "stacks": ("stacks", "{d}/run", "--timeout", "1"),
    "chaos": ("chaos", "{d}/run", "kill", "--rank", "0"),
    "profile": ("profile", "{d}/run"),
    "dashboard": ("dashboard", "{d}/run", "--port", "0"),
    "logs": ("logs", "{d}/run"),
}
DASHBOARD_FETCH = ("", "static/app.js", "api/state", "api/state?after=1", "api/hang?name=hang-1.txt",
                   "api/hang?name=../victim.txt", "api/nothing")


def _damage_cases() -> list[Case]:
    out = []
    for damage, setup in DAMAGE.items():
        for reader, argv in READERS.items():
            after = _victim_unchanged if "outside" in damage or "another file" in damage else None
            out.append(Case(f"{reader}: {damage}", argv, setup, expect="answer|usage", after=after,
                            serve=DASHBOARD_FETCH if reader == "dashboard" else ()))
    return out


def _fifo(d: Path, name: str) -> None:
    os.mkfifo(d / name)


def _device(d: Path) -> None:
    import stat

    if os.geteuid() == 0:
        os.mknod(d / "dev", stat.S_IFCHR | 0o666, os.makedev(1, 3))
    else:  # not root: a FIFO stands in for the device
        os.mkfifo(d / "dev")


def _kept(path: str, kind: str) -> Callable[[Path], str | None]:
    """The thing at ``path`` (relative to the case dir) is still a ``kind`` afterwards."""
    import stat

    tests = {"link": stat.S_ISLNK, "fifo": stat.S_ISFIFO, "device": lambda m: stat.S_ISCHR(m) or stat.S_ISFIFO(m),
             "file": stat.S_ISREG, "dir": stat.S_ISDIR}

    def check(d: Path) -> str | None:
        try:
            mode = os.lstat(d / path).st_mode
        except OSError:
            return f"{path} is gone"
        if not tests[kind](mode):
            return f"{path} was replaced"
        return _victim_unchanged(d) if (d / VICTIM).exists() else None

    return check


def _db_intact(d: Path) -> str | None:
    import sqlite3

    try:
        rows = sqlite3.connect(f"file:{_db(d)}?mode=ro", uri=True).execute("SELECT count(*) FROM events").fetchone()
    except sqlite3.Error as exc:
        return f"the event database was clobbered: {exc}"
    return None if rows[0] == 2 else f"the event database has {rows[0]} events, not 2"


TRACE_TARGETS: list[Case] = [
    Case("trace -o: a link to another file", ("trace", "{d}/run", "-o", "{d}/link.json"),
         _then(_events, lambda d: (d / "link.json").symlink_to(_victim(d))), after=_kept("link.json", "link")),
    Case("trace -o: a dangling link", ("trace", "{d}/run", "-o", "{d}/link.json"),
         _then(_events, lambda d: (d / "link.json").symlink_to(d / "nowhere" / "x")), after=_kept("link.json", "link")),
    Case("trace -o: a FIFO", ("trace", "{d}/run", "-o", "{d}/fifo"), _then(_events, lambda d: _fifo(d, "fifo")),
         after=_kept("fifo", "fifo")),
    Case("trace -o: a device", ("trace", "{d}/run", "-o", "{d}/dev"), _then(_events, _device), after=_kept("dev", "device")),
    Case("trace -o: the run's event database", ("trace", "{d}/run", "-o", "{d}/run/events/n0.db"), _events,
         after=_db_intact),
    Case("trace -o: the event database's journal", ("trace", "{d}/run", "-o", "{d}/run/events/n0.db-journal"),
         _then(_events, lambda d: _db(d).with_name("n0.db-journal").write_bytes(b"")), after=_kept("run/events/n0.db-journal", "file")),
    Case("trace -o: a directory", ("trace", "{d}/run", "-o", "{d}/run"), _events, after=_kept("run", "dir")),
    Case("trace -o: in a missing directory", ("trace", "{d}/run", "-o", "{d}/nope/t.json"), _events),
    Case("trace -o: in a read-only directory", ("trace", "{d}/run", "-o", "{d}/ro/t.json"),
         _then(_events, lambda d: (d / "ro").mkdir(), lambda d: make_read_only(d / "ro"))),
    Case("trace -o: an empty name", ("trace", "{d}/run", "-o", ""), _events),
    Case("trace -o: a regular file is replaced", ("trace", "{d}/run", "-o", "{d}/t.json"),
         _then(_events, lambda d: (d / "t.json").write_text("old")), expect="answer", after=_kept("t.json", "file")),
    Case("trace -o -: stdout", ("trace", "{d}/run", "-o", "-"), _events, expect="answer"),
    Case("trace --kind bogus", ("trace", "{d}/run", "-o", "-", "--kind", "bogus"), _events, expect="answer"),
    Case("profile on: the switch links to another file", ("profile", "{d}/run", "on"),
         _then(_events, lambda d: (d / "run" / "profiling-switch.json").symlink_to(_victim(d))),
         after=_kept("run/profiling-switch.json", "link")),
    Case("profile on: the switch is a FIFO", ("profile", "{d}/run", "on"),
         _then(_events, lambda d: _fifo(d / "run", "profiling-switch.json")), after=_kept("run/profiling-switch.json", "fifo")),
    Case("profile on: not a run dir", ("profile", "{d}", "on"),
         after=lambda d: "a switch file was written" if (d / "profiling-switch.json").exists() else None),
    Case("profile on: a good run dir", ("profile", "{d}/run", "on"), _events, expect="answer"),
]


def _flag_cases() -> list[Case]:
    """Numbers and names at every command's parser: NaN, infinities, out of range, not numbers."""
    run = ("run", "--standalone", "--run-dir", "{d}/r", "--nproc-per-node", "1", "--precheck", "off")
    table: list[tuple[tuple[str, ...], Callable[[Path], None] | None, str, tuple[str, ...]]] = [
        (("diagnose", "{d}/train.log", "--threshold"), _log("x\n"), "", ("nan", "inf", "-1", "0", "abc")),
        (("diagnose", "{d}/train.log", "--max-mb"), _log("x\n"), "", ("nan", "inf", "-inf", "0", "abc")),
        (("diagnose", "{d}/train.log", "--window"), _log("x\n"), "", ("0", "-3", "1.5", "nan")),
        (("slowdown", "{d}/train.log", "--threshold"), _log("x\n"), "", ("nan", "inf", "-1", "0")),
        (("slowdown", "{d}/train.log", "--rank"), _log("x\n"), "", ("-1", "abc")),
        (("chaos", "{d}/run", "fill-disk", "--rank", "0", "--path", "{d}", "--leave-mb"), _events, "", ("nan", "inf", "-1")),
        (("chaos", "{d}/run", "fill-disk", "--rank", "0", "--path", "{d}", "--size-mb"), _events, "", ("nan", "0", "inf")),
        (("chaos", "{d}/run", "slow", "--rank", "0", "--duration"), _events, "", ("nan", "inf", "1e308", "0")),
        (("chaos", "{d}/run", "slow", "--rank", "0", "--percent"), _events, "", ("nan", "-5")),
        (("chaos", "{d}/run", "kill", "--rank"), _events, "", ("abc", "1.5")),
        (("nodecheck", "--local", "2", "--timeout"), None, "", ("1e308", "inf", "0", "-1")),
        (("nodecheck", "--local", "2", "--coll-mb"), None, "", ("nan", "0")),
        (("stacks", "{d}/run", "--timeout"), _events, "", ("nan", "inf", "1e308", "0")),
        (("status", "--once", "{d}/run", "--interval"), _events, "", ("nan", "inf", "1e308", "0")),
        (("events", "{d}/run", "--interval"), _events, "", ("1e308", "nan")),
        (("dashboard", "{d}/run", "--port"), _events, "", ("-1", "abc", "65536", "1e3")),
        (("check", "--dns-timeout"), None, "", ("nan", "1e308", "inf")),
        (("check", "--check-disk-cache-gb"), None, "", ("nan", "-1")),
        (("check", "--ulimit-nproc"), None, "", ("-1", "1e3")),
        ((*run, "--monitor-interval"), None, "", ("nan", "inf")),
        ((*run, "--worker-stop-timeout"), None, "", ("-1", "nan", "1e308")),
        ((*run, "--slowdown-threshold"), None, "", ("nan",)),
        ((*run, "--diagnose-max-mb"), None, "", ("inf",)),
        ((*run, "--heartbeat-interval"), None, "", ("1e308",)),
    ]
    out = []
    for argv, setup, _, values in table:
        for v in values:
            out.append(Case(f"{argv[0]}: {argv[-1]} {v}", (*argv, v, *((str(EXAMPLE),) if argv[0] == "run" else ())),
                            setup))
    return out


OTHER_CASES: list[Case] = [
    Case("dashboard: --host 0.0.0.0 --token ''", ("dashboard", "{d}/run", "--host", "0.0.0.0", "--port", "0", "--token", ""), _events),
    Case("dashboard: --host 0.0.0.0 --token short", ("dashboard", "{d}/run", "--host", "0.0.0.0", "--port", "0", "--token", "abc"), _events),
    Case("dashboard: --host not an address", ("dashboard", "{d}/run", "--host", "no.such.host.invalid", "--port", "0"), _events),
    Case("check: --skip bogus", ("check", "--skip", "bogus")),
    Case("check: --rdzv-endpoint localhost:notaport", ("check", "--rdzv-endpoint", "localhost:notaport")),
    Case("check: --rdzv-endpoint host:0", ("check", "--rdzv-endpoint", "host:0")),
    Case("check: a binary host file", ("check", "--hostfile", "{d}/bin.host", "--skip", "gpu-check"),
         lambda d: (d / "bin.host").write_bytes(b"node\x00\xff\xfe\x89PNG"), expect="answer"),
    Case("check: a FIFO host file", ("check", "--hostfile", "{d}/fifo.host", "--skip", "gpu-check"),
         lambda d: _fifo(d, "fifo.host"), expect="answer"),
    Case("nodecheck: unreachable store --timeout 5", ("nodecheck", "--node-rank", "1", "--nnodes", "2", "--master-addr",
                                                     "127.0.0.1", "--master-port", "9", "--timeout", "5"), expect="answer"),
    Case("diagnose: an empty directory", ("diagnose", "{d}/logs"), lambda d: (d / "logs").mkdir(), expect="answer"),
    Case("diagnose: --rules is a directory", ("diagnose", "--rules", "{d}", "{d}/train.log"), _log("x\n")),
    Case("diagnose: --rules is garbage", ("diagnose", "--rules", "{d}/r.toml", "{d}/train.log"),
         _then(_log("x\n"), lambda d: (d / "r.toml").write_bytes(b"\x00[[[")) ),
    Case("slowdown: 0 ms steps", ("slowdown", "{d}/train.log"),
         _log("".join(f"step={i} elapsed time per iteration (ms): 0.0\n" for i in range(1, 60))), expect="answer"),
    Case("run: --notify notaurl", (*("run", "--standalone", "--run-dir", "{d}/r", "--nproc-per-node", "1"), "--notify",
                                    "notaurl", str(EXAMPLE))),
    Case("run: events/<node>.db is a dangling link", ("run", "--standalone", "--run-dir", "{d}/r", "--node-name", "n0",
                                                      "--nproc-per-node", "1", "--precheck", "off", str(EXAMPLE)),
         lambda d: ((d / "r" / "events").mkdir(parents=True), (d / "r" / "events" / "n0.db").symlink_to(d / "outside.db")),
         after=lambda d: "the link's target was created" if (d / "outside.db").exists() else None),
    Case("profile: --comm without a state", ("profile", "{d}/run", "--comm", "on"), _events),
    Case("events: --severity bogus --follow", ("events", "{d}/run", "--severity", "bogus", "-f"), _events),
    Case("events: a .db file that links outside", ("events", "{d}/run/events/n0.db"),
         lambda d: (_db(d).parent.mkdir(parents=True), _db(d).symlink_to(_victim(d))), expect="answer|usage",
         after=_victim_unchanged),
    Case("run: SLURM_JOB_NODELIST='n[1-'", ("run", "--run-dir", "{d}/r", "--nproc-per-node", "1", str(EXAMPLE)),
         env={"SLURM_JOB_ID": "5", "SLURM_JOB_NODELIST": "n[1-"}),
    Case("diagnose: a directory tree 2,000 levels deep", ("diagnose", "{d}/deep"), _deep_tree, expect="answer"),
]

# diagnose: encodings, compression, limits
_DI_OOM = ("2026-11-21T09:30:01.000000 [rank1]:   File \"/workspace/train.py\", line 88, in <module>\n"
           "2026-11-21T09:30:02.000000 [rank1]: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB.\n")
_DI_NCCL = ("2026-11-20T10:10:15.200000 [rank1]: [rank1]:[E1120 10:10:15.200000 ProcessGroupNCCL.cpp:607] [Rank 1] "
            "Watchdog caught collective operation timeout: WorkNCCL(SeqNum=3011, OpType=ALLREDUCE, NumelIn=1, "
            "NumelOut=1, Timeout(ms)=600000) ran for 600021 milliseconds before timing out.\n")
_DI_FILLER = "".join(f"2026-11-21T09:{i // 600 % 60:02d}:{i % 60:02d}.000000 [rank0]: step={i} loss=2.1\n" for i in range(20000))
_DI_ZSTD = __import__("importlib.util").util.find_spec("zstandard") is not None


def _di_write(name: str, data: bytes | Callable[[], bytes]) -> Callable[[Path], None]:
    return lambda d: (d / name).write_bytes(data() if callable(data) else data)


def _di_comp(kind: str, text: str) -> Callable[[], bytes]:
    import bz2
    import gzip
    import lzma

    return lambda: {"gz": gzip.compress, "bz2": bz2.compress, "xz": lzma.compress}[kind](text.encode())


def _di_cut(kind: str) -> Callable[[], bytes]:
    whole = _di_comp(kind, _DI_OOM + _DI_FILLER)
    return lambda: whole()[: len(whole()) // 2]


def _di_zst(text: str) -> bytes:
    """One zstd frame with one raw block, made by hand (no zstandard module needed to write it)."""
    data = text.encode()
    return b"\x28\xb5\x2f\xfd\x60" + (len(data) - 256).to_bytes(2, "little") + ((len(data) << 3) | 1).to_bytes(3, "little") + data


def _di_cr_flood(d: Path) -> None:
    bar = "".join(f"\r 45%|####5     | {i}/1000 [00:{i % 60:02d}<01:10,  7.12it/s]" for i in range(1000)).encode()
    with open(d / "rank-1.log", "wb") as f:
        for _ in range((20 << 20) // len(bar)):
            f.write(bar)
        f.write(_DI_OOM.replace("\n", "\r").encode())


def _di_bomb(d: Path, size: int = 1 << 30) -> None:
    """The OOM, then ``size`` bytes of "a" on one line, gzipped: a block compressed after a full
    flush is the same bytes every time, so it is written again instead of compressing 1 GB."""
    import zlib

    block = b"a" * (16 << 20)
    c = zlib.compressobj(1, zlib.DEFLATED, 31)
    head = _DI_OOM.encode()
    first, piece, crc = c.compress(head) + c.flush(zlib.Z_FULL_FLUSH), c.compress(block) + c.flush(zlib.Z_FULL_FLUSH), zlib.crc32(head)
    with open(d / "rank-1.log.gz", "wb") as f:
        f.write(first)
        for _ in range(size // len(block)):
            f.write(piece)
            crc = zlib.crc32(block, crc)
        f.write(c.flush())
        f.seek(-8, 2)
        f.write(crc.to_bytes(4, "little") + ((len(head) + size) & 0xFFFFFFFF).to_bytes(4, "little"))


def _di_mixed(d: Path) -> None:
    import gzip

    (d / "logs").mkdir()
    (d / "logs" / "rank-0.log.gz").write_bytes(gzip.compress(_DI_FILLER.encode()))
    (d / "logs" / "rank-1.log").write_bytes(b"\xff\xfe" + _DI_OOM.encode("utf-16-le"))
    (d / "logs" / "core.log").write_bytes(bytes(range(256)) * 64)
    (d / "logs" / "old.log.zst").write_bytes(_di_zst(_DI_FILLER[:300]))


CASES += [
    Case("diagnose: UTF-16 LE log with a BOM", ("diagnose", "{d}/rank-1.log"),
         _di_write("rank-1.log", b"\xff\xfe" + _DI_OOM.encode("utf-16-le")), expect="answer", says="cuda_oom"),
    Case("diagnose: UTF-16 BE log without a BOM", ("diagnose", "{d}/rank-1.log"),
         _di_write("rank-1.log", _DI_OOM.encode("utf-16-be")), expect="answer", says="cuda_oom"),
    Case("diagnose: UTF-16 log cut mid-unit", ("diagnose", "{d}/rank-1.log"),
         _di_write("rank-1.log", _DI_OOM.encode("utf-16-le") + b"\x41"), expect="answer", says="cuda_oom"),
    Case("diagnose: UTF-32 BE log with a BOM", ("diagnose", "{d}/rank-1.log"),
         _di_write("rank-1.log", b"\x00\x00\xfe\xff" + _DI_NCCL.encode("utf-32-be")), expect="answer", says="nccl_timeout"),
    Case("diagnose: UTF-32 LE log without a BOM", ("diagnose", "{d}/rank-1.log"),
         _di_write("rank-1.log", _DI_OOM.encode("utf-32-le")), expect="answer", says="cuda_oom"),
    Case("diagnose: UTF-8 log with a BOM", ("diagnose", "{d}/rank-1.log"),
         _di_write("rank-1.log", b"\xef\xbb\xbf" + _DI_OOM.encode()), expect="answer", says="cuda_oom"),
    Case("diagnose: Latin-1 bytes in a log", ("diagnose", "{d}/rank-1.log"),
         _di_write("rank-1.log", ("d\xe9but\n" + _DI_OOM).encode("latin-1")), expect="answer", says="cuda_oom"),
    Case("diagnose: NUL hole before the log (copytruncate)", ("diagnose", "{d}/rank-1.log"),
         _di_write("rank-1.log", b"\x00" * (8 << 20) + _DI_OOM.encode()), expect="answer", says="cuda_oom"),
    Case("diagnose: a file of NUL bytes only", ("diagnose", "{d}/rank-1.log"),
         _di_write("rank-1.log", b"\x00" * (1 << 20)), expect="answer", says="scanned"),
    Case("diagnose: gzip named .log", ("diagnose", "{d}/rank-1.log"),
         _di_write("rank-1.log", _di_comp("gz", _DI_OOM)), expect="answer", says="cuda_oom"),
    Case("diagnose: a .gz that is plain text", ("diagnose", "{d}/rank-1.log.gz"),
         _di_write("rank-1.log.gz", _DI_OOM.encode()), expect="answer", says="read as plain text"),
    Case("diagnose: bzip2 log", ("diagnose", "{d}/rank-1.log.bz2"),
         _di_write("rank-1.log.bz2", _di_comp("bz2", _DI_OOM)), expect="answer", says="cuda_oom"),
    Case("diagnose: xz log", ("diagnose", "{d}/rank-1.log.xz"),
         _di_write("rank-1.log.xz", _di_comp("xz", _DI_NCCL)), expect="answer", says="nccl_timeout"),
    Case("diagnose: zstd log", ("diagnose", "{d}/rank-1.log.zst"), _di_write("rank-1.log.zst", _di_zst(_DI_OOM + _DI_FILLER[:200])),
         expect="answer", says="cuda_oom" if _DI_ZSTD else "pip install zstandard"),
    Case("diagnose: truncated xz", ("diagnose", "{d}/rank-1.log.xz"),
         _di_write("rank-1.log.xz", _di_cut("xz")), expect="answer", says="truncated xz"),
    Case("diagnose: truncated bzip2", ("diagnose", "{d}/rank-1.log.bz2"),
         _di_write("rank-1.log.bz2", _di_cut("bz2")), expect="answer", says="truncated bzip2"),
    Case("diagnose: gzip of several members", ("diagnose", "{d}/rank-1.log.gz"),
         _di_write("rank-1.log.gz", lambda: _di_comp("gz", _DI_FILLER)() + _di_comp("gz", _DI_OOM)()), expect="answer", says="cuda_oom"),
    Case("diagnose: gzip padded with NUL bytes", ("diagnose", "{d}/rank-1.log.gz"),
         _di_write("rank-1.log.gz", lambda: _di_comp("gz", _DI_OOM)() + b"\x00" * 4096), expect="answer", says="cuda_oom"),
    Case("diagnose: empty .gz", ("diagnose", "{d}/rank-1.log.gz"), _di_write("rank-1.log.gz", _di_comp("gz", "")),
         expect="answer", says="no_logs"),
    Case("diagnose: empty .xz", ("diagnose", "{d}/rank-1.log.xz"), _di_write("rank-1.log.xz", _di_comp("xz", "")),
         expect="answer", says="no_logs"),
    Case("diagnose: zero-byte .bz2", ("diagnose", "{d}/rank-1.log.bz2"), _di_write("rank-1.log.bz2", b""),
         expect="answer", says="no_logs"),
    Case("diagnose: xz with garbage after it", ("diagnose", "{d}/rank-1.log.xz"),
         _di_write("rank-1.log.xz", lambda: _di_comp("xz", _DI_OOM)() + b"garbage"), expect="answer", says="cuda_oom"),
    Case("diagnose: gzip holding UTF-16", ("diagnose", "{d}/rank-1.log.gz"),
         _di_write("rank-1.log.gz", lambda: __import__("gzip").compress(b"\xff\xfe" + _DI_NCCL.encode("utf-16-le"))),
         expect="answer", says="nccl_timeout"),
    Case("diagnose: gzip holding binary data", ("diagnose", "{d}/rank-1.log.gz"),
         _di_write("rank-1.log.gz", lambda: __import__("gzip").compress(bytes(range(256)) * 64)), expect="answer", says="binary data"),
    Case("diagnose: a zip archive named .log", ("diagnose", "{d}/rank-1.log"),
         _di_write("rank-1.log", b"PK\x03\x04" + b"\x00" * 60), expect="answer", says="zip archive"),
    Case("diagnose: lz4 data", ("diagnose", "{d}/rank-1.log"),
         _di_write("rank-1.log", b"\x04\x22\x4d\x18" + b"\x00" * 60), expect="answer", says="lz4"),
    Case("diagnose: 20 MB progress bar redrawn with CR only", ("diagnose", "{d}/rank-1.log"), _di_cr_flood,
         expect="answer", says="cuda_oom"),
    Case("diagnose: gzip bomb 1 GB on one line, --max-mb 4", ("diagnose", "--max-mb", "4", "{d}/rank-1.log.gz"), _di_bomb,
         expect="answer", says="stopped after"),
    Case("diagnose: a 30 MB line then the OOM", ("diagnose", "{d}/rank-1.log"),
         _di_write("rank-1.log", b"a" * (30 << 20) + b"\n" + _DI_OOM.encode()), expect="answer", says="cut to their first and last half"),
    Case("diagnose: a directory of mixed forms", ("diagnose", "{d}/logs"), _di_mixed, expect="answer", says="cuda_oom"),
]
# end of diagnose: encodings, compression, limits

CASES += TRACE_TARGETS + OTHER_CASES + _flag_cases() + _damage_cases()


@dataclass
class Result:
    case: Case
    outcome: str
    rc: int | None
    first_line: str

    problem: str | None = None  # what the case's after-check found

    @property
    def right(self) -> bool:
        return self.outcome in self.case.expect.split("|") and self.problem is None


def classify(rc: int | None, stdout: str, stderr: str) -> str:
    if rc is None:
        return "hang"
    if "Traceback (most recent call last)" in stdout + stderr:
        return "traceback"
    if rc == 2:
        return "usage" if len(stderr.strip().splitlines()) == 1 else "other"
    if rc in (0, 1):
        return "answer"
    return "other"


def run_case(case: Case, time_limit_s: float = TIME_LIMIT_S) -> Result:
    d = Path(tempfile.mkdtemp(prefix="tg-badinput-"))
    beside, value = _start_beside(case.beside, d, time_limit_s)
    try:
        if case.setup is not None:
            case.setup(d)
        argv = [a.replace("{d}", str(d)).replace("{port}", value) for a in case.argv]
        env = {k: v for k, v in os.environ.items() if not k.startswith(("TRAINGUARD_", "MA_HANG"))}
        env.update(case.env)
        proc = subprocess.Popen([sys.executable, "-m", "trainguard", *argv], cwd=d, env=env, text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
                                start_new_session=True)
        problem, first = _serve(proc, case.serve, time_limit_s) if case.serve else (None, "")
        try:
            out, err = proc.communicate(timeout=time_limit_s)
            rc: int | None = proc.returncode
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            out, err = proc.communicate()
            rc = None
        if problem is None and case.after is not None and rc is not None:
            problem = case.after(d)
        if problem is None and case.says and rc is not None and case.says not in out:
            problem = f"the output does not say {case.says!r}"
        lines = (err.strip() or (first + out).strip()).splitlines()
        return Result(case, classify(rc, first + out, err), rc, problem or (lines[-1] if lines else ""), problem)
    finally:
        if beside is not None:
            os.killpg(beside.pid, 9)
            beside.wait()
            beside.stdout.close()  # type: ignore[union-attr]
        for p in (d / "run", d / "ro", d):
            if p.exists():
                undo_read_only(p)
        _remove_tree(d)


def _start_beside(code: str, d: Path, time_limit_s: float) -> tuple[subprocess.Popen | None, str]:
    """The case's process beside it, once ready, and the value it printed ("" if none)."""
    import select

    if not code:
        return None, ""
    proc = subprocess.Popen([sys.executable, "-c", code, str(d)], cwd=d, text=True, stdout=subprocess.PIPE,
                            stdin=subprocess.DEVNULL, start_new_session=True)
    ready, _, _ = select.select([proc.stdout], [], [], time_limit_s)
    words = proc.stdout.readline().split() if ready else []  # type: ignore[union-attr]
    return proc, words[1] if len(words) > 1 else ""


def _remove_tree(d: Path) -> None:
    try:
        shutil.rmtree(d, ignore_errors=True)
    except RecursionError:  # shutil.rmtree recurses per level (the 2,000-level tree); rm does not
        subprocess.run(["rm", "-rf", "--", str(d)], check=False)


def _serve(proc: subprocess.Popen, paths: tuple[str, ...], time_limit_s: float) -> tuple[str | None, str]:
    """Fetch ``paths`` from a dashboard once it prints its URL, then stop it (SIGTERM). Returns what
    went wrong (None: every answer was 200 or 404) and the line read."""
    import select
    import urllib.error
    import urllib.request

    ready, _, _ = select.select([proc.stdout], [], [], time_limit_s)
    line = proc.stdout.readline() if ready else ""
    if " on http://" not in line:
        return None, line  # it stopped (a usage error) or never listened: the outcome tells
    url, _, query = line.split(" on ", 1)[1].split()[0].partition("?")
    headers = {"Authorization": f"Bearer {query.split('token=', 1)[1]}"} if "token=" in query else {}
    problem = None
    for path in paths:
        try:
            with urllib.request.urlopen(urllib.request.Request(url + path, headers=headers), timeout=30) as r:
                r.read()
        except urllib.error.HTTPError as exc:
            if exc.code != 404:
                problem = f"GET {path}: HTTP {exc.code}"
        except OSError as exc:
            problem = f"GET {path}: {exc}"
    proc.send_signal(15)
    return problem, line


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", help="only the cases of this command")
    ap.add_argument("--match", help="only the cases whose name contains this")
    ap.add_argument("--jobs", type=int, default=1, help="cases run at once (default 1)")
    args = ap.parse_args()
    cases = [c for c in CASES if (args.only is None or c.argv[0] == args.only)
             and (args.match is None or args.match in c.name)]
    counts: Counter[str] = Counter()
    wrong = 0
    with ThreadPoolExecutor(max(1, args.jobs)) as pool:
        for r in pool.map(run_case, cases):
            counts[r.outcome] += 1
            wrong += not r.right
            mark = "ok " if r.right else "BAD"
            print(f"{mark} {r.outcome:<9} rc={r.rc!s:<4} {r.case.name:<45} {r.first_line[:110]}", flush=True)
    print(f"\n{len(cases)} cases: " + ", ".join(f"{o} {counts[o]}" for o in OUTCOMES) + f"; not as expected: {wrong}")
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
