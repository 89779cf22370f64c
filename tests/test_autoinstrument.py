"""Zero-code instrumentation of processes trainguard does not start itself.

A real console-script entry point, made by pip from a local package at test time, run with
`trainguard run --no-python`: its steps reach the agent (profiling records, step-based hang
detection) through trainguard's sitecustomize, the user's own sitecustomize still runs, and the
trainer's DataLoader workers (forked and spawned) do not take the rank's ring.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from tgtest import SCRIPTS, events, rank_log

from trainguard.worker.bootstrap import SITE_DIR

PACKAGE = SCRIPTS / "console_pkg"


@pytest.fixture(scope="module")
def console_script(tmp_path_factory) -> tuple[Path, Path]:
    """pip builds and installs the package (no network, no index) into a target dir of its own."""
    root = tmp_path_factory.mktemp("console")
    src = shutil.copytree(PACKAGE, root / "src")  # pip builds in the source tree: not in ours
    target = root / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-index", "--no-deps",
                    "--no-build-isolation", "--target", str(target), str(src)],
                   check=True, timeout=300, capture_output=True)  # fmt: skip
    # The user's own sitecustomize, on their PYTHONPATH: trainguard's must run it too.
    (target / "sitecustomize.py").write_text("import os\nos.environ['TGDEMO_USER_SITE'] = 'yes'\n")
    bin_dir = target / "bin"
    assert (bin_dir / "tgdemo-train").read_text().startswith("#!"), "a real console-script wrapper"
    return bin_dir, target


def profiling_records(run: Path, rank: int) -> list[dict]:
    d = run / "profiling" / str(rank)
    return [json.loads(x) for f in sorted(d.iterdir()) if f.name.isdigit() for x in f.read_text().splitlines()]


@pytest.mark.slow
def test_console_script_gets_steps_spans_and_step_hang_detection(jobs, tmp_path, console_script):
    bin_dir, target = console_script
    run = tmp_path / "run"
    job = jobs("run", "--standalone", "--nproc-per-node", "2", "--max-restarts", "1", "--run-dir", run,
               "--hang-period", "0.5", "--hang-step-slack", "3",
               "--no-python", bin_dir / "tgdemo-train", "--steps", "40", "--hang-rank", "1", "--hang-step", "15",
               env={"PYTHONPATH": str(target)})  # fmt: skip
    assert job.wait() == 0, job.output()[-4000:]
    # Step-based hang detection saw the console script's steps: the steps rule named the culprit.
    (hang,) = events(run, "hang_detected")
    assert (hang.rank, hang.evidence["rule"]) == (1, "steps"), hang.message
    for rank in (0, 1):
        log = rank_log(run, 0, rank).read_text()
        assert "user sitecustomize ran: yes" in log
        # The trainer owns the rank's ring; its forked DataLoader worker writes to a private
        # throw-away ring.
        assert instrumentation(log) == {"trainer": "ring", "dataloader-fork": "private"}, log[-3000:]
        records = profiling_records(run, rank)
        steps = [r["step"] for r in records if r["kind"] == "Step"]
        # attempt 0: steps 1..14 (rank 1 hangs in step 15); attempt 1: 1..40 -- once each, one writer
        assert steps[-40:] == list(range(1, 41)), steps
        assert {"Step", "FP", "DataLoader"} <= {r["kind"] for r in records}


def instrumentation(log: str) -> dict[str, str]:
    """What each process of a rank reported: {"trainer": "ring", "dataloader-fork": ...}."""
    return {x.split("instrumentation ")[1].split()[0]: x.split("recorder=")[1]
            for x in log.splitlines() if "instrumentation " in x}  # fmt: skip


@pytest.mark.slow
def test_wrappers_that_exec_or_spawn_python(jobs, tmp_path, console_script):
    """Rank 0's wrapper execs `python -m tgdemo.cli`, rank 1's spawns it: the trainer owns the ring."""
    bin_dir, target = console_script
    run = tmp_path / "run"
    job = jobs("run", "--standalone", "--nproc-per-node", "2", "--run-dir", run,
               "--no-python", bin_dir / "tgdemo-wrap", "--steps", "12", env={"PYTHONPATH": str(target)})  # fmt: skip
    assert job.wait() == 0, job.output()[-4000:]
    for rank in (0, 1):
        log = rank_log(run, 0, rank).read_text()
        wrapper = int(log.split("wrapper pid=")[1].split()[0])
        trainer = int(log.split("instrumentation trainer pid=")[1].split()[0])
        assert (trainer == wrapper) == (rank == 0), "exec keeps the pid; a spawned trainer has its own"
        assert instrumentation(log) == {"trainer": "ring", "dataloader-fork": "private"}
        steps = [r["step"] for r in profiling_records(run, rank) if r["kind"] == "Step"]
        assert steps == list(range(1, 13))


def test_private_ring_moves_into_the_shared_file_once(tmp_path):
    from trainguard.probes.ring_reader import RingReader
    from trainguard.worker import ring as R

    w = R.RingWriter(None, rank=3, capacity=8, flags=R.FLAG_BASIC)
    w.write(R.FP, 0, 1, 10, 20)
    w.write_step(1, 30, 25)
    path = str(tmp_path / "ring")
    w.claim(path)
    w.write(R.STEP, 0, 1, 5, 30)
    reader = RingReader(path)
    assert (reader.rank, reader.pid, reader.step_count) == (3, os.getpid(), 1)
    assert [(r.kind, r.step) for r in reader.read_new()] == [(R.FP, 1), (R.STEP, 1)]
    other = R.RingWriter(None, rank=3, capacity=8)
    with pytest.raises(FileExistsError):  # a second process of the rank does not take it over
        other.claim(path)
    reader.close()
    w.close()
    other.close()


SPAWN_CHILD = """
import multiprocessing as mp, sys

def state(q):
    spans = sys.modules.get("trainguard.worker.spans")
    q.put("none" if spans is None or spans.recorder() is None else "installed")

if __name__ == "__main__":
    ctx = mp.get_context("spawn")
    state(q := ctx.Queue())
    child = ctx.Process(target=state, args=(q,))
    child.start()
    child.join()
    print(q.get(), q.get())
"""


def test_multiprocessing_children_are_not_instrumented(tmp_path):
    """A worker's spawned children (spawn / forkserver DataLoader workers) start a fresh Python
    with the worker's environment: trainguard's sitecustomize leaves them alone."""
    script = tmp_path / "spawner.py"
    script.write_text(SPAWN_CHILD)
    env = dict(os.environ, PYTHONPATH=SITE_DIR, RANK="0", TRAINGUARD_RING_PREFIX=str(tmp_path / "ring"))
    env.pop("TRAINGUARD_RING_OWNER", None)
    out = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=120)
    assert out.stdout.split() == ["installed", "none"], out.stderr
    assert not list(tmp_path.glob("ring*")), "no step, no ring"


def test_sitecustomize_chains_and_installs_nothing_outside_a_job(tmp_path):
    """Outside a job's workers trainguard's sitecustomize only runs the one it hides."""
    user = tmp_path / "user"
    user.mkdir()
    (user / "sitecustomize.py").write_text("MARK = 'user'\n")
    code = "import sitecustomize, sys; print(sitecustomize.MARK, 'trainguard' in sys.modules)"
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRAINGUARD_")}
    env["PYTHONPATH"] = os.pathsep.join([SITE_DIR, str(user)])
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert out.stdout.split() == ["user", "False"], out.stderr
