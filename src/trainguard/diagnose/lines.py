"""Split one log line into (time, rank, host, message).

Understands the prefixes training logs carry, outermost first:
a viewer's line number ``[80746] ``, mpirun/Horovod's ``[1,3]<stderr>:`` (rank 3), ``srun -l``'s ``3: `` (task 3), pdsh's ``gpu-n2: `` and Slurm's ``slurmstepd-NODE: `` (the host), Open MPI's ``[host:pid] ``, Ray's ``(WorkerDict pid=88231, ip=10.2.3.14) ``, a runner's
``NAME [stderr] `` tag, ``[pod/NAME/CONTAINER] `` (kubectl logs --prefix), an ISO timestamp with optional zone and CRI
``stdout F`` marker (trainguard's per-rank logs, containerd, python logging), torchrun's
``[rankN]:`` / ``[defaultN]:`` (the global ``[rankN]`` wins), ParlAI's ``rank:  N | ``, glog/torch-elastic ``E1206 18:44:12.715298 PID file:line] `` (also
bracketed, ``[E1206 18:44:12.715298746 file:line]``),
syslog ``Nov 21 09:30:01 HOST proc:``, ``dmesg -T`` ``[Fri Nov 20 10:30:41 2026]``, and inside the message NCCL's ``HOST:PID:TID [dev] NCCL``.
Pure functions: no I/O.
"""

from __future__ import annotations

import calendar
import re
from dataclasses import dataclass
from datetime import UTC, datetime

_MONTHS = {m: i for i, m in enumerate("Jan Feb Mar Apr May Jun Jul Aug Sep Oct Nov Dec".split(), 1)}

_PREFIX = re.compile(
    r"(?:\[\d{2,9}\] (?=\S))?"  # a log viewer's line number
    # mpirun/Horovod: [jobid,rank]<stream>:, or srun -l / --label: "3: " (the task id: the rank, one task per GPU)
    r"(?:\[\d+,(?P<mpi>\d+)\]<(?:stdout|stderr)>:\s?|(?P<srun>\d{1,5}): (?=\S))?"
    # pdsh (DeepSpeed's multi-node runner, GPT-NeoX): "gpu-n2: " - a lower-case host name with a digit
    # (Slurm's step daemon writes "slurmstepd-NODE: ": the node, without the daemon's name)
    r"(?:(?:slurmstepd-(?P<sstep>[a-z][\w.-]{0,60})|(?P<pdsh>(?!(?:rank|default|python|py)\d)[a-z][a-z0-9-]{0,40}\d[a-z0-9.-]{0,40})): (?=\S| {1,4}\S))?"
    # Open MPI's own messages: "[hostA:71142] Local abort ..." (a host and a pid; not "[trainer.py:120]")
    r"(?:\[(?!(?:rank|default)\d|[A-Z_]+:)(?P<ompi>[A-Za-z][\w-]{0,60}(?:\.[A-Za-z][\w-]*)*)(?<!\.py):\d+\] )?"
    r"(?:\((?:\w+) pid=\d+(?:, ip=(?P<ray>[\w.:-]+))?\) )?"  # Ray actor/task output
    r"(?:\S+ \[(?:stdout|stderr)\] )?"  # runner tag: "bench.node [stderr] "
    r"(?:rank:\s+(?P<parlai>\d+) \| )?"  # ParlAI: "rank:  3 | 2022-04-03 18:44:26,615 CRITICAL | ..."
    r"(?:\[pod/(?P<pod>[^/\]\s]+)/[^\]\s]*\]\s*)?"
    r"(?:\[?(?P<iso>(?P<Y>\d{4})-(?P<M>\d\d)-(?P<D>\d\d)[T ](?P<h>\d\d):(?P<m>\d\d):(?P<s>\d\d)(?:[.,](?P<f>\d{1,9}))?)"
    r"(?:Z|[+-]\d\d:?\d\d)?\]?\s*(?:(?:stdout|stderr) [FP] )?"
    r"(?:(?:INFO|ERROR|WARN(?:ING)?|DEBUG|CRITICAL|FATAL)\s+(?=\S))?)?"  # a level word after the time
    # torchrun --tee: "[defaultL]:" (local rank) and/or "[rankR]:" (global rank); R wins (multi-node)
    r"(?P<tee>(?:\[(?:rank|default)\d+\]:\s?)+)?"
    r"(?:\[?(?P<glog>[IWEF])(?P<gM>\d{1,2})(?P<gD>\d\d) (?P<gh>\d\d):(?P<gm>\d\d):(?P<gs>\d\d)\.(?P<gf>\d{1,9})\s+(?:\d+\s+)?)?"
)
# ISO-like timestamp somewhere near the start of the message (HF `[INFO|trainer.py:10] 2024-...`,
# python logging `[2024-04-26 13:57:20,757][INFO]`, DeepSpeed `[2024-...] [INFO] ...`).
_ISO_ANY = re.compile(
    r"(?P<Y>\d{4})-(?P<M>\d\d)-(?P<D>\d\d)[T ](?P<h>\d\d):(?P<m>\d\d):(?P<s>\d\d)(?:[.,](?P<f>\d{1,9}))?"
)
_SYSLOG = re.compile(
    r"(?P<mon>Jan|Feb|Mar|Apr|May|Jun|Jul|Aug|Sep|Oct|Nov|Dec) +(?P<D>\d{1,2}) "
    r"(?P<h>\d\d):(?P<m>\d\d):(?P<s>\d\d) (?P<host>[\w.-]+) "
)
# `dmesg -T`: [Fri Nov 20 10:30:41 2026] (the year is there, unlike syslog's)
_DMESG_T = re.compile(
    r"\[(?:Mon|Tue|Wed|Thu|Fri|Sat|Sun) (?P<mon>Jan|Feb|Mar|Apr|May|Jun|Jul|Aug|Sep|Oct|Nov|Dec) +(?P<D>\d{1,2}) "
    r"(?P<h>\d\d):(?P<m>\d\d):(?P<s>\d\d) (?P<Y>\d{4})\]\s*"
)
_NCCL_HOST = re.compile(r"(?<![\w.-])(?P<host>[A-Za-z][\w.-]*|[0-9a-f]{12}):(?P<pid>\d+):\d+ \[\d+\] (?:\S+:\d+ )?NCCL ")
_TEE_RANK = re.compile(r"\[rank(\d+)\]|\[default(\d+)\]")
_RANK_IN_TEXT = re.compile(r"\b[Rr]ank[\s:=\[]{0,3}(\d{1,6})\b")


