"""What runs inside a worker process before and around the user's script.

Used three ways: forked from the zygote (``python -u -m trainguard.spawn.worker_main --zygote FD``,
see spawn/zygote_server.py), which imported torch once, and then waiting on stdin for its
assignment; as a pre-started process (``--prestart``) that imports torch itself ahead of time and
waits on stdin the same way; and directly (``python -u -m trainguard.spawn.worker_main SPEC_JSON``)
when pre-starting is off.
The assignment is JSON: {"env": {...}, "cwd": str, "script": str | null, "module": str | null,
"args": [...]}.
"""

from __future__ import annotations

import json
import os
import runpy
import sys
import time

from trainguard import torch_compat
from trainguard.spawn.parent import die_with_parent

# trainguard's own worker-side modules, imported ahead of time with torch's (spawn/zygote_server.py)
WORKER_MODULES = (
    "trainguard.worker.bootstrap",
    "trainguard.worker.hooks",
    "torch.distributed.elastic.multiprocessing.errors",
    "torch.distributed.algorithms.ddp_comm_hooks.default_hooks",
)


def preimport() -> None:
    """What a worker would otherwise import after its start: torch's modules and ours."""
    import importlib

    torch_compat.preimport()
    for name in WORKER_MODULES:
        try:
            importlib.import_module(name)
        except ImportError:
            pass


def _apply_env(env: dict[str, str]) -> None:
    os.environ.clear()
    os.environ.update(env)
    threads = env.get("OMP_NUM_THREADS")
    if threads and "torch" in sys.modules:
        try:
            sys.modules["torch"].set_num_threads(int(threads))
        except (ValueError, RuntimeError):
            pass


def _instrument() -> None:
    try:
        from trainguard.worker import bootstrap
    except ImportError:
        return
    try:
        bootstrap.install()
    except Exception as exc:  # instrumentation must never stop training
        print(f"trainguard: instrumentation disabled: {exc}", file=sys.stderr)


def run(spec: dict) -> None:
    _apply_env(spec["env"])
    os.chdir(spec.get("cwd") or os.getcwd())
    _instrument()
    from torch.distributed.elastic.multiprocessing.errors import get_error_handler

    handler = get_error_handler()
    handler.initialize()
    args = [str(a) for a in spec.get("args", [])]
    try:
        if spec.get("module"):
            sys.argv = [spec["module"], *args]
            sys.path.insert(0, os.getcwd())
            runpy.run_module(spec["module"], run_name="__main__", alter_sys=True)
        else:
            script = os.path.abspath(spec["script"])
            sys.argv = [script, *args]
            sys.path[0] = os.path.dirname(script)
            runpy.run_path(script, run_name="__main__")
        _say_finished()
    except SystemExit as exc:
        if exc.code in (None, 0):
            _say_finished()
        raise
    except BaseException as exc:
        # Same error file torch's @record writes, so the agent reports the real exception.
        handler.record_exception(exc)
        _print_user_traceback(exc)
        sys.stderr.flush()
        os._exit(1)  # what an uncaught exception exits with; skips a second traceback


def _say_finished() -> None:
    """Tell the agent the script is done, before the interpreter tears down: a crash after this
    (gloo/NCCL destructors at exit: "terminate called without an active exception") is not a
    failure of the training (see spawn/failures.py)."""
    from pathlib import Path

    from trainguard.spawn.logs import finished_file_path

    env = os.environ
    try:
        path = finished_file_path(Path(env["TRAINGUARD_RUN_DIR"]), int(env["TRAINGUARD_ATTEMPT"]), int(env["RANK"]))
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        with open(fd, "w") as f:
            f.write(json.dumps({"finished": time.time(), "pid": os.getpid()}) + "\n")
    except (KeyError, ValueError, OSError):  # not under the agent, or a full disk: the exit code alone decides
        pass


def _print_user_traceback(exc: BaseException) -> None:
    """The traceback as the user's script would have printed it, without our launcher frames."""
    import traceback

    tb = exc.__traceback__
    while tb is not None and (tb.tb_frame.f_code.co_filename == __file__ or "runpy" in tb.tb_frame.f_code.co_filename):
        tb = tb.tb_next
    traceback.print_exception(type(exc), exc, tb or exc.__traceback__)


def _read_assignment() -> dict | None:
    line = sys.stdin.readline()
    if not line:
        return None  # the agent went away before using us
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    return json.loads(line)


def main() -> None:
    die_with_parent()
    if sys.argv[1:2] == ["--zygote"]:
        from trainguard.spawn import zygote_server

        zygote_server.serve(int(sys.argv[2]), preimport)  # returns only in a forked child
        spec = _read_assignment()
    elif sys.argv[1:2] == ["--prestart"]:
        preimport()  # the expensive part of a worker start, before it is needed
        spec = _read_assignment()
    else:
        spec = json.loads(sys.argv[1])
    if spec is not None:
        run(spec)


if __name__ == "__main__":
    main()
