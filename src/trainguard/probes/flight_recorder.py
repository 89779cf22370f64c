"""torch's Flight Recorder, read from a hung worker: which collective each rank has in flight, in
each process group, with torch's own sequence numbers.

Every worker ``trainguard run`` starts serves its recorder on a unix socket (``worker/flight.py``
starts torch's ``_WorkerServer`` there, the server behind ``torch.distributed.elastic.
control_plane``). Its handlers are C++: they answer while the worker's main thread is blocked in
a collective, which is when the question is asked. With NCCL the recorder is the only place that
says which collective a rank waits on: its main thread waits in a stream synchronise, not in the
collective call a Python stack would show, and the GPU may read busy while a collective spins.

Handlers asked: ``fr_trace_json`` (the CPU backends' recorder: gloo) and ``dump_nccl_trace_json``
(NCCL's; absent from CPU builds of torch). Both answer torch's dump format: ``entries`` of
``{pg_id, process_group: [id, desc], collective_seq_id, p2p_seq_id, is_p2p, profiling_name,
state, retired, ...}``. An entry is a rank's call; ``retired`` when its work finished (gloo
leaves ``state`` at "scheduled"), ``state`` "completed" when NCCL's end event fired.
The handlers' names and this format are torch's, not public; checked on torch 2.13 and 2.14
(torch_compat.CHECKED_ON; tests/test_flight_recorder.py under bench/compat.sh). A handler that is
missing or an entry without these fields is skipped: the view then says why it has nothing.

The socket sits beside the worker's ring (``<ring prefix>-a<attempt>-r<rank>.fr``, the prefix
carrying the agent's pid and a random token), made with mode 0600 by the worker: only the user's
own processes can ask.
"""

from __future__ import annotations

import http.client
import json
import socket
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from trainguard.worker.flight import socket_path

__all__ = ["FlightView", "GroupFlight", "InFlight", "parse", "read", "read_all", "socket_path", "worker_env"]

ENV_BUFFER = "TORCH_FR_BUFFER_SIZE"  # torch's recorder size (entries); 0 = off
ENV_BUFFER_NCCL = "TORCH_NCCL_TRACE_BUFFER_SIZE"  # its older name, NCCL only
DEFAULT_ENTRIES = 2000  # torch's own default for NCCL; gloo records nothing unless told
HANDLERS = ("fr_trace_json", "dump_nccl_trace_json")
MAX_BYTES = 64 << 20
TIMEOUT_S = 3.0


def worker_env(environ: dict[str, str]) -> dict[str, str]:
    """The recorder on in every worker (torch leaves gloo's off): a user's own setting wins,
    0 included. Its cost is one small record per collective (no stacks: torch captures those only
    when told)."""
    if ENV_BUFFER in environ or ENV_BUFFER_NCCL in environ:
        return {}
    return {ENV_BUFFER: str(DEFAULT_ENTRIES)}


@dataclass(frozen=True)
class InFlight:
    seq: int  # torch's sequence number of the call in its process group
    op: str  # "all_reduce" (the backend's prefix dropped)
    state: str  # scheduled / started (NCCL with timing)


@dataclass(frozen=True)
class GroupFlight:
    """One rank's view of one process group."""

    pg: str  # "0" (the default group), torch's pg id
    desc: str  # "default_pg", or the name the user gave it
    in_flight: InFlight | None  # its oldest call not finished, if any
    history: tuple[tuple[int, str], ...] = ()  # (seq, op) of the calls still in the buffer, oldest first

    @property
    def first_seq(self) -> int:
        return self.history[0][0] if self.history else 0

    @property
    def last_seq(self) -> int:
        """The newest collective the rank has called in the group."""
        return self.history[-1][0] if self.history else 0


@dataclass(frozen=True)
class FlightView:
    rank: int
    groups: dict[str, GroupFlight] = field(default_factory=dict)  # pg id -> view
    error: str | None = None  # why there is none (recorder off, worker gone, ...)

    def to_dict(self) -> dict[str, Any]:
        if self.error:
            return {"error": self.error}
        return {g.pg: {"desc": g.desc, "last_seq": g.last_seq, "first_seq": g.first_seq,
                       "in_flight": None if g.in_flight is None else
                       {"seq": g.in_flight.seq, "op": g.in_flight.op, "state": g.in_flight.state}}
                for g in self.groups.values()}  # fmt: skip


