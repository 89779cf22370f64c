"""The warm zygote: workers forked from a process that imported torch once, back-to-back
recoveries served from it, its clean fall-back to fresh processes, and no process left behind."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import psutil
import pytest
from tgtest import EXAMPLE, alive, events, processes_of, rank_log, wait_event, wait_for, wait_log

from trainguard.monitors.profiling.monitor import sweep_rings
from trainguard.spawn import zygote as zygote_mod
from trainguard.spawn.pool import WorkerPool
from trainguard.spawn.zygote import Zygote
from trainguard.worker import ring


def _spec(tmp_path, code: str) -> dict:
    script = tmp_path / "w.py"
    script.write_text(code)
    return {"env": dict(os.environ), "cwd": str(tmp_path), "script": str(script), "module": None, "args": ["a1"]}


def _assign(child, spec: dict) -> None:
    child.stdin.write((json.dumps(spec) + "\n").encode())
    child.stdin.close()


def test_a_thread_in_the_zygote_makes_it_refuse_to_fork():
    # Forking a process with a second thread can leave a lock held forever in the child: refuse.
    code = (
        "import threading, time\n"
        "from trainguard.spawn import zygote_server as z\n"
        "ev = threading.Event()\n"
        "print(z.prepare(lambda: threading.Thread(target=ev.wait, daemon=True).start()))\n"
        "ev.set()\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True).stdout
    assert "'ready': False" in out and "threads after importing" in out, out


@pytest.mark.slow
def test_zygote_forks_workers_that_run_and_report_their_exit(tmp_path):
    z = Zygote(sys.executable, dict(os.environ))
    try:
        assert z.wait_ready(), z.error
        assert z.ready_info["import_s"] > 0
        code = "import sys, os, torch\nprint('hello', sys.argv[1:], os.getsid(0) == os.getpid(), torch.tensor([2]).item())\nsys.exit(7)\n"
        for _ in range(2):  # back to back: the second is as ready as the first
            child = z.fork()
            assert psutil.Process(child.pid).ppid() == z.proc.pid
            _assign(child, _spec(tmp_path, code))
            assert child.wait(timeout=120) == 7
            assert child.stdout.read().decode().strip() == "hello ['a1'] True 2"
        killed = z.fork()
        os.killpg(killed.pid, signal.SIGKILL)  # its own group: the agent signals it as any worker
        assert killed.wait(timeout=60) == -9
        assert killed.poll() == -9
    finally:
        z.close()
    assert z.proc.poll() is not None


@pytest.mark.slow
def test_the_zygote_outlives_a_schedulers_sigterm_and_its_children_do_not_ignore_it(tmp_path):
    """Slurm sends SIGTERM to every process of a step, in no order. A zygote dying of it first
    SIGKILLed every worker forked from it (their death signal) before the agent got its own
    SIGTERM: a preempted job was recorded as a failed one. The zygote ignores it; a forked worker
    gets a fresh process's handlers (SIGTERM ends it, SIGINT raises KeyboardInterrupt)."""
    z = Zygote(sys.executable, dict(os.environ))
    try:
        assert z.wait_ready(), z.error
        code = (
            "import signal, sys\n"
            "print(signal.getsignal(signal.SIGTERM) == signal.SIG_DFL, signal.getsignal(signal.SIGINT) is signal.default_int_handler,"
            " flush=True)\n"
            "sys.stdin.read()\n"  # wait to be signalled
        )
        # What a fresh process gets here (a shell that started this in the background hands
        # SIGINT down ignored, and Python keeps it so): a forked worker must get the same.
        fresh = subprocess.run([sys.executable, "-c", code], input="", capture_output=True, text=True, timeout=60).stdout
        child = z.fork()
        os.kill(z.proc.pid, signal.SIGTERM)
        _assign(child, _spec(tmp_path, code))
        assert child.stdout.readline().decode().split() == fresh.split()
        assert z.proc.poll() is None, "the zygote died of SIGTERM"
        os.kill(child.pid, signal.SIGTERM)
        assert child.wait(timeout=60) == -signal.SIGTERM
    finally:
        z.close()


@pytest.mark.slow
def test_closing_the_zygote_takes_its_idle_children_down():
    z = Zygote(sys.executable, dict(os.environ))
    try:
        children = [psutil.Process(z.fork().pid) for _ in range(2)]
    finally:
        z.close()
    wait_for(lambda: not alive(children), 60, "forked spares gone with the zygote")


