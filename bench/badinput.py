"""Bad input against every command: each case must give an answer or one line on stderr with exit
code 2 — never a traceback, never a hang (issue 18).

    python bench/badinput.py            # every case, one line each, then the outcome counts
    python bench/badinput.py --only check

Cases run as real processes (``python -m trainguard ...``) on real files made in a temporary
directory: garbage and directory event databases, read-only run dirs, crafted logs, out-of-range
ports and numbers. ``run`` cases stop before any worker starts (their flags are refused), so the
sweep takes a minute, not an hour. tests/test_badinput.py runs the same table.

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
    expect: str = "usage"  # what a right answer is: "usage" or "answer"
    env: dict[str, str] = field(default_factory=dict)


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


def _binary_log(d: Path) -> None:
    (d / "train.log").write_bytes(bytes(range(256)) * 64)


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
    # no command / unknown command
    Case("unknown command", ("frobnicate",)),
]


@dataclass
class Result:
    case: Case
    outcome: str
    rc: int | None
    first_line: str

    @property
    def right(self) -> bool:
        return self.outcome == self.case.expect


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
    try:
        if case.setup is not None:
            case.setup(d)
        argv = [a.replace("{d}", str(d)) for a in case.argv]
        env = {k: v for k, v in os.environ.items() if not k.startswith(("TRAINGUARD_", "MA_HANG"))}
        env.update(case.env)
        proc = subprocess.Popen([sys.executable, "-m", "trainguard", *argv], cwd=d, env=env, text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
                                start_new_session=True)
        try:
            out, err = proc.communicate(timeout=time_limit_s)
            rc: int | None = proc.returncode
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            out, err = proc.communicate()
            rc = None
        lines = (err.strip() or out.strip()).splitlines()
        return Result(case, classify(rc, out, err), rc, lines[-1] if lines else "")
    finally:
        for p in (d / "run", d):
            if p.exists():
                undo_read_only(p)
        shutil.rmtree(d, ignore_errors=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", help="only the cases of this command")
    args = ap.parse_args()
    cases = [c for c in CASES if args.only is None or c.argv[0] == args.only]
    counts: Counter[str] = Counter()
    wrong = 0
    for case in cases:
        r = run_case(case)
        counts[r.outcome] += 1
        wrong += not r.right
        mark = "ok " if r.right else "BAD"
        print(f"{mark} {r.outcome:<9} rc={r.rc!s:<4} {case.name:<45} {r.first_line[:110]}", flush=True)
    print(f"\n{len(cases)} cases: " + ", ".join(f"{o} {counts[o]}" for o in OUTCOMES) + f"; not as expected: {wrong}")
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
