"""Deadlocks proven from the kernel's view: every Python thread of a rank on a private lock with no
timeout, a pipe whose only writer is stuck (on its own locks, or writing to a full pipe only the
waiting rank reads: a wait-for cycle), and the healthy look-alikes (a thread waiting for a worker
thread that computes, a pipe whose writer is slow but running). Pure rules over facts, then the
probes on real processes."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from trainguard.detect.waits import classify_wait
from trainguard.probes.stacks import Frame
from trainguard.probes.waits import (
    FdFact,
    ProcInfo,
    Syscall,
    WaitFacts,
    forever_futex,
    stuck_reason,
    wait_facts,
)

LOCK = Syscall("futex", (0x5600, 0x189, 0, 0))  # FUTEX_WAIT_BITSET | PRIVATE | CLOCK_REALTIME, no timeout
TIMED = Syscall("futex", (0x5600, 0x189, 0, 0x7FFE0000))  # the same with a timeout
SHARED = Syscall("futex", (0x5600, 0x109, 0, 0))  # not private: another process may wake it
SLEEP = Syscall("clock_nanosleep", (1, 1, 0x7FFE0000))
USER = (Frame("thread_deadlock", "/job/train.py", 88), Frame("<module>", "/job/train.py", 200))


def facts(main: Syscall, tasks: dict[int, Syscall], *fds: FdFact) -> WaitFacts:
    """Facts of pid 10 whose threads (tid -> call) are ``tasks``, as probes.waits.wait_facts builds them."""
    return WaitFacts(10, main, fds=fds, threads=len(tasks),
                     locked=frozenset(t for t, c in tasks.items() if forever_futex(c)))  # fmt: skip


def test_forever_futex_needs_private_and_no_timeout() -> None:
    assert forever_futex(LOCK)
    assert not forever_futex(TIMED) and not forever_futex(SHARED) and not forever_futex(SLEEP)


def test_every_python_thread_on_a_private_lock_is_a_deadlock() -> None:
    """Two Python threads, each holding the lock the other waits for; native threads (gloo's loop,
    the recorder's server) are not Python threads and release no Python lock."""
    tasks = {10: LOCK, 11: LOCK, 12: Syscall("epoll_wait", (8, 0, 64, 10)), 13: Syscall("accept4")}
    w = classify_wait(facts(LOCK, tasks), USER, python_threads=2, python_tids=[10, 11])
    assert w.dead and w.kind == "lock" and "lock-order deadlock" in w.proof
    # a collective in flight: its completion (a native thread) releases a Work.wait()
    w = classify_wait(facts(LOCK, tasks), USER, 2, "all_reduce #4 of process group 0", [10, 11])
    assert not w.dead


@pytest.mark.parametrize("other", [SLEEP, TIMED, SHARED, Syscall("running")])
def test_a_python_thread_that_can_still_run_is_no_deadlock(other: Syscall) -> None:
    """The healthy look-alike: the main thread waits for a lock a worker thread holds while that
    thread computes, sleeps, waits with a timeout or on a shared lock."""
    w = classify_wait(facts(LOCK, {10: LOCK, 11: other}), USER, python_threads=2, python_tids=[10, 11])
    assert not w.dead
    # and a Python thread py-spy saw but whose task is unknown proves nothing
    assert not classify_wait(facts(LOCK, {10: LOCK}), USER, python_threads=2, python_tids=[10, 11]).dead


def test_a_pipe_whose_only_writer_is_stuck_is_dead_a_slow_writer_is_not() -> None:
    stuck = ProcInfo(20, "S", "python decoder.py", stuck="blocked writing to a full pipe that only pid 10 reads")
    w = classify_wait(facts(Syscall("read", (5,)), {10: Syscall("read", (5,))},
                            FdFact(5, "pipe", "pipe:[77]", others=(stuck,))))  # fmt: skip
    assert w.dead and "stuck (pid 20: blocked writing" in w.proof
    slow = ProcInfo(20, "S", "python decoder.py")
    assert not classify_wait(facts(Syscall("read", (5,)), {}, FdFact(5, "pipe", "pipe:[77]", others=(slow,)))).dead


def test_a_child_whose_threads_are_all_stuck_is_a_dead_wait() -> None:
    child = ProcInfo(30, "S", "python loader_worker", stuck="all 1 of its threads wait on process-private locks")
    f = WaitFacts(10, Syscall("wait4"), children=(child,))
    assert classify_wait(f).dead
    assert not classify_wait(WaitFacts(10, Syscall("wait4"), children=(ProcInfo(30, "S", "python x"),))).dead


# --- the probes, on real processes ----------------------------------------------------------------

DEADLOCK = """
import threading
a, b = threading.Lock(), threading.Lock()
both = threading.Barrier(2)
def other():
    with b:
        both.wait()
        a.acquire()
threading.Thread(target=other, daemon=True).start()
with a:
    both.wait()
    print("ready", flush=True)
    b.acquire()
"""

COMPUTING = """
import threading, time
lock = threading.Lock()
def worker():
    with lock:
        end = time.monotonic() + 120
        x = 0
        while time.monotonic() < end:
            x += 1
t = threading.Thread(target=worker, daemon=True)
t.start()
time.sleep(0.2)
print("ready", flush=True)
lock.acquire()
"""

CYCLE = """
import os, subprocess, sys
path = sys.argv[1]
os.mkfifo(path, 0o600)
code = ("import os, sys\\n"
        f"fd = os.open({path!r}, os.O_WRONLY)\\n"
        "sys.stderr.buffer.write(b'warning\\\\n' * 200000)\\n"
        "sys.stderr.flush()\\n"
        "os.write(fd, b'frame')\\n")
child = subprocess.Popen([sys.executable, "-c", code], stderr=subprocess.PIPE)
fd = os.open(path, os.O_RDONLY)
print("ready", child.pid, flush=True)
os.read(fd, 64)
"""

SLOW_WRITER = """
import os, subprocess, sys
path = sys.argv[1]
os.mkfifo(path, 0o600)
code = (f"import os, time\\nfd = os.open({path!r}, os.O_WRONLY)\\ntime.sleep(120)\\nos.write(fd, b'frame')\\n")
child = subprocess.Popen([sys.executable, "-c", code])
fd = os.open(path, os.O_RDONLY)
print("ready", child.pid, flush=True)
os.read(fd, 64)
"""


def _start(code: str, *args: str) -> subprocess.Popen:
    p = subprocess.Popen([sys.executable, "-c", code, *args], stdout=subprocess.PIPE, text=True, start_new_session=True)
    assert p.stdout is not None and p.stdout.readline().startswith("ready")
    return p


def _stop(p: subprocess.Popen) -> None:
    try:
        os.killpg(p.pid, 9)
    except ProcessLookupError:
        pass
    p.wait(timeout=30)


def _until(check, deadline_s: float = 60.0):
    """The first truthy value of ``check()`` within the deadline (None if none came)."""
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        got = check()
        if got:
            return got
        time.sleep(0.2)
    return None


def test_probe_a_real_lock_order_deadlock_is_stuck_a_computing_holder_is_not() -> None:
    dead = _start(DEADLOCK)
    busy = _start(COMPUTING)
    try:
        assert "wait on process-private locks" in (_until(lambda: stuck_reason(dead.pid, os.getpid())) or "")
        f = wait_facts(dead.pid)
        assert f.threads == 2 and len(f.locked) == 2 and dead.pid in f.locked
        # the holder computes: never stuck, however often it is looked at
        for _ in range(10):
            assert stuck_reason(busy.pid, os.getpid()) == ""
    finally:
        _stop(dead)
        _stop(busy)


def test_probe_a_real_pipe_cycle_is_dead_a_slow_writer_is_not(tmp_path: Path) -> None:
    cycle = _start(CYCLE, str(tmp_path / "cycle.fifo"))
    slow = _start(SLOW_WRITER, str(tmp_path / "slow.fifo"))
    try:
        w = _until(lambda: (x := classify_wait(wait_facts(cycle.pid))).dead and x)
        assert w and w.kind == "pipe" and "wait-for cycle" in w.proof, w
        for _ in range(10):
            assert not classify_wait(wait_facts(slow.pid)).dead  # the writer sleeps: it will write
    finally:
        _stop(cycle)
        _stop(slow)
