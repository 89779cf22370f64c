"""A hang verdict only on proof of a dead wait; a wait on the outside world is a named
suspicion. The classifier (detect.waits) and the stall verdict over synthetic kernel facts, the
kernel probes (probes.waits) on real processes, and real gloo jobs through the hang monitor."""

from __future__ import annotations

import fcntl
import functools
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from tgtest import SCRIPTS, wait_for

from trainguard.detect.culprit import RankView, find_culprit
from trainguard.detect.hang import HangConfig
from trainguard.detect.progress import STALLED, Progress, RankSamples, judge_progress
from trainguard.detect.verdict import JobWindow, Limits, judge_stall
from trainguard.detect.waits import Wait, classify_wait
from trainguard.probes import proc, waits
from trainguard.probes.stacks import Frame
from trainguard.probes.waits import FdFact, ProcInfo, Syscall, TcpSock, WaitFacts

SP = "/venv/lib/python3.11/site-packages/torch"
C10D = f"{SP}/distributed/distributed_c10d.py"
CFG = HangConfig(period=1.0, detect_time=600.0, window=5.0)


def c10d(op: str, line: int = 70) -> tuple[Frame, ...]:
    return (Frame(op, C10D, 2500), Frame("train", "/job/train.py", line), Frame("<module>", "/job/train.py", 200))


def user(func: str = "fetch", line: int = 60) -> tuple[Frame, ...]:
    return (Frame(func, "/job/train.py", line), Frame("<module>", "/job/train.py", 200))


def sock(state: str = "ESTABLISHED", received: int = 1 << 20) -> TcpSock:
    return TcpSock(7, state, ("127.0.0.1", 50000), ("10.0.0.9", 443), received, 300, 120)


def facts(call: str, *fds: FdFact, args: tuple[int, ...] = (), **kw) -> WaitFacts:
    return WaitFacts(1, Syscall(call, args), fds=fds, **kw)


STOPPED_SERVER = ProcInfo(99, "T", "python server.py")
LIVE_SERVER = ProcInfo(99, "S", "python server.py")


# --- detect.waits.classify_wait ---------------------------------------------------------------


def test_waits_socket_alive_is_named_with_peer_and_bytes() -> None:
    w = classify_wait(facts("recvfrom", FdFact(3, "socket", "socket:[7]", sock())))
    assert not w.dead and w.kind == "socket"
    assert "10.0.0.9:443" in w.what and "1.0 MB received" in w.what and "ESTABLISHED" in w.what


def test_waits_socket_dead_when_the_local_peer_is_stopped_or_the_connection_closed() -> None:
    stopped = classify_wait(facts("poll", FdFact(3, "socket", "socket:[7]", sock(), (STOPPED_SERVER,))))
    assert stopped.dead and "stopped" in stopped.proof and "pid 99" in stopped.proof
    live = classify_wait(facts("poll", FdFact(3, "socket", "socket:[7]", sock(), (LIVE_SERVER,))))
    assert not live.dead and "served by pid 99" in live.what
    closed = classify_wait(facts("recvfrom", FdFact(3, "socket", "socket:[7]", sock("CLOSE_WAIT"))))
    assert closed.dead and "CLOSE_WAIT" in closed.proof


def test_waits_pipe_only_the_rank_writes_is_dead_a_live_writer_is_not() -> None:
    assert classify_wait(facts("read", FdFact(5, "pipe", "pipe:[1]", self_writer=True))).dead
    live = classify_wait(facts("read", FdFact(5, "pipe", "pipe:[1]", others=(LIVE_SERVER,), self_writer=True)))
    assert not live.dead and "written by pid 99" in live.what
    assert classify_wait(facts("select", FdFact(5, "pipe", "pipe:[1]", others=(STOPPED_SERVER,)))).dead


def test_waits_child_lock_sleep_signal() -> None:
    kid = ProcInfo(42, "S", "aws s3 cp ckpt s3://bucket")
    w = classify_wait(facts("wait4", children=(kid,)))
    assert not w.dead and "pid 42 (aws s3 cp" in w.what
    assert classify_wait(facts("wait4", children=(ProcInfo(42, "T", "uploader"),))).dead
    # subprocess.run(timeout=...) polls waitpid between short sleeps: the frames say it is a child wait
    frames = (Frame("Popen._wait", "/usr/lib/python3.11/subprocess.py", 2040), *user())
    assert classify_wait(facts("clock_nanosleep", children=(ProcInfo(42, "T", "x"),)), frames).dead
    holder = classify_wait(facts("flock", lock_holders=(LIVE_SERVER,)))
    assert not holder.dead and "held by pid 99" in holder.what
    assert classify_wait(facts("flock", lock_self=True)).dead
    assert classify_wait(facts("flock", lock_holders=(STOPPED_SERVER,))).dead
    nap = classify_wait(facts("clock_nanosleep", sleep_left=35.0))
    assert not nap.dead and nap.sleep_left == 35.0 and "35s left" in nap.what
    assert classify_wait(facts("pause")).dead