@pytest.mark.slow
def test_pool_falls_back_to_fresh_processes_when_the_zygote_dies(tmp_path):
    pool = WorkerPool(2, mode="on")
    got = []
    try:
        wait_for(lambda: len(pool.spare_pids()) == 2, 180, "two forked spares")
        zygote = pool.zygote
        assert zygote is not None
        spares = [psutil.Process(p) for p in pool.spare_pids()]
        assert {p.ppid() for p in spares} == {zygote.proc.pid}
        os.kill(zygote.proc.pid, signal.SIGKILL)  # a real fault: the spares die with it (death signal)
        wait_for(lambda: not alive(spares), 60, "forked spares gone with their zygote")
        got = pool.take(2)
        assert pool.zygote is None  # said so in the log, and from now on spawns
        assert all(w.proc.poll() is None and w.prestarted for w in got)
        assert all(psutil.Process(w.proc.pid).ppid() == os.getpid() for w in got)
        for w in got:
            w.assign(_spec(tmp_path, "import sys\nsys.exit(0)\n"))
        assert [w.proc.wait(timeout=180) for w in got] == [0, 0]
    finally:
        pool.close()
        for w in got:
            w.output.close()


@pytest.mark.slow
def test_back_to_back_kills_recover_from_forked_workers_and_agent_kill_leaves_nothing(jobs, tmp_path):
    run = tmp_path / "run"
    # --restart-loop-attempts 0: three kills right after each recovery, before a new snapshot, are
    # what the restart-loop guard stops (same signal, no step passed); here they test the spares.
    job = jobs("run", "--standalone", "--nproc-per-node", "2", "--max-restarts", "3", "--restart-loop-attempts", "0",
               "--run-dir", run, EXAMPLE, "--steps", "100000", "--step-time-ms", "50", "--ckpt-every", "5",
               "--ckpt-dir", tmp_path / "ckpt")  # fmt: skip
    launcher = psutil.Process(job.proc.pid)

    def zygote_pid() -> int | None:
        for c in launcher.children():
            if "--zygote" in " ".join(c.cmdline()):
                return c.pid
        return None

    for attempt in range(3):
        pids = wait_event(run, "job_started", pred=lambda e, a=attempt: e.evidence["attempt"] == a).evidence["pids"]
        # the first step of this attempt; then kill at once: the next failure comes right after a recovery
        wait_log(rank_log(run, attempt, 1), "step=")
        zpid = zygote_pid()
        assert zpid is not None
        assert {psutil.Process(int(p)).ppid() for p in pids.values()} == {zpid}, "workers forked by the zygote"
        os.kill(int(pids["1"]), signal.SIGKILL)
    wait_log(rank_log(run, 3, 1), "step=")
    assert [e.evidence["restart_count"] for e in events(run, "restart")] == [1, 2, 3]
    procs = processes_of(run)
    assert len(procs) >= 5  # launcher, zygote, 2 workers, spares
    os.kill(job.proc.pid, signal.SIGKILL)  # the agent dies without cleaning up: nothing may outlive it
    job.proc.wait(timeout=60)
    wait_for(lambda: not alive(procs), 60, "zygote, spares and workers gone with the agent")
    # but its snapshots do, for the next agent on the node to persist (in the test's own tmpfs dir)
    assert [n for n in os.listdir(jobs.shm_root) if n.startswith(f"trainguard-ckpt-{job.proc.pid}-")]
    # and so may its workers' profiling rings in /dev/shm, which the next agent removes first
    # (a ring the dead agent had not yet opened and unlinked: CI found one after the suite)
    sweep_rings()
    assert not [n for n in os.listdir(ring.shm_dir()) if n.startswith(f"trainguard-{job.proc.pid}-")]



@pytest.mark.parametrize(
    "argv,want",
    [
        (["--standalone", "train.py"], None),
        (["--prestart-workers", "off", "train.py"], "off"),
        (["--prestart_workers=spawn", "train.py"], "spawn"),
        (["--prestart-workers"], None),  # no value: the parser reports it
    ],
)
def test_early_start_reads_the_prestart_mode_from_raw_arguments(argv, want):
    assert zygote_mod._prestart_mode(argv) == want


def test_no_early_zygote_when_not_wanted():
    for argv in (["--no-python", "x"], ["--prestart-workers", "spawn", "t.py"], ["-h"]):
        zygote_mod.start_early(argv)
        assert zygote_mod.take_early(sys.executable) is None


def test_a_launch_that_stops_early_leaves_no_zygote(capsys):
    """`trainguard run` with a bad flag value, called in-process: the zygote started before the
    flags were parsed is closed (it used to stay, and the next launch in the process took it)."""
    from trainguard import cli

    assert cli.main(["run", "--nproc-per-node", "0", "train.py"]) == 2
    assert zygote_mod._early is None
    assert "error" in capsys.readouterr().err
