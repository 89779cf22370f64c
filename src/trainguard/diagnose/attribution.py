"""Which rank and host wrote a line, from what launchers print around it (pure; fed in file order).

Combined launcher output rarely prefixes every line with a rank. An expert reads the rank off the
launcher's own report instead, and so does this:

- torch elastic's ChildFailedError table: ``host :`` / ``rank : R (local_rank: L)`` give the entry's
  rank and host to its ``exitcode`` and ``traceback`` lines; entries after ``Root Cause`` are the
  first observed failure, entries under ``Failures:`` are not;
- ``failed (exitcode: N) local_rank: L (pid: P)`` (torchrun), ``'--local_rank=L' ... exits with return
  code = N`` (DeepSpeed), ``CalledProcessError: Command '[... --local_rank=L ...]' died with ...``
  (torch.distributed.launch): a local rank, made global with the node rank and processes per node
  when the log gives them (DeepSpeed's ``node_rank=``, torchrun's ``group_rank=``);
- ``srun: error: NODE: task N: ...`` (task id = rank with one task per GPU), ``process N terminated
  with ...`` and ``-- Process N terminated with the following error:`` (torch.multiprocessing.spawn),
  mpirun's ``process rank N with PID P on node H``;
- NCCL's ``HOST:PID:TID [dev] NCCL INFO comm 0x.. rank R nranks N`` maps that process to rank R for
  its later NCCL lines;
- a process naming itself (fairseq's ``distributed init (rank R)``, ``initialized host H as rank R``)
  or spawn's ``-- Process N terminated ...`` report: when a file names exactly one such rank, its
  rankless failure lines are that rank's (``file_rank``), also those before the report (the OOM a
  spawned process logged before spawn reported it);
- a traceback that starts on a rank-prefixed line (ParlAI's ``rank:  3 | ... | Traceback``) gives
  that rank to its unprefixed exception line.

Facts (rules of role "fact") feed the context through named groups: rank, local_rank, host,
node_rank, nproc, nnodes, root_cause, failures, self_rank.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

TRACEBACK_REACH = 80  # lines from "Traceback (most recent call last)" to its exception line
TABLE_REACH = 12  # candidate lines after an elastic table's rank line that still belong to its entry
CONTEXT_REACH = 40  # candidate lines after "-- Process N terminated with the following error:"

_LOCAL = re.compile(r"local_rank: (\d+)\b|--local[_-]rank[= ]'?(\d+)")
_TASK = re.compile(r"srun: error: (?P<host>[\w.-]+): tasks? (?P<task>\d+)(?:-\d+)?(?:,[\d-]+)*: ")
_PROCESS = re.compile(r"\bprocess (\d+) terminated with (?:signal|exit code)")
_MPI = re.compile(r"process rank (?P<rank>\d+) with PID (?P<pid>\d+) on node (?P<host>[\w.-]+)")
_PID = re.compile(
    r"\(pid: (\d+)\)|received by PID (\d+)|Killed process (\d+)|\bpid[= ](\d+)\b|\b(\d+) Killed\s"
)


@dataclass(frozen=True)
class Who:
    rank: int | None = None
    host: str | None = None
    pid: int | None = None
    root: bool = False  # the launcher reports this as the first observed failure
    table: bool = False  # the line is part of an elastic failure table


def pid_in(message: str) -> int | None:
    m = _PID.search(message)
    if m is None:
        return None
    return int(next(g for g in m.groups() if g))


@dataclass
class Attribution:
    node_rank: int | None = None
    nproc: int | None = None
    nnodes: int | None = None
    _table: str | None = None  # None | "failures" | "root"
    _entry: dict = field(default_factory=dict)  # rank, local_rank, host, until
    _context: tuple[int, int] | None = None  # (rank, until order)
    _pid_rank: dict[tuple[str | None, int], int] = field(default_factory=dict)
    host: str | None = None  # the file's host, where a fact names it outside a table (kubectl describe)
    _named: set[int] = field(default_factory=set)  # ranks the file names as its own or as the failed one
    _traceback: tuple[int, int] | None = None  # (rank, until order): a traceback opened on a prefixed line

    def file_rank(self) -> int | None:
        """The one rank this file names as its process or as spawn's failed process, else None."""
        return next(iter(self._named)) if len(self._named) == 1 else None

    def traceback(self, rank: int, order: int) -> None:
        """A traceback opened on a line prefixed with ``rank``: its exception line is that rank's."""
        self._traceback = (rank, order + TRACEBACK_REACH)

    def global_rank(self, local: int) -> int:
        if self.node_rank is not None and self.nproc:
            return self.node_rank * self.nproc + local
        return local  # one node (or node 0): the local rank is the global rank

    def fact(
        self, groups: dict[str, str | None], order: int, host: str | None = None, pid: int | None = None
    ) -> None:
        """A fact line's named groups update the context."""
        g = {k: v for k, v in groups.items() if v is not None}
        if "self_rank" in g:  # "initialized host H as rank R": this file is rank R's (on host H)
            self._named.add(int(g["self_rank"]))
            self.host = g.get("host", self.host)
            return
        for key in ("node_rank", "nproc", "nnodes"):
            if key in g:
                setattr(self, key, int(g[key]))
        if "root_cause" in g:
            self._table, self._entry = "root", {}
        elif "failures" in g:
            self._table, self._entry = "failures", {}
        if self._table is not None and ("host" in g or "rank" in g):
            entry = self._entry
            if "host" in g and "rank" in entry:  # a host line starts the next entry
                entry = {}
            if "host" in g:
                entry["host"] = g["host"]
            if "rank" in g:
                entry["rank"] = int(g["rank"])
            entry["until"] = order + TABLE_REACH
            self._entry = entry
            return
        if "host" in g and "rank" not in g:
            self.host = g["host"]
            return
        if "rank" in g and pid is not None:  # NCCL comm init: this process is that rank
            self._pid_rank[(host, pid)] = int(g["rank"])
            return
        if "rank" in g:  # "-- Process N terminated with the following error:"
            self._context = (int(g["rank"]), order + CONTEXT_REACH)
            self._named.add(int(g["rank"]))

    def resolve(self, message: str, order: int, host: str | None = None, pid: int | None = None) -> Who:
        """Rank, host, pid and root-cause flag the launcher context gives this candidate line."""
        line_pid = pid_in(message)
        e = self._entry
        if self._table is not None and e and order <= e.get("until", -1):
            rank = e.get("rank")
            return Who(rank, e.get("host"), line_pid, self._table == "root", True)
        m = _TASK.search(message)
        if m is not None:
            return Who(int(m["task"]), m["host"], line_pid, True)
        m = _MPI.search(message)
        if m is not None:
            return Who(int(m["rank"]), m["host"], int(m["pid"]), True)
        m = _LOCAL.search(message)
        if m is not None:
            local = int(m.group(1) or m.group(2))
            return Who(self.global_rank(local), self.host, line_pid, True)
        m = _PROCESS.search(message)
        if m is not None:
            return Who(int(m.group(1)), self.host, line_pid, True)
        if pid is not None and (host, pid) in self._pid_rank:
            return Who(self._pid_rank[(host, pid)], self.host, pid)
        if self._traceback is not None and order <= self._traceback[1]:
            rank, self._traceback = self._traceback[0], None  # the exception line ends the traceback
            return Who(rank, self.host, line_pid)
        if self._context is not None and order <= self._context[1]:
            return Who(self._context[0], self.host, line_pid)
        return Who(None, self.host, line_pid)