def test_waits_own_lock_needs_no_timeout_user_frame_and_a_single_python_thread() -> None:
    no_timeout = (0, 0x80, 0, 0)
    assert classify_wait(facts("futex", args=no_timeout), user("own_lock"), python_threads=1).dead
    assert not classify_wait(facts("futex", args=no_timeout), user("own_lock"), python_threads=2).dead
    assert not classify_wait(facts("futex", args=(0, 0x80, 0, 0x7FFF0000)), user(), python_threads=1).dead
    lib = (Frame("Condition.wait", "/usr/lib/python3.11/threading.py", 320), *user())
    assert not classify_wait(facts("futex", args=no_timeout), lib, python_threads=1).dead


# --- the stall verdict with waits --------------------------------------------------------------


def samples(rank: int, stacks, state: str = "S", net=()) -> RankSamples:
    n = len(stacks)
    return RankSamples(rank, times=[100.0 + i for i in range(n)], states=[state] * n, cpu=[0.0] * n,
                       io=[(7, 0)] * n, stacks=list(stacks), net=list(net))  # fmt: skip


def limits(**kw) -> Limits:
    return Limits(threshold=5.0, detect_time=600.0, allowance=lambda r, ph: 5.0 if not ph else 60.0, **kw)

QUIET = JobWindow(io_quiet=700.0, util_flat=True)  # the seed's condition holds job-wide


def judged(views, stacks, **kw):
    verdict = find_culprit(views)
    return verdict, {r: judge_progress(samples(r, stacks[r], **kw.get(r, {})), CFG, verdict.positions[r].waiting)
                     for r in views}  # fmt: skip


def test_stall_idle_rank_on_a_live_socket_is_a_named_suspicion_until_detect_time() -> None:
    views = {0: RankView(0, "S", user("fetch")), 1: RankView(1, "S", c10d("barrier"))}
    verdict, progress = judged(views, {0: [user("fetch")] * 6, 1: [c10d("barrier")] * 6})
    live = {0: classify_wait(facts("recvfrom", FdFact(3, "socket", "socket:[7]", sock())))}
    sv = judge_stall(verdict, progress, 30.0, limits(), live)
    assert sv.state == "suspected" and sv.culprit == 0 and "10.0.0.9:443" in sv.why, sv
    assert judge_stall(verdict, progress, 600.0, limits(), live, job=QUIET).state == "detected"  # the seed's window
    dead = {0: classify_wait(facts("recvfrom", FdFact(3, "socket", "socket:[7]", sock(), (STOPPED_SERVER,))))}
    sv = judge_stall(verdict, progress, 8.0, limits(), dead)
    assert sv.state == "detected" and sv.culprit == 0 and "stopped" in sv.why


def test_stall_socket_bytes_are_progress() -> None:
    p = judge_progress(samples(0, [user("fetch")] * 6, net=[100, 4100, 8100, 12100, 16100, 20100]), CFG)
    assert p.kind == "progressing" and p.moved == ("net",)
    assert judge_progress(samples(0, [user("fetch")] * 6, net=[100] * 6), CFG).kind == "idle"


def test_stall_a_sleep_past_the_detect_window_is_proof_a_shorter_one_is_not() -> None:
    views = {0: RankView(0, "S", c10d("all_reduce")), 1: RankView(1, "S", user("backoff"))}
    verdict, progress = judged(views, {0: [c10d("all_reduce")] * 6, 1: [user("backoff")] * 6})
    short = {1: Wait("sleep", False, "a sleep (35s left)", sleep_left=35.0)}
    assert judge_stall(verdict, progress, 8.0, limits(), short).state == "suspected"
    long = {1: Wait("sleep", False, "a sleep (3590s left)", sleep_left=3590.0)}
    sv = judge_stall(verdict, progress, 8.0, limits(), long)
    assert sv.state == "detected" and sv.culprit == 1 and "--hang-detect-time" in sv.why


