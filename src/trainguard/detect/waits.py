"""What a blocked rank waits on, and whether that wait can ever end. Pure: takes the
kernel's facts (probes.waits.WaitFacts, or anything shaped like it) and the rank's innermost
frames as data.

A fast ``hang_detected`` needs *proof* that a wait is dead; a wait on the outside world is only a
named suspicion. Dead (``Wait.dead``):

- a socket whose other end is a local process that is stopped (state T) or gone, or a connection
  the peer closed or reset while the rank still waits on it;
- a pipe or FIFO whose only writers are the rank itself or stopped processes;
- a child process it waits for that is stopped;
- a file lock (flock/fcntl) held by the rank itself (a self-deadlock) or by a stopped process;
- a Python lock acquired with no timeout from the rank's own code while no other Python thread
  exists that could release it (a thread re-acquiring its own lock);
- ``pause()``/``sigsuspend()``: nothing but a signal ends it, and nobody sends one;
- trainguard's own chaos hold (``chaos_hang_before_collective``): held until the job restarts.

Alive (a suspicion, named): an established connection (peer address, bytes received so far), a
live child (pid, command, state), a lock held by another live process, select/poll/epoll on
external fds, a sleep (and how long it has left), a sync in progress, anything unknown.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from trainguard.detect.culprit import FrameLike, is_library

CLOSED = ("CLOSE_WAIT", "CLOSE", "LAST_ACK", "TIME_WAIT", "CLOSING")
_SOCKET_CALLS = ("read", "readv", "recvfrom", "recvmsg", "accept", "accept4", "connect", "write", "writev",
                 "sendto", "sendmsg")  # fmt: skip
_POLL_CALLS = ("poll", "ppoll", "select", "pselect6", "epoll_wait", "epoll_pwait", "epoll_pwait2")
_SIGNAL_CALLS = ("pause", "rt_sigsuspend")
_SYNC_CALLS = ("sync", "syncfs", "fsync", "fdatasync")
_SLEEP_CALLS = ("clock_nanosleep", "nanosleep")
CHAOS_HOLD = "chaos_hang_before_collective"


class ProcLike(Protocol):
    pid: int
    state: str
    cmd: str

    def describe(self) -> str: ...


@dataclass(frozen=True)
class Wait:
    kind: str  # socket pipe child lock flock sleep signal poll sync file running chaos unknown
    dead: bool  # proof that it never ends
    what: str  # what the rank waits on, named: "socket 127.0.0.1:8000 (ESTABLISHED, 1.2 MB received ...)"
    proof: str = ""  # why it is dead
    sleep_left: float | None = None  # a sleep: seconds until it ends (None: unknown)
    syscall: str = ""

    def describe(self) -> str:
        return f"{self.what}: {self.proof}" if self.dead else self.what

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "dead": self.dead, "what": self.what, "proof": self.proof, "syscall": self.syscall,
                "sleep_left_s": None if self.sleep_left is None else round(self.sleep_left, 1)}  # fmt: skip


def _size(n: int) -> str:
    for unit, div in (("GB", 1 << 30), ("MB", 1 << 20), ("KB", 1 << 10)):
        if n >= div:
            return f"{n / div:.1f} {unit}"
    return f"{n} B"


def _dead_procs(procs: Sequence[ProcLike]) -> bool:
    """Every one of them is stopped, gone, or stuck for ever (probes.waits.stuck_reason)."""
    return bool(procs) and all(p.state in ("T", "t", "", "Z", "X") or getattr(p, "stuck", "") for p in procs)


def _stuck_text(procs: Sequence[ProcLike]) -> str:
    """Why the stuck ones among ``procs`` can never act ("" when none is)."""
    return "; ".join(f"pid {p.pid}: {p.stuck}" for p in procs if getattr(p, "stuck", ""))


def _proc_text(procs: Sequence[ProcLike]) -> str:
    return ", ".join(p.describe() for p in procs[:3])


def _socket(fd: Any) -> Wait:
    s = fd.sock
    if s is None:
        return Wait("socket", False, f"socket fd {fd.fd} (not TCP, or unreadable)")
    peer = f"{s.remote[0]}:{s.remote[1]}"
    got = [] if s.received is None else [f"{_size(s.received)} received"]
    if s.acked is not None and s.acked > 1:
        got.append(f"{_size(s.acked)} sent")
    if s.last_recv_ms is not None:
        got.append(f"last data {s.last_recv_ms / 1000:.1f}s ago")
    what = f"socket to {peer} ({s.state}{', ' + ', '.join(got) if got else ''})"
    if s.state in CLOSED:
        return Wait("socket", True, what, f"the connection is {s.state}: the peer closed it and no data can come")
    if _dead_procs(fd.others):
        stuck = _stuck_text(fd.others)
        return Wait("socket", True, what, f"the peer process {_proc_text(fd.others)} is stopped or gone"
                    + (f" or stuck ({stuck})" if stuck else ""))  # fmt: skip
    if fd.others:
        what += f", served by {_proc_text(fd.others)}"
    return Wait("socket", False, what)


def _pipe(fd: Any) -> Wait:
    what = f"pipe {fd.target}"
    if fd.others:
        what += f" written by {_proc_text(fd.others)}"
    if not fd.others and fd.self_writer:
        return Wait("pipe", True, what, "its only writer is the rank itself: nobody else can write to it")
    if fd.others and _dead_procs(fd.others):
        stuck = _stuck_text(fd.others)
        return Wait("pipe", True, what, "every other writer is stopped or gone" + (f" or stuck ({stuck})" if stuck else ""))
    return Wait("pipe", False, what)


def _fd_wait(fd: Any) -> Wait:
    if fd.kind == "socket":
        return _socket(fd)
    if fd.kind == "pipe":
        return _pipe(fd)
    return Wait(fd.kind or "unknown", False, f"fd {fd.fd} ({fd.target or 'unreadable'})")


_SUBPROCESS_WAITS = ("wait", "_wait", "_try_wait", "communicate", "_communicate", "run", "call", "check_call",
                     "check_output")  # fmt: skip


def _in_subprocess(frames: Sequence[FrameLike]) -> bool:
    """Waiting for a child in the subprocess module (its innermost Python frames)."""
    return any(f.filename.replace("\\", "/").endswith("/subprocess.py")
               and f.name.rsplit(".", 1)[-1] in _SUBPROCESS_WAITS
               for f in frames[:4])  # fmt: skip


def _innermost_user(frames: Sequence[FrameLike]) -> bool:
    return bool(frames) and not is_library(frames[0].filename)


def classify_wait(facts: Any, frames: Sequence[FrameLike] = (), python_threads: int = 0,
                  in_flight: str = "", python_tids: Sequence[int] = ()) -> Wait:  # fmt: skip
    """The wait of one rank's main thread. ``facts``: probes.waits.WaitFacts; ``frames``: its
    Python stack, innermost first; ``python_threads``: threads with Python frames (py-spy);
    ``in_flight``: the collective torch's Flight Recorder shows the rank has started and not
    finished ("all_reduce #12 of process group 0"), if any; ``python_tids``: the kernel tasks of
    those Python threads (py-spy's os thread ids)."""
    if frames and frames[0].name == CHAOS_HOLD:
        return Wait("chaos", True, "trainguard chaos hang", "held by `trainguard chaos hang` until the job restarts")
    call = facts.syscall.name
    kids = [c for c in facts.children if c.state not in ("Z", "X", "")]
    if call in ("wait4", "waitid") or _in_subprocess(frames):
        # (subprocess.run with a timeout polls waitpid between short sleeps: the frames say it)
        what = f"its child {_proc_text(kids)}" if kids else "a child process"
        if any(c.state in ("T", "t") for c in kids):
            return Wait("child", True, what, "the child is stopped", syscall=call)
        if kids and all(getattr(c, "stuck", "") for c in kids):
            return Wait("child", True, what, f"the child can never act: {_stuck_text(kids)}", syscall=call)
        return Wait("child", False, what, syscall=call)
    if call in ("flock", "fcntl"):
        what = "a file lock" + (f" held by {_proc_text(facts.lock_holders)}" if facts.lock_holders else "")
        if facts.lock_self:
            return Wait("flock", True, what or "a file lock", "the rank holds that lock itself (another open file)", syscall=call)
        if _dead_procs(facts.lock_holders):
            return Wait("flock", True, what, "the holder is stopped or gone", syscall=call)
        return Wait("flock", False, what, syscall=call)
    if call in _SOCKET_CALLS and facts.fds:
        w = _fd_wait(facts.fds[0])
        return Wait(w.kind, w.dead, w.what, w.proof, syscall=call)
    if call in _POLL_CALLS:
        ws = [_fd_wait(fd) for fd in facts.fds]
        what = "select/poll on " + ("; ".join(w.what for w in ws) if ws else "fds")
        if any(c.state in ("T", "t") for c in kids):
            what += f"; its child {_proc_text([c for c in kids if c.state in ('T', 't')])} is stopped"
        if ws and all(w.dead for w in ws):
            return Wait("poll", True, what, "; ".join(w.proof for w in ws), syscall=call)
        return Wait("poll", False, what, syscall=call)
    if call in _SLEEP_CALLS:
        left = facts.sleep_left
        what = "a sleep" + (f" ({left:.0f}s left)" if left is not None else "")
        return Wait("sleep", False, what, sleep_left=left, syscall=call)
    if call in _SIGNAL_CALLS:
        return Wait("signal", True, f"{call}()", "only a signal ends it, and none is coming", syscall=call)
    if call in _SYNC_CALLS:
        return Wait("sync", False, f"{call}() flushing to storage", syscall=call)
    if call == "futex":
        return _futex(facts, frames, python_threads, in_flight, python_tids)
    if call == "running":
        return Wait("running", False, "on CPU", syscall=call)
    return Wait("unknown", False, f"system call {call or 'unreadable'}" + (f" ({facts.wchan})" if facts.wchan else ""),
                syscall=call)  # fmt: skip


def _futex(facts: Any, frames: Sequence[FrameLike], python_threads: int, in_flight: str = "",
           python_tids: Sequence[int] = ()) -> Wait:  # fmt: skip
    """A lock or condition. From the rank's own code with no timeout and no other Python thread
    that could ever release it, it is the rank re-acquiring a lock it holds; with several Python
    threads, when every one of them waits on a process-private lock with no timeout (a lock-order
    deadlock: Python locks are released by Python code, and none is left running). Unless the rank
    has a collective in flight: a native thread of its backend releases the condition that
    ``Work.wait()`` (an async collective) waits on when the peers join, and no Python thread takes
    part in that."""
    args = facts.syscall.args
    no_timeout = len(args) >= 4 and args[3] == 0
    where = f"{frames[0].filename.rsplit('/', 1)[-1]}:{frames[0].line} in {frames[0].name}" if frames else "?"
    what = f"a lock at {where}"
    if in_flight:
        return Wait("lock", False, f"{what}, with {in_flight} in flight (its completion releases a Work.wait())",
                    syscall="futex")  # fmt: skip
    if no_timeout and _innermost_user(frames) and python_threads == 1:
        return Wait("lock", True, what, "no timeout and no other Python thread could release it (re-acquiring its "
                    "own lock)", syscall="futex")  # fmt: skip
    # (the probe decodes the futex calls: probes.waits.forever_futex, per thread)
    locked = getattr(facts, "locked", frozenset())
    if (len(python_tids) >= 2 and len(python_tids) == python_threads and facts.pid in locked
            and all(t in locked for t in python_tids)):  # fmt: skip
        return Wait("lock", True, what, f"all {len(python_tids)} Python threads wait on process-private locks with no "
                    "timeout: none is left running to release them (a lock-order deadlock)", syscall="futex")  # fmt: skip
    return Wait("lock", False, what + (f" ({python_threads} Python threads)" if python_threads else ""), syscall="futex")
