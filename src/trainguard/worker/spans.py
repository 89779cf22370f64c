"""The in-process span recorder and the explicit API: ``trainguard.span(name)``, ``trainguard.step()``.

Under ``trainguard run`` the bootstrap creates one ``Recorder`` per worker, writing to the rank's
shared-memory ring; the automatic hooks (``trainguard.worker.hooks``) and the explicit API both go
through it. Outside ``trainguard run`` there is no recorder and the API does nothing, cheaply.

Hot-path rules: no disk, no socket, no lock, no allocation beyond a tuple; one ``perf_counter_ns``
per edge; the switch word is read straight from the shared header. Records made on another thread
(autograd / comm-hook callbacks) are queued and written by the owning thread at its next record,
so the ring keeps a single writer. On GPU, spans that measure device work take CUDA events and are
resolved later, when the events have completed — never a synchronize.

The ring may start private (``claim_path``): the first completed step moves it into the rank's
shared file, so of all the processes a rank's command starts (wrappers, helpers, data workers) the
one that trains owns the ring. A forked child gets a throw-away ring (``detach``): two writers must
never share one.
"""

from __future__ import annotations

import sys
import threading
from collections import deque
from collections.abc import Callable
from time import perf_counter_ns
from typing import Any

from trainguard.worker import ring as R

_get_ident = threading.get_ident
_pack_into = R.RECORD.pack_into
_RECORDS_OFF = R.RECORDS_OFF
_IDX_FLAGS = R.IDX_FLAGS32
MAX_PENDING = 8192  # bound on queued cross-thread records and unresolved CUDA spans


class Recorder:
    def __init__(self, writer: R.RingWriter, claim_path: str | None = None,
                 on_claim: Callable[[str], None] | None = None) -> None:  # fmt: skip
        self.writer = writer
        self._claim_path = claim_path  # where a private ring moves at the first step
        self._on_claim = on_claim
        self._flags = writer.u32  # live view: the agent flips bits here
        self._owner = _get_ident()
        self._pending: deque[tuple[int, int, int, int, int]] = deque()
        self._cuda_pending: deque[tuple[int, int, int, int, Any, Any]] = deque()
        self._event_pool: list[Any] = []
        self.steps = 0  # completed steps
        self._step_start = perf_counter_ns()  # step 1 starts when the worker does (includes setup)
        self.explicit_steps = False  # the user calls trainguard.step(): optimizer hooks stop counting

    # ---- switch -------------------------------------------------------------------------------
    def enabled(self, kind: int) -> bool:
        return bool(self._flags[R.IDX_FLAGS32] & R.KIND_FLAG[kind])

    def flags(self) -> int:
        return self._flags[R.IDX_FLAGS32]

    def collective(self, op_id: int) -> None:
        """A collective started (always on): the rank's sequence number and calls per operation."""
        self.writer.collective(op_id)

    # ---- records ------------------------------------------------------------------------------
    def record(self, kind: int, start_ns: int, end_ns: int, name_id: int = 0, aux: int = 0) -> None:
        """Write one finished span (caller checked the switch). Safe from any thread."""
        if _get_ident() != self._owner:
            if len(self._pending) < MAX_PENDING:
                self._pending.append((kind, name_id, start_ns, end_ns, aux))
            else:
                self.writer.add_dropped(1)
            return
        if self._pending:
            self._flush_pending()
        # RingWriter.write, inlined: this is the hot path.
        w = self.writer
        i = w.write_index
        w.write_index = i + 1
        _pack_into(w.mm, _RECORDS_OFF + (i & w.mask) * 32, kind, aux, name_id, self.steps + 1, start_ns, end_ns, i + 1)

    def _flush_pending(self) -> None:
        step = self.steps + 1
        pending = self._pending
        while pending:
            kind, name_id, start_ns, end_ns, aux = pending.popleft()
            self.writer.write(kind, name_id, step, start_ns, end_ns, aux)

    def step(self, now: int | None = None) -> None:
        """A step ended: header step fields always; a Step record when the switch is on."""
        if now is None:
            now = perf_counter_ns()
        start = self._step_start
        n = self.steps + 1
        if n == 1:
            self._owner = _get_ident()  # the thread that runs the training loop writes the ring
            if self._claim_path is not None:
                self._claim()
        if self._pending and _get_ident() == self._owner:
            self._flush_pending()
        if self._cuda_pending:
            self.resolve_cuda()
        self.steps = n
        self.writer.write_step(n, now, now - start)
        if self._flags[R.IDX_FLAGS32] & R.FLAG_BASIC and _get_ident() == self._owner:
            self.writer.write(R.STEP, 0, n, start, now, 0)
        self._step_start = now

    # ---- ownership ----------------------------------------------------------------------------
    def _claim(self) -> None:
        path, self._claim_path = self._claim_path, None
        assert path is not None
        try:
            self.writer.claim(path)
        except FileExistsError:
            return  # another process of this rank trains and owns the ring: this one stays private
        except OSError as exc:
            print(f"trainguard: profiling disabled: {exc}", file=sys.stderr, flush=True)
            return
        self._flags = self.writer.u32
        if self._on_claim is not None:
            self._on_claim(path)

    def detach(self) -> None:
        """In a forked child: write to a private throw-away ring with everything switched off."""
        self.writer = R.RingWriter(None, 0, capacity=16, flags=0)
        self._flags = self.writer.u32
        self._claim_path = None
        self._pending.clear()
        self._cuda_pending.clear()

    # ---- CUDA ---------------------------------------------------------------------------------
    def cuda_begin(self) -> tuple[int, Any]:
        """Start a device-timed span on the current stream: (cpu start ns, start event)."""
        ev = self._event()
        ev.record()
        return perf_counter_ns(), ev

    def cuda_end(self, kind: int, begun: tuple[int, Any], name_id: int = 0) -> None:
        cpu_start, ev_start = begun
        ev_end = self._event()
        ev_end.record()
        if len(self._cuda_pending) >= MAX_PENDING:
            self.writer.add_dropped(1)
            self._event_pool += (ev_start, ev_end)
            return
        self._cuda_pending.append((kind, name_id, self.steps + 1, cpu_start, ev_start, ev_end))

    def resolve_cuda(self) -> None:
        """Write the device-timed spans whose end event has completed (query(): no sync)."""
        pending = self._cuda_pending
        while pending:
            kind, name_id, step, cpu_start, ev_start, ev_end = pending[0]
            if not ev_end.query():
                break  # same stream order: later ones are not done either
            pending.popleft()
            dur_ns = int(ev_start.elapsed_time(ev_end) * 1e6)
            self.writer.write(kind, name_id, step, cpu_start, cpu_start + dur_ns, 1)
            self._event_pool += (ev_start, ev_end)

    def _event(self) -> Any:
        if self._event_pool:
            return self._event_pool.pop()
        import torch

        return torch.cuda.Event(enable_timing=True)


