"""`trainguard chaos` against a running job: each injection is real, bounded, reverted where it
lasts, and recorded as a `chaos_injected` event the job's own verdicts can be joined with."""

from __future__ import annotations

import subprocess
import sys

import psutil
import pytest
from tgtest import (
    EXAMPLE,
    SCRIPTS,
    events,
    missing_tools,
    rank_log,
    require,
    trainguard_cmd,
    wait_event,
    wait_for,
    wait_log,
)

from trainguard.chaos import testbed
from trainguard.rundir import chaos_hold as hold

pytestmark = pytest.mark.slow


def chaos(run, *args) -> subprocess.CompletedProcess:
    return subprocess.run(trainguard_cmd("chaos", run, *args), capture_output=True, text=True, timeout=120)


def test_chaos_faults_on_a_running_job(jobs, tmp_path):
    run = tmp_path / "run"
    job = jobs("run", "--standalone", "--nproc-per-node", "2", "--max-restarts", "2", "--run-dir", run,
               "--precheck", "off", "--quiet", EXAMPLE, "--steps", "100000", "--step-time-ms", "30",
               "--ckpt", "trainguard", "--ckpt-every", "5")  # fmt: skip
    first = wait_event(run, "job_started")
    wait_log(rank_log(run, 0, 1), "step=6 ")
    wait_for(lambda: list((run / "checkpoints").glob("step-*/rank-00000.json")), what="a persisted checkpoint")

    # slow: a bounded CPU load pinned to rank 1's core, gone after its duration
    done = chaos(run, "slow", "--rank", "1", "--percent", "50", "--duration", "2")
    assert done.returncode == 0, done.stderr
    [slow] = events(run, "chaos_injected")
    assert slow.rank == 1 and slow.evidence["fault"] == "slow" and slow.evidence["percent"] == 50
    wait_event(run, "chaos_reverted", pred=lambda e: e.evidence["fault"] == "slow")
    wait_for(lambda: not psutil.pid_exists(slow.evidence["holder"]) or psutil.Process(slow.evidence["holder"]).status()
             == psutil.STATUS_ZOMBIE, what="the load process ended")  # fmt: skip

    # fill-disk: bounded, and the file is gone afterwards
    fill = tmp_path / "disk"
    fill.mkdir()
    assert chaos(run, "fill-disk", "--node", first.node, "--path", fill, "--size-mb", "4", "--duration", "1").returncode == 0
    reverted = wait_event(run, "chaos_reverted", pred=lambda e: e.evidence["fault"] == "fill-disk")
    assert "4194304 bytes written" in reverted.message and not list(fill.iterdir())

    # corrupt-ckpt: the newest step's data changes in place
    done = chaos(run, "corrupt-ckpt", "--rank", "0")
    assert done.returncode == 0, done.stderr
    corrupt = [e for e in events(run, "chaos_injected") if e.evidence["fault"] == "corrupt-ckpt"][0]
    assert corrupt.evidence["file"].endswith("rank-00000.bin") and corrupt.evidence["bytes"] > 0

    # stop / cont
    pid0 = first.evidence["pids"]["0"]
    assert chaos(run, "stop", "--rank", "0").returncode == 0
    wait_for(lambda: psutil.Process(pid0).status() == psutil.STATUS_STOPPED, what="rank 0 stopped")
    assert chaos(run, "cont", "--rank", "0").returncode == 0
    wait_for(lambda: psutil.Process(pid0).status() != psutil.STATUS_STOPPED, what="rank 0 running again")

    # hang with --duration: rank 1 blocks in DDP's gradient all-reduce hook, then goes on
    done = chaos(run, "hang", "--rank", "1", "--duration", "1")
    assert done.returncode == 0, done.stderr
    released = wait_event(run, "chaos_reverted", pred=lambda e: e.evidence["fault"] == "hang")
    assert released.rank == 1 and not hold.request_path(run, 1).exists()
    after = max(int(ln.split("step=")[1].split()[0]) for ln in rank_log(run, 0, 1).read_text().splitlines() if "step=" in ln)
    wait_log(rank_log(run, 0, 1), f"step={after + 3} ")

    # kill a worker: the job's own verdict follows
    assert chaos(run, "kill", "--rank", "1").returncode == 0
    failed = wait_event(run, "worker_failed")
    assert failed.rank == 1 and "SIGKILL" in failed.message
    wait_event(run, "job_started", pred=lambda e: e.evidence["attempt"] == 1)
    kinds = [e.evidence["fault"] for e in events(run, "chaos_injected")]
    assert kinds == ["slow", "fill-disk", "corrupt-ckpt", "stop", "cont", "hang", "kill"]

    # net faults need a network-namespace node; bad targets are one clear line, exit 2
    bad = chaos(run, "net-cut", "--node", first.node)
    assert bad.returncode == 2 and "own network namespace" in bad.stderr and bad.stderr.count("\n") == 1
    bad = chaos(run, "kill", "--rank", "7")
    assert bad.returncode == 2 and "no running rank 7" in bad.stderr
    job.kill()