def op_name(profiling_name: str) -> str:
    """``nccl:all_reduce`` -> ``all_reduce`` (the name a Python stack shows)."""
    return profiling_name.split(":", 1)[-1] if profiling_name else "?"


def parse(rank: int, dumps: list[dict[str, Any]]) -> FlightView:
    """A rank's view from its recorders' dumps (gloo's and NCCL's; each process group is one
    backend's). Collectives only: point-to-point calls have their own sequence."""
    by_pg: dict[str, list[dict[str, Any]]] = {}
    desc: dict[str, str] = {}
    for d in dumps:
        for e in d.get("entries") or []:
            if not isinstance(e, dict) or e.get("is_p2p") or not isinstance(e.get("collective_seq_id"), int):
                continue
            if e["collective_seq_id"] <= 0:
                continue
            pg = e.get("process_group") or [str(e.get("pg_id", "?")), ""]
            key = str(pg[0])
            by_pg.setdefault(key, []).append(e)
            desc[key] = str(pg[1]) if len(pg) > 1 else ""
    groups = {}
    for pg, entries in by_pg.items():
        entries.sort(key=lambda e: e["collective_seq_id"])
        history = tuple((e["collective_seq_id"], op_name(str(e.get("profiling_name", "")))) for e in entries)
        pending = next((i for i, e in enumerate(entries) if not _finished(e)), None)
        in_flight = None if pending is None else InFlight(*history[pending], str(entries[pending].get("state", "")))
        groups[pg] = GroupFlight(pg, desc[pg], in_flight, history)
    return FlightView(rank, groups)


def _finished(e: dict[str, Any]) -> bool:
    return bool(e.get("retired")) or e.get("state") == "completed"


# --- reading a worker's recorder -----------------------------------------------------------------
class _UnixConnection(http.client.HTTPConnection):
    def __init__(self, path: str, timeout: float) -> None:
        super().__init__("localhost", timeout=timeout)
        self._path = path

    def connect(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(self.timeout)
        self.sock.connect(self._path)


def ask(path: str, handler: str, timeout: float = TIMEOUT_S) -> dict[str, Any] | None:
    """One handler's JSON answer; None when the worker's torch has no such handler. Raises OSError
    (no server, no answer in time) or ValueError (not JSON, too big)."""
    conn = _UnixConnection(path, timeout)
    try:
        # No stack per entry (NCCL records one; its handlers default to sending them): the
        # sequence needs none, and 2000 of them would make the answer megabytes.
        conn.request("POST", f"/handler/{handler}?includestacktraces=false")
        resp = conn.getresponse()
        body = resp.read(MAX_BYTES + 1)
    except http.client.HTTPException as exc:  # (a timeout is an OSError already)
        raise OSError(f"{type(exc).__name__}: {exc}") from None
    finally:
        conn.close()
    if resp.status == 404 or (resp.status >= 400 and b"handler" in body.lower() and b"not found" in body.lower()):
        return None
    if resp.status != 200:
        raise ValueError(f"HTTP {resp.status}: {body[:200].decode(errors='replace')}")
    if len(body) > MAX_BYTES:
        raise ValueError(f"answer over {MAX_BYTES} bytes")
    out = json.loads(body)
    if not isinstance(out, dict):
        raise ValueError("answer is not a JSON object")
    return out


def read(rank: int, path: str, timeout: float = TIMEOUT_S) -> FlightView:
    """A worker's view: every handler's dump that its torch has."""
    dumps, errors = [], []
    for handler in HANDLERS:
        try:
            got = ask(path, handler, timeout)
        except (OSError, ValueError) as exc:
            errors.append(f"{handler}: {exc}")
            continue
        if got is not None:
            dumps.append(got)
    if not dumps:
        return FlightView(rank, error="; ".join(errors) or "no flight recorder handler")
    view = parse(rank, dumps)
    if not view.groups:
        return FlightView(rank, error="the flight recorder holds no collective (off: TORCH_FR_BUFFER_SIZE=0?)")
    return view


def read_all(paths: dict[int, str], timeout: float = TIMEOUT_S) -> dict[int, FlightView]:
    """Each local rank's view (rank -> its socket), asked at once: one that does not answer costs
    the timeout once, not once per rank."""
    if not paths:
        return {}
    with ThreadPoolExecutor(max_workers=min(8, len(paths)), thread_name_prefix="trainguard-flight") as pool:
        views = pool.map(lambda item: read(item[0], item[1], timeout), sorted(paths.items()))
        return {v.rank: v for v in views}