@dataclass(frozen=True)
class LineInfo:
    time: float | None  # seconds (log's local clock, read as UTC: only used for ordering)
    rank: int | None
    host: str | None
    message: str
    pid: int | None = None  # the process that wrote it, where the line says (NCCL's host:pid:tid)


def _seconds(y: int, mo: int, d: int, h: int, mi: int, s: int, frac: str | None) -> float | None:
    if not (1 <= mo <= 12 and 1 <= d <= 31 and h < 24 and mi < 60 and s < 62):
        return None
    try:
        t = calendar.timegm((y, mo, d, h, mi, min(s, 59), 0, 0, 0))
    except (OverflowError, ValueError):
        return None
    return t + (int(frac) / 10 ** len(frac) if frac else 0.0)


def _from_groups(g: dict[str, str | None], year: int) -> float | None:
    y = int(g["Y"]) if g.get("Y") else year
    return _seconds(
        y,
        int(g["M"] or 0),
        int(g["D"] or 0),
        int(g["h"] or 0),
        int(g["m"] or 0),
        int(g["s"] or 0),
        g.get("f"),
    )


def _prefix_rank(g: dict[str, str | None]) -> int | None:
    if g["tee"]:
        found = _TEE_RANK.findall(g["tee"])
        glob = next((r for r, _ in found if r), None)  # [rankR] (global) beats [defaultL] (local)
        return int(glob if glob is not None else found[0][1])
    r = g["mpi"] or g["srun"] or g["parlai"]
    return int(r) if r else None


def parse_line(line: str, default_year: int = 1970) -> LineInfo:
    """Strip known prefixes; return the time, rank and host they carry and the message left."""
    m = _PREFIX.match(line)
    t: float | None = None
    rank: int | None = None
    host: str | None = None
    msg = line
    if m is not None and m.end() > 0:
        g = m.groupdict()
        host = g["pod"] or g["ray"] or g["pdsh"] or g["sstep"] or g["ompi"]
        if g["iso"]:
            t = _from_groups(g, default_year)
        rank = _prefix_rank(g)
        if g["glog"] and t is None:
            t = _seconds(
                default_year, int(g["gM"]), int(g["gD"]), int(g["gh"]), int(g["gm"]), int(g["gs"]), g["gf"]
            )
        msg = line[m.end() :]
    if t is None and msg.startswith("["):
        dm = _DMESG_T.match(msg)
        if dm is not None:
            t = _seconds(
                int(dm["Y"]), _MONTHS[dm["mon"]], int(dm["D"]), int(dm["h"]), int(dm["m"]), int(dm["s"]), None
            )
            msg = msg[dm.end() :]
    if t is None:
        s = _SYSLOG.match(msg)
        if s is not None:
            t = _seconds(
                default_year, _MONTHS[s["mon"]], int(s["D"]), int(s["h"]), int(s["m"]), int(s["s"]), None
            )
            host = host or s["host"]
            msg = msg[s.end() :]
        else:
            a = _ISO_ANY.search(msg, 0, 80)
            if a is not None:
                t = _from_groups(a.groupdict(), default_year)
    n = _NCCL_HOST.search(msg, 0, 200) if "NCCL" in msg else None
    pid = None
    if n is not None:
        host = host or n["host"]
        pid = int(n["pid"])
    return LineInfo(t, rank, host, msg, pid)


def rank_in_text(message: str) -> int | None:
    """A rank named inside the message (`[Rank 3]`, `Rank:2`, `rank=1`), or None."""
    m = _RANK_IN_TEXT.search(message)
    return int(m.group(1)) if m else None


def iso(t: float | None) -> str | None:
    if t is None:
        return None
    try:
        return datetime.fromtimestamp(t, tz=UTC).replace(tzinfo=None).isoformat(timespec="microseconds")
    except (OverflowError, OSError, ValueError):
        return None