def test_stall_a_lone_idle_rank_is_waited_for_when_ranks_on_other_nodes_wait() -> None:
    views = {1: RankView(1, "S", user("backoff"))}  # node1's only rank; rank 0 (node0) waits in all_reduce
    verdict = find_culprit(views, nnodes=2)
    progress = {1: judge_progress(samples(1, [user("backoff")] * 6), CFG)}
    long = {1: Wait("sleep", False, "a sleep (3590s left)", sleep_left=3590.0)}
    assert judge_stall(verdict, progress, 8.0, limits(), long).state == "suspected"  # alone: nobody waits for it
    sv = judge_stall(verdict, progress, 8.0, limits(), long, others_wait=True)
    assert sv.state == "detected" and sv.culprit == 1


def test_stall_all_ranks_idle_with_nobody_waiting_is_never_a_fast_verdict() -> None:
    views = {r: RankView(r, "S", user("sleep_epoch")) for r in (0, 1)}
    verdict, progress = judged(views, {r: [user("sleep_epoch")] * 6 for r in (0, 1)})
    for w in ({}, {r: Wait("sleep", False, "a sleep", sleep_left=5000.0) for r in (0, 1)}):
        assert judge_stall(verdict, progress, 500.0, limits(), w).state == "suspected"
    assert judge_stall(verdict, progress, 600.0, limits(), {}, job=QUIET).state == "detected"


def test_stall_uninterruptible_sleep_is_proof_only_past_the_long_limit() -> None:
    views = {0: RankView(0, "D", user("sync")), 1: RankView(1, "S", c10d("barrier"))}
    verdict, progress = judged(views, {0: [user("sync")] * 6, 1: [c10d("barrier")] * 6})
    progress[0] = Progress(STALLED, seconds=5.0)
    assert judge_stall(verdict, progress, 30.0, limits(stalled_limit=120.0, stalled_for={0: 30.0}), {}).state == "watch"
    sv = judge_stall(verdict, progress, 130.0, limits(stalled_limit=120.0, stalled_for={0: 125.0}), {})
    assert sv.state == "detected" and sv.culprit == 0


def test_culprit_recv_that_nobody_sends_is_named() -> None:
    views = {0: RankView(0, "S", c10d("all_reduce")), 1: RankView(1, "S", c10d("recv", 90))}
    verdict = find_culprit(views)
    assert verdict.rank == 1 and "no rank is sending" in verdict.reason, verdict.reason
    views[0] = RankView(0, "S", c10d("send", 91))  # a matching send: not this rule's case
    assert find_culprit(views).rank is None


# --- probes.waits on real processes -------------------------------------------------------------


