"""torch elastic's process context for trainguard workers: same polling and shutdown semantics as
``SubprocessContext``, but processes come from the pre-started pool and their output goes
through trainguard's per-rank log pumps."""

from __future__ import annotations

import copy
import json
import logging
import os
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from string import Template

from torch.distributed.elastic.multiprocessing.api import (
    LogsDest,
    LogsSpecs,
    RunProcsResult,
    SubprocessContext,
)
from torch.distributed.elastic.multiprocessing.subprocess_handler import SubprocessHandler

from trainguard import runfiles, stopsignal
from trainguard.spawn import daemons
from trainguard.spawn.logs import Route, error_file_path, finished_file_path, rank_log_path
from trainguard.spawn.pool import WorkerPool, WorkerProcess

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Target:
    """What a worker runs: a Python script, a module (-m), or a binary (--no-python)."""

    script: str | None = None
    module: str | None = None
    binary: str | None = None


class RunDirLogsSpecs(LogsSpecs):
    """Error files go into the run dir; stdout/stderr are captured by our own pumps, not torch's.

    ``torch_specs``: torchrun's own (``--log-dir``, ``--redirects``, ``--tee``,
    ``--local-ranks-filter``) when the user asked for its files: its ``reify`` makes the same
    directories torchrun makes, and says per local rank which stream goes to a file, which to the
    console (``route``); the pumps then write those files beside trainguard's rank logs."""

    def __init__(self, run_dir: Path, torch_specs: LogsSpecs | None = None) -> None:
        super().__init__(log_dir=str(run_dir / "logs"))
        self.run_dir = run_dir
        self.torch_specs = torch_specs
        self.torch_dest: LogsDest | None = None

    @property
    def root_log_dir(self) -> str:
        return str(self.run_dir / "logs")

    def reify(self, envs: dict[int, dict[str, str]]) -> LogsDest:
        error_files = {}
        for local_rank, env in envs.items():
            path = error_file_path(self.run_dir, int(env["TRAINGUARD_ATTEMPT"]), int(env["RANK"]))
            runfiles.private_dirs(path.parent)
            if path.exists():
                path.unlink()
            env["TORCHELASTIC_ERROR_FILE"] = str(path)
            error_files[local_rank] = str(path)
        if self.torch_specs is not None:  # on a copy: the error files stay ours (the run dir)
            self.torch_dest = self.torch_specs.reify(copy.deepcopy(envs))
        empty = {r: "" for r in envs}
        return LogsDest(stdouts=empty, stderrs=dict(empty), tee_stdouts={}, tee_stderrs={}, error_files=error_files)


class _Handler(SubprocessHandler):
    """A SubprocessHandler around a process we started ourselves."""

    def __init__(self, worker: WorkerProcess, local_rank: int) -> None:  # noqa: D107 - no Popen here
        self.worker = worker
        self.proc = worker.proc
        self.local_rank_id = local_rank
        self._stdout = None
        self._stderr = None

    def close(self, death_sig: signal.Signals | None = None) -> None:
        sig = death_sig or signal.SIGTERM
        for s in (sig, signal.SIGCONT):  # SIGCONT: a SIGSTOPped worker must act on the signal now
            try:
                os.killpg(self.proc.pid, s)
            except (ProcessLookupError, PermissionError):
                return


PUMP_DRAIN_S = 30.0  # how long the log pumps may take to copy a stopped group's last output
EOF_GRACE_S = 2.0  # past this, a pipe still open is held by a process outside the stopped group
EXIT_GRACE_S = 60.0  # how long the others may take to end once a worker crashed after finishing


