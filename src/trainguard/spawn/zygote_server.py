"""The loop inside the zygote: a process that imported torch once and forks workers from it.

Started by the agent (spawn/zygote.py) as ``python -u -m trainguard.spawn.worker_main --zygote FD``
with FD one end of a SOCK_SEQPACKET socket pair. It imports what a worker needs
(``torch_compat.preimport``: torch, and torch._dynamo that DDP imports lazily), makes sure it is
single-threaded, freezes the garbage collector's view of the imported objects (so children do not
copy those pages by touching them) and answers requests:

- agent -> zygote ``{"op": "fork", "id": N}`` with three file descriptors (SCM_RIGHTS): the
  child's stdin (read end of the pipe its assignment arrives on), stdout and stderr (write ends of
  the agent's per-rank log pipes).
- zygote -> agent ``{"ready": ...}`` once, ``{"forked": N, "pid": P}`` per request (only after the
  child has its own session and its death signal, so the agent may signal its group at once) and
  ``{"exit": P, "status": S}`` when a child ends (S: the raw wait status; the zygote is the child's
  parent, so only it can read the exit code).

``serve`` returns only in a forked child, which then reads its assignment like a pre-started
worker (worker_main). The zygote's own process ends when the agent closes its end of the socket
(or dies: the zygote has PR_SET_PDEATHSIG, and so has every child, towards the zygote).

Why the zygote must have no threads when it forks: a thread holding a lock (malloc's, an OpenMP
pool's) at fork time leaves that lock held forever in the child. ``import torch`` starts one
thread, OpenBLAS's pool (through numpy); OpenBLAS shuts its pool down in a pthread_atfork handler,
so one probe fork after the imports leaves the zygote with its main thread alone. Anything else
that starts a thread makes the zygote refuse to fork (the agent falls back to fresh processes).
"""

from __future__ import annotations

import array
import gc
import json
import os
import selectors
import signal
import socket
import sys
import time
from collections.abc import Callable

MAX_FDS = 3


def thread_names() -> list[str]:
    """Names of this process's threads (from /proc: native threads included)."""
    names = []
    for tid in sorted(os.listdir("/proc/self/task")):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                names.append(f"{tid}:{f.read().strip()}")
        except OSError:
            continue
    return names


def _probe_fork() -> None:
    """One throwaway fork: libraries' pthread_atfork handlers stop their pools (OpenBLAS)."""
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)


def prepare(preimport: Callable[[], None]) -> dict:
    """Import, then check this process may fork. Returns the ready message."""
    try:
        os.close(os.pidfd_open(os.getpid()))  # children's exits are watched through pidfds (Linux >= 5.3)
    except (AttributeError, OSError) as exc:
        return {"ready": False, "error": f"no pidfd support: {exc}"}
    t0 = time.perf_counter()
    preimport()
    imported = time.perf_counter() - t0
    if len(thread_names()) > 1:
        _probe_fork()
    threads = thread_names()
    gc.collect()
    gc.freeze()  # imported objects stay out of the children's collections: fewer pages copied
    msg = {"ready": True, "import_s": round(imported, 3), "pid": os.getpid()}
    if len(threads) > 1:
        msg = {"ready": False, "error": f"the zygote has {len(threads)} threads after importing torch: {threads}"}
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():  # a forked child cannot use CUDA then
        msg = {"ready": False, "error": "CUDA was initialized while importing"}
    return msg


def _send(sock: socket.socket, msg: dict) -> None:
    sock.send(json.dumps(msg).encode())


def _recv(sock: socket.socket) -> tuple[dict | None, list[int]]:
    fds = array.array("i")
    data, ancdata, _flags, _addr = sock.recvmsg(4096, socket.CMSG_LEN(MAX_FDS * fds.itemsize))
    for level, kind, payload in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(payload[: len(payload) - (len(payload) % fds.itemsize)])
    if not data:
        for fd in fds:
            os.close(fd)
        return None, []
    return json.loads(data), list(fds)