def _spawn(code: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", code], start_new_session=True)


_until = functools.partial(wait_for, timeout=30.0, every=0.05)  # the probes see a state within ms


def _reap(*procs: subprocess.Popen) -> None:
    for p in procs:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        p.wait(timeout=30)


def test_probe_socket_bytes_move_while_proc_io_stands_still() -> None:
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    reader = _spawn(f"import socket\ns = socket.create_connection(('127.0.0.1', {srv.getsockname()[1]}))\n"
                    "while s.recv_into(bytearray(4096)): pass")  # fmt: skip
    try:
        conn, _ = srv.accept()
        with conn:
            first = _until(lambda: waits.with_net(proc.sample_workers({0: reader.pid}, time.time()))[0])
            conn.sendall(b"x" * 50_000)
            later = _until(lambda: (s := waits.with_net(proc.sample_workers({0: reader.pid}, time.time()))[0]).net
                           and s.net >= (first.net or 0) + 50_000 and s)  # fmt: skip
            assert later.io is not None and first.io is not None
            assert later.io[0] - first.io[0] < 50_000  # rchar: recv() does not count there
            f = _until(lambda: (x := waits.wait_facts(reader.pid)).fds and x)
            w = classify_wait(f)
            assert w.kind == "socket" and not w.dead and "127.0.0.1" in w.what, w
    finally:
        srv.close()
        _reap(reader)


def test_probe_dead_waits_on_real_processes(tmp_path: Path) -> None:
    pipe = _spawn("import os\nr, w = os.pipe()\nos.read(r, 1)")
    lock = tmp_path / "x.lock"
    flock = _spawn(f"import fcntl\na = open({str(lock)!r}, 'a+'); b = open({str(lock)!r}, 'a+')\n"
                   "fcntl.flock(a, fcntl.LOCK_EX); fcntl.flock(b, fcntl.LOCK_EX)")  # fmt: skip
    sleeper = _spawn("import time\ntime.sleep(300)")
    held = open(lock.with_suffix(".other"), "a+")  # noqa: SIM115 (held across the test)
    fcntl.flock(held, fcntl.LOCK_EX)
    waiter = _spawn(f"import fcntl\nfcntl.flock(open({str(held.name)!r}, 'a+'), fcntl.LOCK_EX)")
    try:
        w = _until(lambda: (x := classify_wait(waits.wait_facts(pipe.pid))).dead and x)
        assert w.kind == "pipe" and "only writer is the rank itself" in w.proof
        w = _until(lambda: (x := classify_wait(waits.wait_facts(flock.pid))).dead and x)
        assert w.kind == "flock" and "holds that lock itself" in w.proof
        w = _until(lambda: (x := classify_wait(waits.wait_facts(sleeper.pid))).kind == "sleep" and x)
        assert not w.dead and w.sleep_left is not None and 200 < w.sleep_left <= 300
        w = _until(lambda: (x := classify_wait(waits.wait_facts(waiter.pid))).kind == "flock" and x)
        assert not w.dead and f"held by pid {os.getpid()}" in w.what, w
    finally:
        held.close()
        _reap(pipe, flock, sleeper, waiter)


# --- real gloo jobs (wait patterns, tuned split) ------------------------------------------------

sys.path.insert(0, str(SCRIPTS))
WAITS = SCRIPTS / "wait_patterns.py"


@pytest.mark.slow
@pytest.mark.parametrize("pattern", ["http_download", "child_idle"])
def test_hang_waits_healthy_wait_is_a_named_suspicion_not_a_hang(tmp_path: Path, pattern: str) -> None:
    from hang_harness import hang_events, run_job

    from trainguard.monitors.hang.monitor import HangMonitor

    cfg = HangConfig(period=0.5, step_slack=3.0)
    attempts, detected = run_job(tmp_path, HangMonitor(cfg), 2, ["--pattern", pattern, "--wait-s", "15"],
                                 deadline_s=300.0, max_attempts=1, worker=WAITS)  # fmt: skip
    seen = [(e.kind, e.message) for e in hang_events(tmp_path)]
    assert detected == [] and attempts[0].decision is None, seen
    assert attempts[0].returncodes == {0: 0, 1: 0}, seen
    suspected = [e for e in hang_events(tmp_path) if e.kind == "hang_suspected"]
    assert suspected and suspected[0].rank == 0, seen
    named = {"http_download": "socket to 127.0.0.1:", "child_idle": "its child pid "}[pattern]
    assert named in suspected[0].message, suspected[0].message


@pytest.mark.slow
def test_hang_waits_async_collective_waited_on_is_no_own_lock(tmp_path: Path) -> None:
    # Rank 0 in Work.wait() of an async all_reduce (a futex from its own line, one Python thread)
    # while rank 1 is 15 s late to join: gloo's native thread releases that wait, so it is no
    # self-deadlock. torch's Flight Recorder shows the call in flight. Before: "re-acquiring its
    # own lock", a healthy job killed after 9 s.
    from hang_harness import hang_events, run_job

    from trainguard.monitors.hang.monitor import HangMonitor

    cfg = HangConfig(period=0.5, step_slack=3.0)
    attempts, detected = run_job(tmp_path, HangMonitor(cfg), 2, ["--pattern", "async_peer_pause", "--wait-s", "15"],
                                 deadline_s=300.0, max_attempts=1, worker=WAITS)  # fmt: skip
    seen = [(e.kind, e.message) for e in hang_events(tmp_path)]
    assert detected == [] and attempts[0].decision is None, seen
    assert attempts[0].returncodes == {0: 0, 1: 0}, seen
    waits = [e.evidence.get("wait") or {} for e in hang_events(tmp_path) if e.kind == "hang_suspected"]
    assert any("all_reduce #" in (w.get("what") or "") and "in flight" in w["what"] for w in waits), seen


def test_a_futex_with_a_collective_in_flight_is_not_proof() -> None:
    from types import SimpleNamespace

    frames = [SimpleNamespace(name="step", filename="/home/u/train.py", line=40)]
    facts = SimpleNamespace(syscall=SimpleNamespace(name="futex", args=[1, 128, 0, 0]), children=[], fds=[],
                            lock_holders=[], lock_self=False, sleep_left=None, wchan="")  # fmt: skip
    assert classify_wait(facts, frames, 1).dead  # the own-lock rule, unchanged without a collective in flight
    w = classify_wait(facts, frames, 1, "all_reduce #21 of process group 0 (default_pg)")
    assert not w.dead and "all_reduce #21" in w.what and "in flight" in w.what


@pytest.mark.slow
@pytest.mark.parametrize(("pattern", "culprit", "kind"), [("http_server_stopped", 0, "poll"), ("p2p_recv", 1, None),
                                                          ("own_lock", 0, "lock")])  # fmt: skip
def test_hang_waits_dead_wait_detected_with_culprit(tmp_path: Path, pattern: str, culprit: int, kind: str | None) -> None:
    from hang_harness import hang_events, run_job

    from trainguard.monitors.hang.monitor import HangMonitor

    cfg = HangConfig(period=0.5, step_slack=3.0)
    attempts, detected = run_job(tmp_path, HangMonitor(cfg), 2, ["--pattern", pattern, "--wait-s", "15"],
                                 deadline_s=150.0, max_attempts=2, worker=WAITS)  # fmt: skip
    seen = [(e.kind, e.message) for e in hang_events(tmp_path)]
    assert len(detected) == 1 and detected[0].rank == culprit and detected[0].evidence["rule"] == "steps", seen
    if kind is not None:
        wait = detected[0].evidence["wait"]  # urllib polls its socket (a timeout) before each recv
        assert wait["kind"] == kind and wait["dead"] and wait["proof"], seen
    assert attempts[1].decision is None and attempts[1].returncodes == {0: 0, 1: 0}  # restarted, healthy


# --- two ranks in two different collectives: the sequence numbers (detect.sequence) -------------


def test_sequence_names_both_calls_and_the_rank_out_of_sequence() -> None:
    from trainguard.detect.sequence import InCall, compare_sequences
    from trainguard.probes.ring_reader import CollectiveCounts

    calls = {0: InCall("all_reduce", "job.py:30 in <module>"), 1: InCall("barrier", "job.py:34 in <module>")}
    skip = {0: CollectiveCounts(21, "all_reduce", {"all_reduce": 20}),
            1: CollectiveCounts(21, "barrier", {"all_reduce": 19, "barrier": 1})}  # fmt: skip
    f = compare_sequences(calls, skip)
    assert f.out_of_sequence == [1] and "made 19 all_reduce calls to rank 0's 20" in f.why, f
    assert f.lines[0] == "rank 0: in all_reduce at job.py:30 in <module>: collective #21 of the rank, its all_reduce call #20"
    assert compare_sequences({0: calls[0], 1: InCall("all_reduce")}, skip).lines == []  # one call: nothing to say
    fresh = {0: CollectiveCounts(1, "broadcast", {"broadcast": 1}), 1: CollectiveCounts(1, "barrier", {"barrier": 1})}
    assert compare_sequences({0: InCall("broadcast"), 1: InCall("barrier")}, fresh).out_of_sequence == []
    behind = {0: CollectiveCounts(9, "all_reduce", {"all_reduce": 9}), 1: CollectiveCounts(8, "barrier", {"barrier": 8})}
    assert compare_sequences(calls, behind).out_of_sequence == [1]
    three = {**skip, 2: CollectiveCounts(21, "all_reduce", {"all_reduce": 20})}
    assert compare_sequences({**calls, 2: calls[0]}, three).out_of_sequence == [1]


@pytest.mark.slow
def test_sequence_real_job_rank_that_skipped_an_all_reduce_is_named(jobs, tmp_path: Path) -> None:
    from tgtest import events

    run = tmp_path / "run"
    job = jobs("run", "--standalone", "--nproc-per-node", "2", "--max-restarts", "1", "--run-dir", run,
               "--hang-period", "0.5", "--hang-step-slack", "3", SCRIPTS / "skip_collective.py")  # fmt: skip
    assert job.wait() == 0, job.output()[-4000:]
    (hang,) = events(run, "hang_detected")
    seq = hang.evidence["sequence"]
    assert seq["out_of_sequence"] == [1], (hang.message, seq)
    # From torch's own Flight Recorder (the worker serves it; torch numbers the calls per group).
    assert seq["lines"][0] == "torch Flight Recorder, process group 0 (default_pg):", seq
    assert seq["lines"][1].startswith("rank 0: in all_reduce at skip_collective.py:"), seq
    assert seq["lines"][2].startswith("rank 1: in barrier at skip_collective.py:"), seq
    flight = hang.evidence["flight_recorder"]
    assert flight["0"]["0"]["in_flight"]["op"] == "all_reduce" and flight["1"]["0"]["in_flight"]["op"] == "barrier"
    assert flight["0"]["0"]["in_flight"]["seq"] == flight["1"]["0"]["in_flight"]["seq"], flight
    report = Path(hang.evidence["report"]).read_text()
    assert "collective sequence (ranks in different collectives):" in report and "out of sequence: rank 1" in report