HANG_FLAGS = ("--hang-period", "0.5", "--hang-step-slack", "3", "--precheck", "off", "--quiet")


def test_chaos_hang_is_found_and_the_job_recovers(jobs, tmp_path):
    """A rank held before its next all_reduce: the hang monitor names it from the stacks (the
    others wait in the collective), restarts the group, and the restarted rank is not held."""
    run = tmp_path / "run"
    job = jobs("run", "--standalone", "--nproc-per-node", "2", "--max-restarts", "1", "--run-dir", run, *HANG_FLAGS,
               SCRIPTS / "hang_worker.py", "--steps", "200")  # fmt: skip
    wait_log(rank_log(run, 0, 1), "step=5 ")
    done = chaos(run, "hang", "--rank", "1")
    assert done.returncode == 0, done.stderr
    [injected] = events(run, "chaos_injected")
    assert injected.rank == 1 and injected.evidence["fault"] == "hang" and injected.evidence["duration"] is None
    assert job.wait() == 0, job.output()
    hangs = events(run, "hang_detected")
    assert hangs and {e.rank for e in hangs} == {1}, [e.message for e in hangs]
    ev = hangs[0]
    assert ev.time > injected.time and ev.evidence["ranks"]["1"]["kind"] == "user", ev.message
    assert ev.evidence["ranks"]["0"]["op"] == "all_reduce"
    assert ev.evidence["stack"][0].startswith("chaos_hang_before_collective ")
    ended = wait_event(run, "chaos_reverted")
    assert ended.rank == 1 and "is gone" in ended.message
    assert [e.evidence["attempt"] for e in events(run, "job_started")] == [0, 1]
    assert events(run, "job_succeeded") and not hold.pending(run)


def test_chaos_hang_control_healthy_job(jobs, tmp_path):
    """The same job and hang settings, nothing injected: no hang is reported, nothing restarts."""
    run = tmp_path / "run"
    job = jobs("run", "--standalone", "--nproc-per-node", "2", "--max-restarts", "1", "--run-dir", run, *HANG_FLAGS,
               SCRIPTS / "hang_worker.py", "--steps", "100")  # fmt: skip
    assert job.wait() == 0, job.output()
    kinds = {e.kind for e in events(run)}
    assert not kinds & {"hang_suspected", "hang_detected", "policy_decision", "restart", "chaos_injected"}, kinds
    assert len(events(run, "job_started")) == 1 and events(run, "job_succeeded")


def test_chaos_hang_needs_the_worker_hooks(jobs, tmp_path):
    """A worker trainguard does not instrument cannot be held: one clear line, exit 2, nothing left."""
    run = tmp_path / "run"
    job = jobs("run", "--standalone", "--nproc-per-node", "1", "--run-dir", run, "--precheck", "off", "--quiet",
               "--auto-instrument", "off", "--no-python", sys.executable, "-c", "import time; time.sleep(120)")  # fmt: skip
    wait_event(run, "job_started")
    bad = chaos(run, "hang", "--rank", "0")
    assert bad.returncode == 2 and "no trainguard worker hooks" in bad.stderr and bad.stderr.count("\n") == 1, bad.stderr
    assert not events(run, "chaos_injected") and not hold.pending(run) and not hold.ack_path(run, 0).exists()
    bad = chaos(run, "hang", "--node", events(run, "job_started")[0].node)
    assert bad.returncode == 2 and "hang needs --rank" in bad.stderr
    job.kill()