class _Server:
    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.sel = selectors.DefaultSelector()
        self.children: dict[int, int] = {}  # pid -> pidfd
        self.sel.register(sock, selectors.EVENT_READ, None)

    def loop(self) -> list[int] | None:
        """Serve until the agent hangs up (returns None) or this is a forked child (its fds)."""
        while True:
            for key, _ in self.sel.select():
                if key.data is None:
                    msg, fds = _recv(self.sock)
                    if msg is None:
                        self.shutdown()
                        return None
                    got = self.fork(msg, fds)
                    if got is not None:
                        return got
                else:
                    self.reap(key.data, key.fd)

    def fork(self, msg: dict, fds: list[int]) -> list[int] | None:
        if msg.get("op") != "fork" or len(fds) != MAX_FDS:
            for fd in fds:
                os.close(fd)
            _send(self.sock, {"forked": msg.get("id"), "error": f"bad request {msg!r} with {len(fds)} fds"})
            return None
        threads = thread_names()
        if len(threads) > 1:  # something started a thread since we were ready: forking is unsafe now
            for fd in fds:
                os.close(fd)
            _send(self.sock, {"forked": msg["id"], "error": f"zygote is not single-threaded: {threads}"})
            return None
        ready_r, ready_w = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(ready_r)
            self._become_child(fds, ready_w)
            return fds
        os.close(ready_w)
        for fd in fds:
            os.close(fd)
        ok = os.read(ready_r, 1) == b"1"  # the child has its own session and death signal
        os.close(ready_r)
        pidfd = os.pidfd_open(pid)
        self.children[pid] = pidfd
        self.sel.register(pidfd, selectors.EVENT_READ, pid)
        _send(self.sock, {"forked": msg["id"], "pid": pid} if ok else {"forked": msg["id"], "error": "child died at start"})
        return None

    def _become_child(self, fds: list[int], ready_w: int) -> None:
        zygote = os.getppid()
        self.sel.close()
        self.sock.close()
        for pidfd in self.children.values():
            os.close(pidfd)
        os.setsid()  # its own session and process group: the agent signals the group
        _restore_stop_signals()  # a worker takes SIGTERM like any fresh process
        from trainguard.spawn.parent import die_with_parent

        die_with_parent()
        if os.getppid() != zygote:
            os._exit(1)  # the zygote died before the death signal was armed
        for target, fd in zip((0, 1, 2), fds, strict=True):
            os.dup2(fd, target)
            os.close(fd)
        _fresh_random_state()
        os.write(ready_w, b"1")
        os.close(ready_w)

    def reap(self, pid: int, pidfd: int) -> None:
        self.sel.unregister(pidfd)
        os.close(pidfd)
        self.children.pop(pid, None)
        try:
            _, status = os.waitpid(pid, 0)
        except ChildProcessError:
            status = signal.SIGKILL  # reaped elsewhere: cannot happen, report it as killed
        _send(self.sock, {"exit": pid, "status": status})

    def shutdown(self) -> None:
        """The agent hung up: take every child down with us (their groups: their children too)."""
        for pid in list(self.children):
            try:
                os.killpg(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        for pid in list(self.children):
            try:
                os.waitpid(pid, 0)
            except ChildProcessError:
                pass


def _fresh_random_state() -> None:
    """A forked child starts from the zygote's memory: give it what a fresh process would have.
    Python's ``random`` reseeds itself after fork; numpy's global generator (seeded from the OS
    at import) does not; torch's default generator starts from its fixed default seed in every
    fresh process, which is what the child gets back here in case anything advanced it."""
    np = sys.modules.get("numpy")
    if np is not None:
        try:
            np.random.seed()
        except Exception:
            pass
    torch = sys.modules.get("torch")
    if torch is not None:
        try:
            torch.random.default_generator.manual_seed(torch.initial_seed())
        except Exception:
            pass


# Stop signals a scheduler sends to every process of a job step (Slurm: SIGTERM to each, in no
# order). The zygote ignores them: its life is the agent's (it ends when the agent hangs up, and
# dies with it through PR_SET_PDEATHSIG). Had it died first, every worker forked from it would be
# SIGKILLed by its death signal before the agent saw its own SIGTERM, and a preempted job would be
# recorded as a failure. Forked children get the handlers back (a fresh process's).
_saved_handlers: dict[int, object] = {}


def _ignore_stop_signals() -> None:
    from trainguard.schedulers.adapter import STOP_SIGNALS

    for sig in STOP_SIGNALS:
        _saved_handlers[sig] = signal.signal(sig, signal.SIG_IGN)


def _restore_stop_signals() -> None:
    for sig, handler in _saved_handlers.items():
        signal.signal(sig, handler)  # type: ignore[arg-type]


def serve(fd: int, preimport: Callable[[], None]) -> None:
    """Run the zygote on socket ``fd``. Returns only in a forked child (then stdin carries its
    assignment, as for a pre-started worker); the zygote itself exits here."""
    _ignore_stop_signals()
    sock = socket.socket(fileno=fd)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    ready = prepare(preimport)
    _send(sock, ready)
    if not ready["ready"]:
        os._exit(3)
    if _Server(sock).loop() is None:
        sys.stdout.flush()
        os._exit(0)
