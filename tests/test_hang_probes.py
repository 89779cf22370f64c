"""Probes on real processes: /proc I/O and CPU of a process tree, py-spy stacks (stopped ones too),
and the hang monitor's options."""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from tgtest import wait_for

from trainguard.monitors.hang import monitor as hang_monitor
from trainguard.probes import proc, stacks


@contextmanager
def python(code: str) -> Iterator[subprocess.Popen]:
    p = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(code)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        start_new_session=True,
    )
    try:
        assert p.stdout is not None
        assert p.stdout.readline().strip() == b"ready"
        yield p
    finally:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        p.wait(timeout=30)


# The child writes a line to a file each time the parent sends one on stdin, in a grandchild, so
# the I/O only shows when children are counted.
WRITER = """
import subprocess, sys
child = subprocess.Popen([sys.executable, "-c", '''
import sys, os
with open(os.devnull, "w") as f:
    for line in sys.stdin:
        f.write(line * 1000); f.flush()
'''], stdin=subprocess.PIPE, text=True)
print("ready", flush=True)
for line in sys.stdin:
    child.stdin.write(line); child.stdin.flush()
"""


def test_hang_proc_sample_counts_children_io() -> None:
    with python(WRITER) as p:
        assert p.stdin is not None
        wait_for(lambda: proc.sample(0, p.pid, 0.0).children == 1, 30)
        before = proc.sample(0, p.pid, 1.0)
        own_before = proc.read_io(p.pid)
        p.stdin.write(b"x\n")
        p.stdin.flush()
        wait_for(lambda: proc.sample(0, p.pid, 2.0).io[1] >= before.io[1] + 2000, 30)  # wchar of the grandchild
        assert before.alive and before.state in ("S", "R") and before.io is not None
        # the parent only passed the 2-byte line on: the 2000 bytes were written by its child
        assert proc.read_io(p.pid)[1] - own_before[1] < 100


def test_hang_proc_cpu_state_and_gone() -> None:
    code = """
    import time
    print("ready", flush=True)
    t = time.process_time()
    while time.process_time() - t < 60: pass
    """
    with python(code) as p:
        first = proc.sample(3, p.pid, 0.0)
        wait_for(lambda: proc.sample(3, p.pid, 1.0).cpu > first.cpu + 0.2, 30)
        os.kill(p.pid, signal.SIGSTOP)
        wait_for(lambda: proc.read_state(p.pid) == "T", 30)
        assert proc.sample(3, p.pid, 2.0).state == "T"
        os.kill(p.pid, signal.SIGKILL)
        p.wait(timeout=30)
    gone = proc.sample(3, p.pid, 3.0)
    assert not gone.alive and gone.io is None
    assert proc.read_io(p.pid) is None and proc.read_state(p.pid) == ""


SLEEPER = """
import time
def waiting_here():
    print("ready", flush=True)
    while True:
        time.sleep(0.05)
waiting_here()
"""


@pytest.mark.skipif(stacks.pyspy_path() is None, reason="py-spy not installed")
def test_hang_stacks_running_and_stopped_process() -> None:
    with python(SLEEPER) as p:
        d = stacks.dump_stack(0, p.pid, timeout=30)
        assert d.error is None and d.nonblocking  # read without pausing the worker
        main = d.main_thread()
        assert main is not None and main.frames[0].name == "waiting_here"
        os.kill(p.pid, signal.SIGSTOP)
        wait_for(lambda: proc.read_state(p.pid) == "T", 30)
        d = stacks.dump_stack(0, p.pid, timeout=30)
        # ptrace cannot take over a stopped process: read without pausing instead
        assert d.error is None and d.nonblocking and d.state == "T"
        assert d.main_thread().frames[0].name == "waiting_here"
        assert proc.read_state(p.pid) == "T"  # still stopped: we did not resume it
        both = stacks.dump_all({0: p.pid, 1: 2**22 + 12345}, timeout=30)
        assert both[0].threads and both[1].error == "process is gone"