@pytest.mark.skipif(testbed.available() is not None, reason=str(testbed.available()))
def test_chaos_net_loss_and_net_slow_revert_cleanly(jobs, tmp_path):
    """A node in its own network namespace: net-loss (netem, else a random-drop iptables rule) and
    net-slow (a tbf thin link) change its interface while held and leave nothing after."""
    require(missing_tools("tc", "iptables"))  # read below whichever way the loss is made
    run = tmp_path / "run"
    with testbed.Testbed(1) as bed:
        [node] = bed.nodes
        inside = [*node.exec_prefix()]
        job = jobs("run", "--standalone", "--nproc-per-node", "1", "--run-dir", run, "--node-name", "n1", "--precheck", "off",
                   "--quiet", EXAMPLE, "--steps", "100000", "--step-time-ms", "30", prefix=inside)  # fmt: skip
        wait_event(run, "job_started")

        def shown() -> str:
            tc = subprocess.run([*inside, "tc", "qdisc", "show", "dev", node.ifname], capture_output=True, text=True)
            ipt = subprocess.run([*inside, "iptables", "-S", "OUTPUT"], capture_output=True, text=True)
            return tc.stdout + ipt.stdout

        clean = shown()
        done = chaos(run, "net-loss", "--node", "n1", "--loss", "30", "--duration", "600")
        assert done.returncode == 0, done.stderr
        loss = events(run, "chaos_injected")[-1].evidence
        assert loss["how"] in ("netem", "iptables") and loss["dev"] == node.ifname
        if loss["how"] == "iptables":
            assert "trainguard-chaos-" in shown() and "--probability 0.29" in shown(), shown()
        else:
            assert "netem" in shown() and "loss 30%" in shown(), shown()
        psutil.Process(loss["holder"]).terminate()  # the holder reverts on SIGTERM
        wait_event(run, "chaos_reverted", pred=lambda e: e.evidence["fault"] == "net-loss")
        assert shown() == clean

        # held until its holder is told to end (a 1 s hold could end before a loaded machine looked)
        done = chaos(run, "net-slow", "--node", "n1", "--rate-kbit", "500", "--duration", "600")
        assert done.returncode == 0, done.stderr
        slow = events(run, "chaos_injected")[-1].evidence
        assert slow["how"] == "tbf" and "tbf" in shown() and "rate 500Kbit" in shown()
        psutil.Process(slow["holder"]).terminate()
        wait_event(run, "chaos_reverted", pred=lambda e: e.evidence["fault"] == "net-slow")
        assert shown() == clean

        bad = chaos(run, "net-loss", "--node", "n1", "--loss", "150")
        assert bad.returncode == 2 and "at most 100" in bad.stderr and bad.stderr.count("\n") == 1
        assert shown() == clean
        job.kill()


def test_holder_stopped_while_it_starts_still_reverts(tmp_path):
    """A holder SIGTERMed at once, before its interpreter has imported anything, still runs its
    revert and records chaos_reverted: the signal waits, blocked, until its handler is in place
    (the default action would kill it and leave the fault in place)."""
    from trainguard.chaos import background

    marker = tmp_path / "reverted"
    spec = {"fault": "net-cut", "duration": 600, "run_dir": str(tmp_path / "run"), "node": "n1", "id": "t1",
            "revert": [[sys.executable, "-c", f"open({str(marker)!r}, 'w').close()"]]}  # fmt: skip
    pid = background.start(spec, tmp_path / "holder.log")
    proc = psutil.Process(pid)
    proc.terminate()  # before it could have installed a handler: it is still starting
    assert proc.wait(timeout=120) == 0, (tmp_path / "holder.log").read_text()
    assert marker.exists()
    [ev] = events(tmp_path / "run", "chaos_reverted")
    assert ev.evidence["fault"] == "net-cut"


def test_chaos_nodecheck_kill_acts_only_on_a_verified_nodecheck_process(tmp_path):
    """nodecheck-kill signals the pid of the node's newest ``nodecheck_started`` only when it is
    that process, on this machine, under the agent that recorded it; a holder kills the node-check
    processes that agent starts later (its descendants running trainguard.checks.bench)."""
    from trainguard.events import EventBus, EventStore
    from trainguard.events.store import node_db_path
    from trainguard.probes import identity

    run = tmp_path / "run"
    bench = [sys.executable, "-c", "import time; time.sleep(600)", "trainguard.checks.bench"]
    first = subprocess.Popen(bench[:3], start_new_session=True)  # this test is its "agent"
    later = None
    store = EventStore(node_db_path(run, "n0"))
    bus = EventBus(store, node="n0")
    try:
        forged = {**identity.record({0: first.pid}), "boot_id": "another-machine"}
        bus.emit("nodecheck_started", "forged", evidence={"pid": first.pid, "identity": forged})
        refused = chaos(run, "nodecheck-kill", "--node", "n0")
        assert refused.returncode == 2 and "runs on another machine" in refused.stderr
        assert first.poll() is None  # not signalled
        bus.emit("nodecheck_started", "real", evidence={"pid": first.pid, "identity": identity.record({0: first.pid})})
        done = chaos(run, "nodecheck-kill", "--node", "n0", "--duration", "120")
        assert done.returncode == 0, done.stderr
        assert first.wait(timeout=60) == -9
        later = subprocess.Popen(bench, start_new_session=True)  # the agent's next check: killed by the holder
        assert later.wait(timeout=120) == -9
    finally:
        for p in (first, later):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait()
        store.close()
    [injected] = events(run, "chaos_injected")
    holder = injected.evidence["holder"]
    psutil.Process(holder).terminate()  # this "agent" outlives the test's fault: end it early
    wait_event(run, "chaos_reverted", pred=lambda e: e.evidence["fault"] == "nodecheck-kill")