def ignores_signal(pid: int, sig: int) -> bool:
    """Whether process ``pid`` ignores ``sig`` (SIG_IGN, from /proc/<pid>/status); False when unknown."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("SigIgn:"):
                    return bool(int(line.split()[1], 16) >> (int(sig) - 1) & 1)
    except (OSError, ValueError, IndexError):
        pass
    return False


class TrainguardPContext(SubprocessContext):
    def __init__(
        self,
        name: str,
        target: Target,
        args: dict[int, tuple],
        envs: dict[int, dict[str, str]],
        logs_specs: RunDirLogsSpecs,
        pool: WorkerPool,
        tee_ranks: set[int] | None,
    ) -> None:
        entry = target.binary or "python"
        super().__init__(name=name, entrypoint=entry, args=args, envs=envs, logs_specs=logs_specs)
        self.target = target
        self.logs_specs = logs_specs
        self.pool = pool
        self.run_dir = logs_specs.run_dir
        self.tee_ranks = tee_ranks
        self.rank_logs: dict[int, Path] = {}
        # Local ranks that failed on their own, as opposed to those we then stopped (SIGTERM).
        self.primary_failures: set[int] | None = None
        # Exact exit times (a waiter thread per worker): the true order of failures, which the
        # 0.1 s poll cannot give when one death cascades into the others within milliseconds.
        self.exit_times: dict[int, float] = {}
        self.exit_codes: dict[int, int] = {}  # local rank -> exit code (set with its exit time)
        # Ranks that crashed after their script had finished (global rank -> exit code), when the
        # group still counts as succeeded (see _exit_phase).
        self.exit_crashes: dict[int, int] = {}
        self._exit_grace_until: float | None = None
        # Processes outside the workers' groups that held their output open at the end (None:
        # not looked for yet); reported once by the agent (``daemons_reported``).
        self.daemons: list[daemons.Daemon] | None = None
        self.daemons_reported = False

    def _spec(self, local_rank: int) -> dict:
        env = dict(os.environ)
        env.update(self.envs[local_rank])
        return {
            "env": env,
            "cwd": os.getcwd(),
            "script": self.target.script,
            "module": self.target.module,
            "binary": self.target.binary,
            "args": list(self.args[local_rank]),
        }

    def route(self, local_rank: int) -> Route:
        """Where this rank's output goes as torchrun's flags say (see RunDirLogsSpecs)."""
        template = os.environ.get("TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE")
        prefix = None
        if template:  # what torchrun puts before each tee'd line, same substitutions
            env = self.envs[local_rank]
            prefix = Template(template).safe_substitute(role_name=self.name, rank=env["RANK"], local_rank=local_rank)
        dest = self.logs_specs.torch_dest
        if dest is None:
            return Route(prefix=prefix)
        console, files = set(), {}
        for which, paths, tees in (("out", dest.stdouts, dest.tee_stdouts), ("err", dest.stderrs, dest.tee_stderrs)):
            path = paths.get(local_rank, "")
            if path == "" or tees.get(local_rank, os.devnull) != os.devnull:
                console.add(which)  # not redirected, or tee'd
            if path not in ("", os.devnull):
                files[which] = Path(path)
        return Route(console=frozenset(console), files=files, prefix=prefix)

    def _start(self) -> None:
        stopsignal.reclaim()  # torch's start() just registered its handler, which records no stop
        specs = {r: self._spec(r) for r in range(self.nprocs)}
        python = self.target.binary is None
        prestarted = self.pool.take(self.nprocs) if python and self.pool.size else []
        handlers = {}
        for local_rank, spec in specs.items():
            env = spec["env"]
            rank, attempt = int(env["RANK"]), int(env["TRAINGUARD_ATTEMPT"])
            worker = prestarted[local_rank] if prestarted else self.pool.spawn_direct(spec)
            path = rank_log_path(self.run_dir, attempt, rank)
            tee = self.tee_ranks is None or local_rank in self.tee_ranks
            worker.output.assign(path, rank, tee, self.route(local_rank))
            self.rank_logs[rank] = path
            worker.assign(spec)
            handlers[local_rank] = _Handler(worker, local_rank)
            threading.Thread(target=self._wait_exit, args=(local_rank, worker), daemon=True).start()
        self.subprocess_handlers = handlers

    def _wait_exit(self, local_rank: int, worker: WorkerProcess) -> None:
        code = worker.proc.wait()
        self.exit_codes[local_rank] = code
        self.exit_times[local_rank] = time.time()

    def global_rank(self, local_rank: int) -> int:
        return int(self.envs[local_rank]["RANK"])

    def finished(self, local_rank: int) -> bool:
        """The worker's script returned (or exited 0) before the process ended (worker_main says so)."""
        return self.finished_at(local_rank) is not None

    def finished_at(self, local_rank: int) -> float | None:
        """When the worker's script finished (None: it did not, or did not say so)."""
        env = self.envs[local_rank]
        try:
            return finished_file_path(self.run_dir, int(env["TRAINGUARD_ATTEMPT"]), int(env["RANK"])).stat().st_mtime
        except OSError:
            return None

    def _exit_phase(self) -> str | None:
        """A worker that crashed after its script finished (torch's gloo teardown aborts under load:
        "terminate called without an active exception") did its work. While every crashed worker had
        finished, the others are left to end on their own (EXIT_GRACE_S) instead of being stopped:
        "wait"; when all ended and each either exited 0 or had finished: "succeeded". Otherwise None
        (an ordinary failure)."""
        codes = {lr: h.proc.poll() for lr, h in self.subprocess_handlers.items()}
        crashed = [lr for lr, c in codes.items() if c not in (None, 0)]
        if not crashed or not all(self.finished(lr) for lr in crashed):
            return None
        if any(c is None for c in codes.values()):
            if self._exit_grace_until is None:
                self._exit_grace_until = time.monotonic() + EXIT_GRACE_S
            return "wait" if time.monotonic() < self._exit_grace_until else None
        self.exit_crashes = {self.global_rank(lr): int(codes[lr] or 0) for lr in crashed}
        return "succeeded"

    def _poll(self):
        phase = self._exit_phase()
        if phase == "wait":
            return None
        if phase == "succeeded":
            self.close()  # nothing runs any more: joins the log pumps, as torch's own success path
            return RunProcsResult(return_values=dict.fromkeys(range(self.nprocs)), stdouts=self.stdouts, stderrs=self.stderrs)
        if self.primary_failures is None:
            failed = {r for r, h in self.subprocess_handlers.items() if (h.proc.poll() or 0) != 0}
            if failed:
                self.primary_failures = failed
        for _ in range(3):
            try:
                return super()._poll()
            except ValueError:  # JSONDecodeError: torch read an error file cut short by its worker's death
                self._set_aside_broken_error_files()
        return super()._poll()

    def _stop_signal_for_workers(self, sig: signal.Signals) -> signal.Signals:
        """The signal that stops the workers: the agent's own (SIGINT gives the user's script its
        KeyboardInterrupt, as under torchrun), unless they ignore it. A shell script's background
        job starts with SIGINT and SIGQUIT ignored (nohup: SIGHUP), the workers inherit that, and
        the agent's stop would reach them as nothing until the stop timeout's SIGKILL."""
        if sig == signal.SIGTERM:
            return sig
        deaf = [h.proc.pid for h in self.subprocess_handlers.values()
                if h.proc.poll() is None and ignores_signal(h.proc.pid, sig)]  # fmt: skip
        if not deaf:
            return sig
        log.warning("the workers ignore %s (inherited from the shell that started the job in the background): "
                    "stopping them with SIGTERM", sig.name)
        return signal.SIGTERM

    def _set_aside_broken_error_files(self) -> None:
        for path in map(Path, self.error_files.values()):
            try:
                json.loads(path.read_text())
            except FileNotFoundError:
                continue
            except (OSError, ValueError):
                path.replace(path.with_suffix(".broken"))

    def _close(self, death_sig: signal.Signals, timeout: int = 30) -> None:
        super()._close(self._stop_signal_for_workers(death_sig), timeout)
        for handler in self.subprocess_handlers.values():
            # The worker may be gone while its children (DataLoader workers...) live on in its group.
            try:
                os.killpg(handler.proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        self._drain_pumps()

    def _drain_pumps(self) -> None:
        """Every writer of the pipes in the workers' groups is dead now: each pump reaches EOF once
        it has copied what is left, which on a loaded node can take a while for a hundred workers
        (one deadline for all). A pipe still open past a short grace is held by a process outside
        the group (a daemon in its own session): its pump copies what is there and stops waiting,
        and the holders are named (``daemons``; the agent reports them), never waited for."""
        now = time.monotonic()
        deadline, grace = now + PUMP_DRAIN_S, now + EOF_GRACE_S
        pumps = {lr: h.worker.pumps for lr, h in self.subprocess_handlers.items() if h.worker.pumps is not None}
        for p in pumps.values():
            p.wait(min(grace, deadline))
        for p in pumps.values():
            p.stop()
        for lr, p in pumps.items():
            p.wait(deadline)
            self.subprocess_handlers[lr].worker.output.close()
        held = {lr: (self.global_rank(lr), self.subprocess_handlers[lr].proc.pid, pipes)
                for lr, p in pumps.items() if (pipes := p.held())}  # fmt: skip
        if held and self.daemons is None:
            self.daemons = daemons.find(held)