_recorder: Recorder | None = None


def recorder() -> Recorder | None:
    return _recorder


def set_recorder(rec: Recorder | None) -> None:
    global _recorder
    _recorder = rec


class span:  # noqa: N801 -- used as a function: trainguard.span("name")
    """Time a named block: ``with trainguard.span("fetch"): ...``. No-op outside ``trainguard run``.

    A class rather than a function returning one: one Python call less on the hot path."""

    __slots__ = ("_name", "_start")

    def __init__(self, name: str) -> None:
        self._name = name

    def __enter__(self) -> span:
        self._start = perf_counter_ns()
        return self

    def __exit__(self, *exc: object) -> None:
        rec = _recorder
        if rec is None or not rec._flags[_IDX_FLAGS] & 1:  # FLAG_BASIC
            return
        end = perf_counter_ns()
        nid = rec.writer.names.get(self._name)
        if nid is None:
            nid = rec.writer.name_id(self._name)
        rec.record(R.USER, self._start, end, nid)


def record_phase(name: str, start_ns: int, kind: int = R.USER) -> None:
    """Record a span that started at ``start_ns`` (``time.perf_counter_ns()``) and ends now: for
    phases a framework only reports once they are over (``trainguard.integrations`` callbacks).
    ``kind`` USER records it under ``name``; another kind (SAVE_CHECKPOINT) under the kind's name."""
    rec = _recorder
    if rec is None or not rec.enabled(kind):
        return
    nid = rec.writer.name_id(name) if kind == R.USER else 0
    rec.record(kind, start_ns, perf_counter_ns(), nid)


def step() -> None:
    """Mark the end of a training step explicitly. Once called, the automatic optimizer-step hook
    stops counting steps (so steps are not counted twice)."""
    rec = _recorder
    if rec is None:
        return
    if not rec.explicit_steps:
        rec.explicit_steps = True
        if rec.steps:  # the optimizer hook already ended this step: this call is the same boundary
            return
    rec.step()
