"""Automatic instrumentation of a worker, run before the user's script (like ``ddtrace-run``).

``install()`` is called by the worker entry of ``trainguard run``, and by trainguard's
``sitecustomize`` (``worker/sitedir``, put on the workers' PYTHONPATH) in every other Python
process a rank's command starts: console scripts run with ``--no-python``, ``python -m``, wrappers
that exec or spawn Python. Without the profiling environment (any other launcher) it returns at
once. Otherwise it creates the recorder on a private ring and installs the torch hooks — right
away when torch is already imported, else the moment the script imports it (a post-import hook;
importing torch here would only move its cost). ``torch.distributed.checkpoint`` is wrapped the
same way when imported. It never raises: a failure prints one line and training goes on unprofiled.

One ring per rank, owned by the process that trains: the first process of the rank to complete a
step moves its ring into the rank's shared file and marks the environment (``ENV_OWNER``), so
processes started after that (DataLoader workers, helpers) stay uninstrumented; multiprocessing's
own children are never instrumented, and forked children get a throw-away ring.
"""

from __future__ import annotations

import atexit
import importlib.abc
import importlib.util
import os
import sys
from collections.abc import Callable
from types import ModuleType
from typing import Any

ENV_RING_PREFIX = "TRAINGUARD_RING_PREFIX"  # set by the agent's profiling monitor
ENV_FLAGS = "TRAINGUARD_PROFILING_FLAGS"  # initial switch word (ring.FLAG_*)
ENV_CAPACITY = "TRAINGUARD_RING_CAPACITY"
ENV_OWNER = "TRAINGUARD_RING_OWNER"  # pid of the process that took this rank's ring
ENV_NAN_CHECK = "TRAINGUARD_NAN_CHECK"  # = nancheck.ENV_DIR: set by the agent for a NaN replay only
# The directory whose sitecustomize.py instruments processes trainguard does not start itself.
SITE_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sitedir")

_installed = False


def install() -> None:
    global _installed
    prefix = os.environ.get(ENV_RING_PREFIX)
    nan_check = os.environ.get(ENV_NAN_CHECK)  # a NaN replay's gradient check (worker/nancheck.py)
    if not (prefix or nan_check) or _installed or os.environ.get(ENV_OWNER) or _multiprocessing_child():
        return
    _installed = True
    if nan_check:
        when_imported("torch", _install_nancheck)
    if not prefix:
        return
    try:
        _install(prefix)
    except Exception as exc:
        print(f"trainguard: profiling disabled: {exc}", file=sys.stderr, flush=True)


def _install_nancheck(torch: ModuleType) -> None:
    from trainguard.worker import nancheck

    nancheck.install_torch(torch)


def _multiprocessing_child() -> bool:
    """A process multiprocessing started (spawn / forkserver DataLoader workers, its resource
    tracker): ``python -c 'from multiprocessing... '``. It works for the trainer, never as one."""
    argv = getattr(sys, "orig_argv", [])
    return "-c" in argv[:-1] and argv[argv.index("-c") + 1].startswith("from multiprocessing")


def _install(prefix: str) -> None:
    from trainguard.worker import ring, spans

    rank = int(os.environ.get("RANK", "0"))
    # The agent's attempt number (logs/attempt-<n>, numbered across a run dir's runs) names the ring.
    attempt = (os.environ.get("TRAINGUARD_ATTEMPT") or os.environ.get("TRAINGUARD_RESTART_COUNT")
               or os.environ.get("TORCHELASTIC_RESTART_COUNT") or "0")
    capacity = int(os.environ.get(ENV_CAPACITY, ring.DEFAULT_CAPACITY))
    path = ring.ring_path(prefix, attempt, rank)
    if not os.access(os.path.dirname(path) or ".", os.W_OK):  # say so now, not at the first step
        raise OSError(f"cannot create rings in {os.path.dirname(path)}")
    writer = ring.RingWriter(None, rank, capacity, flags=int(os.environ.get(ENV_FLAGS, "0")))
    rec = spans.Recorder(writer, claim_path=path, on_claim=_claimed)
    spans.set_recorder(rec)
    os.register_at_fork(after_in_child=rec.detach)
    when_imported("torch", lambda _mod: _install_torch(rec, path))
    when_imported("torch.distributed.checkpoint", lambda mod: _install_dcp(rec, mod))


def _install_torch(rec: Any, ring_path: str) -> None:
    from trainguard.worker import flight, hooks

    errors = hooks.install(rec)
    # torch's Flight Recorder served beside the ring: the hang monitor reads it from a hung rank.
    why = flight.start(flight.socket_path(ring_path))
    if why:
        errors.append(why)
    if errors:
        print(f"trainguard: some profiling hooks unavailable: {'; '.join(errors)}", file=sys.stderr, flush=True)


def _install_dcp(rec: Any, mod: ModuleType) -> None:
    from trainguard.worker import hooks

    try:
        hooks.install_dcp(rec, mod)
    except Exception as exc:
        print(f"trainguard: checkpoint profiling unavailable: {exc}", file=sys.stderr, flush=True)


def _claimed(path: str) -> None:
    """This process took the rank's ring: later children must not try."""
    pid = os.getpid()
    os.environ[ENV_OWNER] = str(pid)
    atexit.register(_unlink, path, pid)  # normally the agent unlinked it already, once mapped


def _unlink(path: str, pid: int) -> None:
    """At the worker's exit: remove its ring only when the agent that reads it is gone. While the
    agent lives, it drains the ring after the worker's exit and unlinks it then: an attempt shorter
    than the agent's tick (a fast job, a quick failure) would otherwise lose all its spans."""
    if os.getpid() != pid:  # a forked child inherits atexit handlers; the ring is not its own
        return
    if _agent_alive(path):
        return
    try:
        os.unlink(path)
    except OSError:
        pass


def _agent_alive(path: str) -> bool:
    """Whether the agent named in the ring's path (``trainguard-<agent pid>-...``) still runs."""
    parts = os.path.basename(path).split("-")
    if len(parts) < 2 or not parts[1].isdigit():
        return False
    try:
        os.kill(int(parts[1]), 0)
    except ProcessLookupError:
        return False
    except OSError:  # EPERM: it exists (another user's process with that pid: the agent's own sweep decides)
        return True
    return True


# ---- post-import hooks ---------------------------------------------------------------------------
_waiting: dict[str, list[Callable[[ModuleType], None]]] = {}


def when_imported(name: str, fn: Callable[[ModuleType], None]) -> None:
    """Call ``fn(module)`` now if ``name`` is imported, else right after it is."""
    mod = sys.modules.get(name)
    if mod is not None:
        _call(fn, mod)
        return
    _waiting.setdefault(name, []).append(fn)
    if not any(isinstance(f, _PostImportFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _PostImportFinder())


def _call(fn: Callable[[ModuleType], None], mod: ModuleType) -> None:
    try:
        fn(mod)
    except Exception as exc:
        print(f"trainguard: profiling hook failed: {exc}", file=sys.stderr, flush=True)


class _PostImportFinder(importlib.abc.MetaPathFinder):
    """Finds nothing itself: for a watched module it wraps the real loader's exec_module."""

    def __init__(self) -> None:
        self._busy: set[str] = set()

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname not in _waiting or fullname in self._busy:
            return None
        self._busy.add(fullname)
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            self._busy.discard(fullname)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        loader = spec.loader
        exec_module = loader.exec_module

        def exec_and_hook(module: ModuleType) -> None:
            exec_module(module)
            for fn in _waiting.pop(fullname, []):
                _call(fn, module)

        loader.exec_module = exec_and_hook  # type: ignore[method-assign]
        return spec