def test_hang_stacks_parse_rejects_garbage() -> None:
    with pytest.raises(ValueError):
        stacks.parse_pyspy_json("Error: Permission denied")
    t = stacks.parse_pyspy_json(
        '[{"thread_id": 1, "thread_name": "MainThread", "active": true, "owns_gil": true,'
        ' "frames": [{"name": "f", "filename": "a.py", "line": 3}]}]'
    )
    assert t[0].frames[0] == stacks.Frame("f", "a.py", 3) and t[0].owns_gil


# --- options -------------------------------------------------------------------------------------


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    hang_monitor.add_run_arguments(parser.add_argument_group("hang"))
    return parser.parse_args(argv)


def test_hang_options_flag_env_and_seed_alias(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in hang_monitor.DETECT_TIME_ENV:
        monkeypatch.delenv(name, raising=False)
    def config(argv: list[str]):
        return hang_monitor.HangSettings.from_options(parse(argv)).config

    assert config([]).detect_time == 30 * 60
    monkeypatch.setenv("MA_HANG_DETECT_TIME", "5")
    assert config([]).detect_time == 300
    monkeypatch.setenv("TRAINGUARD_HANG_DETECT_TIME", "2")
    assert config([]).detect_time == 120
    cfg = config(["--hang-detect-time", "0.5", "--hang-period", "0.2", "--hang-step-slack", "3"])
    assert (cfg.detect_time, cfg.period, cfg.step_slack) == (30, 0.2, 3)
    assert hang_monitor.create(hang_monitor.settings(parse(["--no-hang-detect"]))) is None
    assert isinstance(hang_monitor.create(hang_monitor.settings(parse([]))), hang_monitor.HangMonitor)


def test_hang_options_bad_values(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parse(["--hang-detect-time", "-1"])
    assert "expected minutes > 0" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse(["--hang-period", "soon"])
    monkeypatch.delenv("TRAINGUARD_HANG_DETECT_TIME", raising=False)
    monkeypatch.setenv("MA_HANG_DETECT_TIME", "thirty")
    with pytest.raises(ValueError, match="MA_HANG_DETECT_TIME='thirty'"):
        hang_monitor.HangSettings.from_options(parse([]))
    assert hang_monitor.create(hang_monitor.settings(parse(["--no-hang-detect"]))) is None  # switched off: the variable is not read


# --- nodes share their stacks through the rendezvous store ------------------------------------


def test_hang_views_shared_across_nodes_name_a_remote_culprit() -> None:
    from torch.distributed import TCPStore

    from trainguard.detect.culprit import RankView, find_culprit
    from trainguard.monitors.hang.exchange import HangExchange, NodeViews
    from trainguard.probes.stacks import Frame

    c10d = "/venv/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py"
    waiting = (Frame("all_reduce", c10d, 3252), Frame("main", "/job/train.py", 96))
    node0 = {0: RankView(0, "S", waiting), 1: RankView(1, "S", waiting)}
    node1 = {2: RankView(2, "S", waiting), 3: RankView(3, "S", (Frame("load", "/job/data.py", 12),))}
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    try:
        assert find_culprit(node0, nnodes=2).rank is None  # node 0 alone cannot tell
        HangExchange(store, "", 1, 2).publish(NodeViews("n1", 1, node1, {2: "idle", 3: "progressing"}, culprit=3))
        got = HangExchange(store.clone(), "", 0, 2).gather(10.0, declared=False)
        assert list(got) == [1] and got[1].node == "n1" and got[1].culprit == 3
        assert got[1].views[3].frames[0].name == "load"
        assert got[1].progress == {2: "idle", 3: "progressing"}  # a remote rank still working holds a local verdict
        assert find_culprit({**got[1].views, **node0}).rank == 3
        assert got[1].evidence()["ranks"]["3"]["progress"] == "progressing"
        # declarations: a node that has not declared is represented by its latest view
        late = HangExchange(store, "", 0, 2).gather(0.3, declared=True)
        assert list(late) == [1] and not late[1].declared
        # a node that never publishes: the wait is bounded and nothing is invented
        assert list(HangExchange(store, "", 0, 3).gather(0.5, declared=False)) == [1]
        store.set("trainguard/hang/views/2", "not json")  # a malformed view is skipped, not fatal
        assert list(HangExchange(store, "", 0, 3).gather(0.5, declared=False)) == [1]
    finally:
        del store


def test_hang_other_nodes_progress_is_counted_not_gathered() -> None:
    """Whether a rank elsewhere still progresses comes from two counters in the store (linear in
    nodes for the job), kept current as each node publishes: its own ranks never count, the wait
    for nodes that have not shared a view yet is bounded, and a node that stops progressing
    stops counting."""
    from torch.distributed import TCPStore

    from trainguard.detect.culprit import RankView
    from trainguard.monitors.hang.exchange import HangExchange, NodeViews
    from trainguard.probes.stacks import Frame

    view = {0: RankView(0, "S", (Frame("main", "/job/train.py", 96),))}
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    try:
        ex = [HangExchange(store.clone(), "a1/", n, 3) for n in range(3)]

        def publish(n: int, progress: dict[int, str]) -> None:
            ex[n].publish(NodeViews(f"n{n}", n, view, progress))

        publish(0, {0: "progressing"})
        assert ex[0].others_moving(0.3) == (0, None)  # its own rank; node 2 never shared (bounded wait)
        assert ex[1].others_moving(0.3) == (1, 0)
        publish(1, {2: "idle", 3: "busy"})
        publish(1, {2: "idle", 3: "busy"})  # the same state again counts once
        publish(2, {4: "idle"})
        assert ex[2].others_moving(10.0) == (2, 3)
        publish(0, {0: "idle", 1: "idle"})
        assert ex[2].others_moving(0.0) == (1, 3)
        assert ex[1].others_moving(0.0) == (0, None)  # node 1's own rank moves: not another node's
        publish(1, {2: "idle", 3: "idle"})
        assert [e.others_moving(0.0)[0] for e in ex] == [0, 0, 0]
        assert HangExchange(store, "a2/", 0, 3).others_moving(0.0) == (0, None)  # another attempt's counters
    finally:
        del store


def test_hang_one_verdict_for_the_job_first_writer_wins() -> None:
    """Three nodes' exchanges on one real store: one claims the incident, its verdict is the one
    that stands (a late judgement of another node loses), every node reads it, and a suspicion is recorded once per incident."""
    from torch.distributed import TCPStore

    from trainguard.evidence import HangEvidence
    from trainguard.monitors.hang.exchange import HangExchange

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    try:
        ex = [HangExchange(store.clone(), "a3/", n, 3) for n in range(3)]
        assert ex[1].claim() and not ex[0].claim() and not ex[2].claim()
        assert ex[1].claim()  # the claimer's own later round keeps it
        assert ex[0].verdict(wait_s=0.3) is None  # bounded: the claimer has not judged yet
        v1 = HangEvidence(1, "steps", "rank 1 is idle in own code", [{"cause": "x"}], "/run/hang-1.txt",
                          3, progress="idle", doing="sleeping", recorded_by="n1")  # fmt: skip
        assert ex[1].offer(v1) is v1
        v0 = HangEvidence(None, "steps", "no local rank is behind", recorded_by="n0")
        assert ex[0].offer(v0) == v1  # a node that judged late (its claimer seemed gone) acts on the first
        assert ex[2].verdict() == v1
        assert HangExchange(store, "a4/", 2, 3).verdict() is None  # another attempt's keys
        assert ex[2].claim_suspicion("10") and not ex[0].claim_suspicion("10")
        assert ex[0].claim_suspicion("11")  # the next stall is another incident
    finally:
        del store


def test_hang_claimer_gone_a_waiting_node_judges_and_one_verdict_stands(tmp_path: Path) -> None:
    """The node that claimed the incident never gives a verdict (its agent stopped): the waiting
    node judges it after its bounded wait, from both nodes' declarations, and records the one
    hang_detected; when the claimer comes back and judges too, the first verdict stands and it
    records nothing (its report is removed)."""
    import time

    from torch.distributed import TCPStore

    from trainguard.detect.culprit import RankView, find_culprit
    from trainguard.detect.hang import Assessment, HangConfig
    from trainguard.detect.verdict import StallVerdict
    from trainguard.events import EventBus
    from trainguard.monitors.api import MonitorContext, StepTracker
    from trainguard.monitors.hang.exchange import HangExchange, NodeViews
    from trainguard.probes.stacks import Frame

    c10d = "/venv/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py"
    views = {0: {0: RankView(0, "S", (Frame("all_reduce", c10d, 3252), Frame("main", "/job/train.py", 96)))},
             1: {1: RankView(1, "S", (Frame("sleep_forever", "/job/train.py", 40), Frame("main", "/job/train.py", 95)))}}  # fmt: skip
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    recorded: list = []

    def watch(n: int, store: TCPStore) -> hang_monitor._Watch:
        bus = EventBus(None, f"node{n}")
        bus.subscribe(recorded.append)
        ctx = MonitorContext(tmp_path, f"node{n}", n, 2, 1, 2, 0, [], bus, StepTracker(), store=store.clone(),
                             rdzv_backend="c10d")  # fmt: skip
        w = hang_monitor._Watch(ctx, HangConfig(period=0.2), {}, None)
        w.exchange, w.gather_wait, w.last_views = HangExchange.for_ctx(ctx), 0.3, views[n]
        return w

    def stall(w: hang_monitor._Watch) -> tuple:
        verdict = find_culprit(w.last_views, nnodes=2)
        return (time.time(), Assessment(False, "", "", {}, stall=12.0), StallVerdict("detected", verdict.rank, "steps", verdict.reason),
                verdict, {})  # fmt: skip

    try:
        late, waiting = watch(1, store), watch(0, store)
        assert late.exchange is not None and late.exchange.claim()  # node1 claims, then its agent stops
        late.exchange.publish(NodeViews.of(late.ctx, views[1], find_culprit(views[1], nnodes=2), {1: "idle"}, declared=True))
        found = waiting._conclude(*stall(waiting))
        assert found is not None and found.rank == 1 and found.recorded_by == "node0"
        assert [(e.kind, e.node, e.rank) for e in recorded] == [("hang_detected", "node0", 1)]
        assert set(recorded[0].evidence["nodes"]) == {"node0", "node1"}
        assert recorded[0].evidence["nodes"]["node1"]["culprit"] == 1
        # node1 comes back and judges its claim: node0's verdict stands, node1 records nothing
        now, a, sv, verdict, _ = stall(late)
        mine = NodeViews.of(late.ctx, views[1], verdict, {}, declared=True)
        adopted = late._judge_for_job(now, a, sv, verdict, {}, mine, 0.0)
        assert adopted is not None and adopted.recorded_by == "node0" and adopted.rank == 1
        assert len(recorded) == 1
        assert [p.name for p in tmp_path.glob("hang-*.txt")] == [Path(found.report).name]  # node1's report removed
    finally:
        del store


def test_hang_monitor_learns_the_first_step_of_an_attempt_no_round_saw(tmp_path: Path) -> None:
    """An attempt of a few fast steps can end between two rounds of the watch; its first step must
    still set the next attempt's first-step allowance, or a rank that then hangs before its first
    step is judged only by the seed's 30 minutes (CI: test_hang_before_the_first_step_... missed)."""
    import time

    from trainguard.detect.hang import HangConfig
    from trainguard.events import EventBus
    from trainguard.events.store import EventStore
    from trainguard.monitors.api import MonitorContext, StepSample, StepTracker, WorkerInfo

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait(timeout=30)  # reaped: its pid names no worker any more, as after a short attempt
    store = EventStore(tmp_path)
    steps = StepTracker()
    ctx = MonitorContext(run_dir=tmp_path, node="n0", node_rank=0, nnodes=1, nproc_per_node=1, world_size=1,
                         restart_count=0, workers=[WorkerInfo(0, 0, gone.pid)], events=EventBus(store, "n0"),
                         steps=steps)  # fmt: skip
    monitor = hang_monitor.HangMonitor(HangConfig(period=3600.0))  # one round, at the watch's start
    try:
        monitor.on_workers_started(ctx)
        now = time.time()
        for step in range(3):
            steps.record(StepSample(0, step, now + 2.0 + 0.05 * step, 0.05))
        monitor.on_workers_stopped(ctx)
        assert monitor._learned.get(hang_monitor.FIRST_STEP, 0.0) >= 1.5
    finally:
        monitor.close()
        store.close()
