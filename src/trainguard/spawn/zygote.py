"""The agent's side of the zygote: one process per node that imported torch once and forks workers.

A fresh Python worker pays for ``import torch`` (and for torch._dynamo, which DDP imports lazily):
1–2 s on an idle core, several seconds on a busy node. Pre-started interpreters hide that cost only
when they have finished importing, and a failure that follows a restart within seconds finds them
still importing. The zygote pays it once per agent; a fork then takes tens of milliseconds, so
spares are replenished right after every restart.

``Zygote.fork()`` hands the zygote three pipe ends (SCM_RIGHTS over a SOCK_SEQPACKET socket pair):
the child's stdin, on which its assignment arrives as for a pre-started worker, and its
stdout/stderr, which the agent's per-rank log pumps read. The zygote is the children's parent, so
it reports their exit statuses; ``ZygoteChild`` gives the agent the part of ``subprocess.Popen``
that torch elastic's process context and ours use (pid, poll, wait, returncode, the pipes).
Children run in their own session and die with the zygote, which dies with the agent
(PR_SET_PDEATHSIG on both). The protocol and the child's clean state: spawn/zygote_server.py.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import IO

import psutil

from trainguard.spawn.logs import RankLog, start_pumps

log = logging.getLogger(__name__)

READY_TIMEOUT_S = 300.0  # importing torch on a loaded node can be slow; past this, fresh processes
REPLY_TIMEOUT_S = 30.0


class ZygoteError(Exception):
    pass


class ZygoteChild:
    """A worker process forked by the zygote: the Popen interface the agent relies on."""

    def __init__(self, pid: int, stdin: IO[bytes], stdout: IO[bytes], stderr: IO[bytes]) -> None:
        self.pid = pid
        self.stdin: IO[bytes] | None = stdin
        self.stdout = stdout
        self.stderr = stderr
        self.returncode: int | None = None
        self.args = ["<forked by the trainguard zygote>"]
        self._done = threading.Event()
        self._orphaned = False  # the zygote is gone: nobody will report our exit

    def poll(self) -> int | None:
        if self.returncode is None and self._orphaned and not _running(self.pid):
            self._exited(-signal.SIGKILL)  # its death signal (towards the zygote) ended it
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if not self._done.wait(timeout):
            raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        assert self.returncode is not None
        return self.returncode

    def _exited(self, code: int) -> None:
        if self.returncode is None:
            self.returncode = code
            self._done.set()


def _running(pid: int) -> bool:
    """Alive and not a zombie (an orphan's zombie lingers until whoever inherited it reaps it)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


class Zygote:
    """Starts the zygote process and asks it for children. Thread-safe."""

    def __init__(self, python: str, env: dict[str, str] | None = None) -> None:
        self.python = python
        agent_end, zygote_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._sock = agent_end
        try:
            self.proc = subprocess.Popen(
                [python, "-u", "-m", "trainguard.spawn.worker_main", "--zygote", str(zygote_end.fileno())],
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                pass_fds=(zygote_end.fileno(),),
                start_new_session=True,
            )
        finally:
            zygote_end.close()
        self.output = RankLog(hold=False)  # the zygote's own output (import warnings...) goes to the agent log
        self._pumps = start_pumps(self.proc.stdout, self.proc.stderr, self.output)  # type: ignore[arg-type]
        self._lock = threading.Lock()  # one fork request at a time
        self._cond = threading.Condition()
        self._replies: dict[int, dict] = {}
        self._children: dict[int, ZygoteChild] = {}
        self._early_exits: dict[int, int] = {}
        self._next_id = 0
        self._ready = threading.Event()
        self.ready_info: dict = {}
        self.error: str | None = None
        self._closed = False
        self._reader = threading.Thread(target=self._read, name="trainguard-zygote", daemon=True)
        self._reader.start()

    # ---- the reader thread ------------------------------------------------------------------
    def _read(self) -> None:
        try:
            while True:
                data = self._sock.recv(65536)
                if not data:
                    break
                self._handle(json.loads(data))
        except (OSError, ValueError) as exc:
            if not self._closed:
                log.warning("zygote connection failed: %s", exc)
        self._gone()

    def _handle(self, msg: dict) -> None:
        if "ready" in msg:
            self.ready_info = msg
            if not msg["ready"]:
                self.error = str(msg.get("error"))
            self._ready.set()
        elif "forked" in msg:
            with self._cond:
                self._replies[int(msg["forked"])] = msg
                self._cond.notify_all()
        elif "exit" in msg:
            pid, code = int(msg["exit"]), os.waitstatus_to_exitcode(int(msg["status"]))
            with self._cond:
                child = self._children.pop(pid, None)
                if child is None:  # exited before fork() registered it
                    self._early_exits[pid] = code
            if child is not None:
                child._exited(code)

    def _gone(self) -> None:
        """The zygote ended. Its children die of their death signal (SIGKILL): report them so
        once they are gone."""
        if self.error is None:
            self.error = "the zygote process ended"
        self._ready.set()
        with self._cond:
            orphans, self._children = list(self._children.values()), {}
            for child in orphans:
                child._orphaned = True
            self._cond.notify_all()
        deadline = time.monotonic() + 10.0
        for child in orphans:
            while _running(child.pid) and time.monotonic() < deadline:
                time.sleep(0.02)
            child._exited(-signal.SIGKILL)

    # ---- requests ---------------------------------------------------------------------------
    def wait_ready(self, timeout: float = READY_TIMEOUT_S) -> bool:
        """Whether the zygote is ready to fork (False: it failed, or took longer than timeout)."""
        if not self._ready.wait(timeout):
            self.error = f"the zygote was not ready after {timeout:.0f} s"
            return False
        return self.error is None

    @property
    def usable(self) -> bool:
        return self.error is None

    def fork(self) -> ZygoteChild:
        if not self.wait_ready():
            raise ZygoteError(self.error)
        in_r, in_w = os.pipe()
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        with self._lock:
            self._next_id += 1
            req = self._next_id
            try:
                socket.send_fds(self._sock, [json.dumps({"op": "fork", "id": req}).encode()], [in_r, out_w, err_w])
            except OSError as exc:
                for fd in (in_r, in_w, out_r, out_w, err_r, err_w):
                    os.close(fd)
                raise ZygoteError(f"cannot reach the zygote: {exc}") from None
            for fd in (in_r, out_w, err_w):  # the child has its copies
                os.close(fd)
            reply = self._reply(req)
            if "pid" not in reply:
                for fd in (in_w, out_r, err_r):
                    os.close(fd)
                raise ZygoteError(str(reply.get("error")))
            child = ZygoteChild(int(reply["pid"]), os.fdopen(in_w, "wb"), os.fdopen(out_r, "rb"), os.fdopen(err_r, "rb"))
            with self._cond:
                early = self._early_exits.pop(child.pid, None)
                if early is None:
                    self._children[child.pid] = child
            if early is not None:
                child._exited(early)
            return child

    def _reply(self, req: int) -> dict:
        deadline = time.monotonic() + REPLY_TIMEOUT_S
        with self._cond:
            while req not in self._replies:
                left = deadline - time.monotonic()
                if self.error is not None and not self._reader.is_alive():
                    return {"error": self.error}
                if left <= 0:
                    return {"error": f"no answer from the zygote in {REPLY_TIMEOUT_S:.0f} s"}
                self._cond.wait(min(left, 0.5))
            return self._replies.pop(req)

    def close(self, unused: bool = False) -> None:
        """Hang up: the zygote kills its remaining children and exits. ``unused``: it never forked
        a worker, so nothing of it needs a clean end: killed at once rather than waited for (it
        reads the hang-up only once it has imported torch, seconds away on a refused launch)."""
        self._closed = True
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        if unused:
            _killpg(self.proc.pid)
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            _killpg(self.proc.pid)
            self.proc.wait(timeout=10)
        self._reader.join(timeout=15)
        self._sock.close()
        self._pumps.wait(time.monotonic() + 2)
        self.output.close()


def _killpg(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


# ---- started before the agent's own imports ----------------------------------------------------
_early: Zygote | None = None


def _prestart_mode(argv: list[str]) -> str | None:
    for i, arg in enumerate(argv):
        for name in ("--prestart-workers", "--prestart_workers"):
            if arg == name and i + 1 < len(argv):
                return argv[i + 1]
            if arg.startswith(name + "="):
                return arg.split("=", 1)[1]
    return None


def _env_flag(name: str) -> bool:
    """A PET_* flag as torchrun's parser reads it (a non-zero integer)."""
    try:
        return bool(int(os.environ.get(name, "0")))
    except ValueError:
        return False


def start_early(argv: list[str]) -> None:
    """Start the zygote as the first thing `trainguard run` does, from its raw arguments: the
    agent's own imports (torch elastic's launcher, trainguard's monitors) take seconds, and the
    zygote's import of torch then runs beside them instead of after them (cold start). A rough
    reading of the arguments is enough: the pool takes this zygote only when the parsed arguments
    ask for one (``take_early``) and closes it otherwise. Called from the main thread, which lives
    as long as the agent (the zygote's death signal follows the thread that started it)."""
    global _early
    if sys.platform != "linux" or _early is not None:
        return
    if any(a in ("-h", "--help", "--no-python", "--no_python") for a in argv):
        return
    if _env_flag("PET_NO_PYTHON"):  # torchrun's environment form of --no-python
        return
    if _prestart_mode(argv) not in (None, "on"):
        return
    try:
        _early = Zygote(os.getenv("PYTHON_EXEC", sys.executable), dict(os.environ))
    except OSError as exc:
        log.debug("early zygote not started: %s", exc)


def close_early() -> None:
    """Close a zygote ``start_early`` started that no pool took (the launch stopped before one:
    a bad flag, a busy run dir). A CLI process would take it down at exit; a caller that goes on
    (``trainguard.cli.main`` called in-process) must not keep it running."""
    global _early
    zygote, _early = _early, None
    if zygote is not None:
        zygote.close(unused=True)


def take_early(python: str) -> Zygote | None:
    """The zygote ``start_early`` started, if it runs ``python`` (the caller owns it now)."""
    global _early
    zygote, _early = _early, None
    if zygote is not None and zygote.python != python:
        zygote.close(unused=True)
        return None
    return zygote
