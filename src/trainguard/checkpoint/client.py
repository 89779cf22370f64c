"""The worker side: ``save`` copies a state into this rank's shared-memory slot and returns;
``load_latest`` finds the newest state every rank can load (memory first, then verified disk).

Under ``trainguard run`` the agent owns the shm directory and persists snapshots (see
``trainguard.monitors.checkpoint``). Without an agent (plain python / torchrun) the process
runs the same persister on a thread of its own ("local mode"): saves still return at memory speed,
but a snapshot survives the process only once it is on disk.

After a change of world size (an elastic job that lost or gained nodes) the ranks settle on the
newest step every rank can load at the new size: replicated state (DDP: every rank's copy is the
same) from any old rank's copy, in this node's shared memory or on disk; sharded state (DTensor)
resharded by torch.distributed.checkpoint from every old rank's file on disk (see ``reshard``).
What cannot be loaded that way is refused: ``IncompatibleCheckpoint`` when nothing else is left,
never a silently wrong or silently older state.

CUDA tensors are copied device->host with ``non_blocking=True`` into the slot, which is registered
as pinned memory (``cudaHostRegister``), on each tensor's current stream: the host does not wait,
and kernels queued later on that stream (the next optimizer step) run after the copy, so the
snapshot is consistent. A helper thread waits for the copy's CUDA event and only then marks the
slot complete.
"""

from __future__ import annotations

import atexit
import ctypes
import logging
import math
import operator
import os
import queue
import threading
import time
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from trainguard.checkpoint import disk, shmfault
from trainguard.checkpoint.format import (
    FORMAT,
    FormatError,
    decode_manifest,
    encode_manifest,
    flatten,
    is_sharded,
    parse_entries,
    plan_layout,
    tensor_view,
    unflatten,
)
from trainguard.checkpoint.persist import Persister, rescue_orphan, write_report
from trainguard.checkpoint.reshard import IncompatibleCheckpoint, load_resharded, why_not_reshardable
from trainguard.checkpoint.shm import (
    Slot,
    make_shm_dir,
    payload_offsets,
    release_shm_dir,
    slot_files,
    slot_path,
)

log = logging.getLogger(__name__)

ENV_SHM_DIR = "TRAINGUARD_CKPT_SHM_DIR"
ENV_CKPT_DIR = "TRAINGUARD_CKPT_DIR"
ENV_KEEP = "TRAINGUARD_CKPT_KEEP"
ENV_OVERLAP = "TRAINGUARD_CKPT_OVERLAP"
# Set by the agent for a NaN replay (policy.py, NaN triage): load_latest skips states that hold a
# non-finite floating-point value, so the replay starts from the newest snapshot before the NaN.
ENV_FINITE_ONLY = "TRAINGUARD_CKPT_FINITE_ONLY"
# Copy inside save() unless told otherwise: on CPU training that keeps every core busy there are no
# idle cycles to hide a copy in, and a concurrent copy slows the steps more than a short memmove in
# the call (bench/checkpoint.py measures both). CUDA tensors are always copied asynchronously.
OVERLAP_DEFAULT = False
ENV_SHM_ROOT = "TRAINGUARD_CKPT_SHM_ROOT"  # the tmpfs for snapshot dirs (the agent's default; local mode's too)
MAX_CANDIDATES = 64
# Slots per rank. Three, not two: the persister pins the slot it writes (for seconds when it gets
# little CPU), and a rank must hold, whenever it can die, its newest committed step and, once the
# next is committed, the step before it too; the ranks of a job are at most one save apart, so
# that is the step every rank holds and a restart resumes. With two slots and one pinned, the
# rank could only write over its newest snapshot (left holding the pinned older step, which the
# other ranks had rotated past: no common step, a restart from scratch) or skip saves (the same,
# a few saves later).
NSLOTS = 3
# Slots per rank, when the agent says so (TRAINGUARD_CKPT_SLOTS, NSLOTS..MAX_SLOTS).
ENV_SLOTS = "TRAINGUARD_CKPT_SLOTS"
MAX_SLOTS = 4
_WORLD_BITS = 20  # candidate keys: step << 20 | world size


MAX_STEP = (1 << (63 - _WORLD_BITS)) - 1  # candidate keys (step << 20 | world) are int64 tensors


def check_step(step: Any) -> int:
    """``step`` as an int, or one clear error: TypeError unless it is an integer (an ``__index__``
    type such as numpy.int64 counts; bool, float and str do not: ``int()`` would quietly turn
    1.9 into 1, True into 1 and NaN into a bare ValueError from deep inside), ValueError when it is
    negative or above MAX_STEP (steps order the snapshots; a negative one sorts before every real one)."""
    if isinstance(step, bool) or not hasattr(type(step), "__index__"):
        raise TypeError(f"checkpoint step must be an integer >= 0, not {type(step).__name__} {step!r}")
    value = operator.index(step)
    if not 0 <= value <= MAX_STEP:
        raise ValueError(f"checkpoint step must be an integer from 0 to {MAX_STEP}, not {value}")
    return value


@dataclass(frozen=True)
class _Source:
    kind: str  # "memory" | "disk"
    rank: int  # whose copy (the rank that saved it)
    path: Path | None = None  # the slot file, for memory
    # When that copy was taken (a slot's publish time, a file's save time): where one step exists
    # twice (a dead attempt's copy beside the one saved after the restart), the newer copy wins.
    saved: float = 0.0


@dataclass
class _Candidate:
    """One step at one world size that this rank can load, and from where (best first)."""

    step: int
    world: int
    sharded: bool
    sources: list[_Source] = field(default_factory=list)

    @property
    def key(self) -> int:
        return self.step << _WORLD_BITS | self.world


@dataclass
class _Pending:
    """A save whose copies are not all finished: queued device->host copies (CUDA events) and,
    with ``overlap``, CPU copies in chunks that the helper thread takes one by one at idle
    priority, and the training thread takes over (``_finish``) when it needs the state."""

    index: int
    seq: int
    step: int
    manifest_len: int
    data_len: int
    events: list[Any]
    data: torch.Tensor | None = None  # the slot's data region
    # (byte offset in ``data``, bytes, source tensor, byte offset in the source or -1 for a whole
    # tensor that is not plain memory, its version counter at save)
    items: list[tuple[int, int, torch.Tensor, int, int]] = field(default_factory=list)
    taken: int = 0  # items handed out
    left: int = 0  # items not copied yet
    changed: str | None = None  # a source changed in place before its copy
    cond: threading.Condition = field(default_factory=threading.Condition)
    done: threading.Event = field(default_factory=threading.Event)
    waited: bool = False  # the training thread waits for it: the helper must not run at idle priority

    def take(self) -> tuple[int, int, torch.Tensor, int, int] | None:
        with self.cond:
            if self.taken >= len(self.items):
                return None
            self.taken += 1
            return self.items[self.taken - 1]

    def copied(self, item: tuple[int, int, torch.Tensor, int, int]) -> None:
        if item[2]._version != item[4]:
            self.changed = f"a tensor of shape {tuple(item[2].shape)} was modified during the overlapped copy"
        with self.cond:
            self.left -= 1
            if self.left == 0:
                self.cond.notify_all()

    def all_copied(self) -> None:
        with self.cond:
            while self.left:
                self.cond.wait()


_CHUNK = 4 << 20  # overlapped copies in 4 MiB pieces: whoever needs the state soon takes the rest


class _StateChanged(Exception):
    """A tensor was changed in place while its overlapped copy was pending."""


class Checkpointer:
    def __init__(self, shm_dir: Path, ckpt_dir: Path, rank: int, world: int,
                 persister: Persister | None = None, nslots: int | None = None) -> None:
        self.shm_dir = Path(shm_dir)
        self.ckpt_dir = Path(ckpt_dir)
        self.rank = rank
        self.world = world
        self.saves = 0
        self.skipped = 0
        self._persister = persister  # local mode only: we own the shm dir and the persister
        self.nslots = nslots or _env_slots()
        self._slots: list[Slot | None] = [None] * self.nslots
        self._bufs: list[torch.Tensor | None] = [None] * self.nslots
        self._pinned: list[bool] = [False] * self.nslots
        self._latest: int | None = None  # slot index of our newest complete snapshot
        self._seq = 0
        self._pending: _Pending | None = None
        self._completer: queue.Queue[_Pending | None] | None = None
        self._trouble = shmfault.Reporter()  # failed saves: reported at the first and every 10th after
        self._usable = list(range(self.nslots))  # fewer once the tmpfs had no room for a slot
        self._overlap_off = False
        # Seconds the training thread spent finishing overlapped copies (copying what the helper
        # had not taken, waiting for the piece it was on): the overlap's stall beside save()'s own.
        self.finish_wait_s = 0.0
        self._helper_tid: int | None = None
        self._helper_idle = False
        self._priority_lock = threading.Lock()
        self._lock = threading.Lock()
        self._adopt_existing_slots()

    # --- construction ----------------------------------------------------------------------------
    @classmethod
    def from_env(cls) -> Checkpointer:
        rank, world = _rank_world()
        shm = os.environ.get(ENV_SHM_DIR)
        ckpt_dir = Path(
            os.environ.get(ENV_CKPT_DIR)
            or Path(os.environ.get("TRAINGUARD_RUN_DIR", ".")) / "checkpoints"
        )
        if shm:
            return cls(Path(shm), ckpt_dir, rank, world)
        # Local mode: no agent. Slots in a private shm dir, persisted by a thread of this process.
        root = _local_shm_root()
        keep = _env_keep()
        shm_dir = make_shm_dir(root, info={"ckpt_dir": str(ckpt_dir.resolve()), "keep": keep},
                               on_orphan=lambda d: rescue_orphan(d, _log_event, ckpt_dir, keep))
        persister = Persister(shm_dir, ckpt_dir, keep, _log_event)
        self = cls(shm_dir, ckpt_dir, rank, world, persister)
        persister.start()
        atexit.register(self.close)
        return self

    def _adopt_existing_slots(self) -> None:
        """After a restart on the same node: find the snapshots the previous process left. Sequence
        numbers continue above every slot in the directory (whichever rank left it), so the
        persister's "newest first" holds when a node hosts other ranks after a world change."""
        for path, _ in self._slot_files():
            hdr, _ = _peek_slot(path, manifest=False)
            if hdr is not None:
                self._seq = max(self._seq, hdr.seq)
        for i in range(self.nslots):
            path = slot_path(self.shm_dir, self.rank, i)
            if not path.exists():
                continue
            try:
                slot = Slot.open(path, populate=True)
            except (OSError, ValueError) as exc:
                log.warning("checkpoint: ignoring unreadable slot %s: %s", path, exc)
                continue
            self._slots[i] = slot
            hdr = slot.header()
            if hdr is None:
                continue
            self._seq = max(self._seq, hdr.seq)
            if hdr.complete and (self._latest is None or hdr.seq > self._header_seq(self._latest)):
                self._latest = i

    def _header_seq(self, i: int) -> int:
        slot = self._slots[i]
        hdr = slot.header() if slot is not None else None
        return hdr.seq if hdr is not None else 0

    def _complete_seq(self, i: int) -> int:
        """The slot's snapshot seq when it holds a complete one, else -1 (overwritten first)."""
        slot = self._slots[i]
        hdr = slot.header() if slot is not None else None
        return hdr.seq if hdr is not None and hdr.complete else -1

    # --- save ------------------------------------------------------------------------------------
    def save(self, state: Any, step: int, overlap: bool | None = None) -> bool:
        """Snapshot ``state`` into shared memory. True when taken; False when skipped or failed
        (reported as an event; training goes on). Raises TypeError for values it cannot store and
        for a ``step`` that is not an integer, ValueError for a negative or too large one
        (``check_step``): nothing is saved then.

        ``overlap`` (default: env TRAINGUARD_CKPT_OVERLAP=1, else off): CPU tensors are copied by a
        helper thread, at idle CPU priority, while training goes on; the next optimizer step,
        and the next forward of a module that has buffers (BatchNorm statistics, DDP's buffer
        broadcast), wait until the copy is done (the helper then runs at normal priority), so the
        snapshot is still exactly the state at this call. An in-place change made elsewhere before
        the copy (seen by the tensors' version counters) discards that snapshot, reports
        ``checkpoint_overlap_off`` and makes later saves copy inside this call."""
        step = check_step(step)
        start = time.perf_counter_ns()
        try:
            return self._save(state, step, overlap)
        finally:
            _record_stall(start)

    def _save(self, state: Any, step: int, overlap: bool | None) -> bool:
        tree, tensors = flatten(state)
        entries, data_len = plan_layout(tensors)
        meta = {"format": FORMAT, "rank": self.rank, "world_size": self.world, "step": int(step),
                "time": time.time(), "sharded": is_sharded(tree), "tree": tree,
                "tensors": [e.to_json() for e in entries]}
        raw = encode_manifest(meta)
        manifest_off, data_off = payload_offsets(len(raw))
        if overlap is None:
            overlap = os.environ.get(ENV_OVERLAP, "1" if OVERLAP_DEFAULT else "0") == "1"
        overlap = overlap and not self._overlap_off
        with self._lock:
            try:
                self._wait_pending()
                slot, index = self._usable_slot(step, data_off + data_len)
                if slot is None:
                    if index is None:
                        return False  # skipped (reported)
                    return self._save_direct(meta, entries, tensors, data_len)
                self._seq += 1
                slot.begin_write(self._seq)
                slot.mm[manifest_off : manifest_off + len(raw)] = raw
                buf = self._buf(index)
                pending = _Pending(index, self._seq, int(step), len(raw), data_len, [],
                                   buf[data_off : data_off + data_len])
                self._copy_tensors(pending.data, entries, tensors, index, pending, overlap)
                pending.left = len(pending.items)
                if pending.events or pending.items:
                    if pending.items:
                        _install_guards(self)
                    self._pending = pending
                    self._queue_completion(pending)
                else:
                    self._publish(pending)
            except Exception as exc:
                self._note_failure(step, exc)
                return False
        self.saves += 1
        self._trouble.ok()  # in shared memory again: the next failure is reported at once
        return True

    def _target_slot(self) -> int | None:
        """The slot to write: the oldest one not holding our newest snapshot, unless the agent is
        persisting it right now (pinned); then the next oldest. Never the newest one while another
        slot is usable: a death in the middle of that write would leave only older steps, maybe
        none that the other ranks still hold (see NSLOTS). None: every other slot is pinned (the
        caller waits for the agent, or skips)."""
        order = sorted((i for i in self._usable if i != self._latest), key=self._complete_seq)
        if self._latest is not None and len(self._usable) == 1:  # a full tmpfs left only this one
            order.append(self._latest)
        for i in order:
            slot = self._slots[i]
            hdr = slot.header() if slot is not None else None
            if hdr is None or not hdr.pin:
                return i
        return None

    def _usable_slot(self, step: int, size: int) -> tuple[Slot | None, int | None]:
        """(slot, index) to write this snapshot into; (None, None): skipped (the agent holds the
        slot); (None, -1): shared memory is not usable, the snapshot goes straight to disk. A
        vanished directory is recreated and a full tmpfs evicts this rank's oldest snapshot first
        (``shmfault``), each said in a ``checkpoint_shm_*`` event."""
        if not self._shm_present(step):
            return None, -1
        while self._usable:
            index = self._target_slot()
            if index is None and len(self._usable) < self.nslots:
                index = self._wait_unpinned()  # a full tmpfs left fewer slots: skipping would lose every save the agent overlaps
            if index is None:
                self._note_skip(step)
                return None, None
            try:
                slot = self._slot_for(index, size)
            except OSError as exc:
                if not shmfault.is_full(exc):
                    raise
                self._evict(index, step, size, exc)
                continue
            return slot, index
        return None, -1

    def _wait_unpinned(self) -> int | None:
        """Fewer slots than wanted (a full tmpfs) and the agent is persisting them: wait, up to
        ``shmfault.PIN_WAIT_S``, for it to finish (it is writing what this save would replace)."""
        deadline = time.monotonic() + shmfault.PIN_WAIT_S
        while time.monotonic() < deadline:
            time.sleep(0.002)
            index = self._target_slot()
            if index is not None:
                return index
        return None

    def _shm_present(self, step: int) -> bool:
        """False when this rank's snapshots cannot be in the shm directory (removed or replaced
        under the job, and not recreatable): then the save goes to disk."""
        why = shmfault.lost(self.shm_dir, self._slots)
        if why is None:
            return True
        self._drop_slots()
        why_not = shmfault.recreate(self.shm_dir)
        if why_not is None:
            self._shm_trouble("shm_lost", "recreated", step, f"{why}: new slots in the recreated (owner-only) "
                              "directory; snapshots taken before are only what is on disk", why)
            return True
        cannot = "it cannot be recreated" + ("" if why_not == why else f" ({why_not})")
        self._shm_trouble("shm_lost", "direct_to_disk", step, f"{why} and {cannot}: snapshot written straight to "
                          f"{self.ckpt_dir} by the training process", why if why_not == why else f"{why}; {why_not}")
        return False

    def _evict(self, index: int, step: int, size: int, exc: OSError) -> None:
        """No room in the tmpfs for slot ``index`` (this rank's oldest snapshot, or a slot not made
        yet): give its memory back and keep one slot fewer, so the newest snapshot replaces the oldest.
        A slot not made yet goes with the others not made yet (as big, they do not fit either), so
        the one report says how many slots the rank really keeps."""
        unmade = [i for i in self._usable if self._slots[i] is None] if self._slots[index] is None else [index]
        for i in unmade:
            self._give_back(i)
        where = f"{self.shm_dir.parent} has no room for a {size / 1e6:.1f} MB slot ({exc.strerror or exc})"
        if self._usable:
            self._shm_trouble("shm_full", "evicted_oldest", step, f"{where}: evicted this rank's oldest snapshot; "
                              f"keeping {len(self._usable)} slot(s) instead of {self.nslots}, each new snapshot "
                              "replaces the oldest", where)
        else:
            self._shm_trouble("shm_full", "direct_to_disk", step, f"{where}, not even for one slot: snapshots are "
                              f"written straight to {self.ckpt_dir} by the training process", where)

    def _give_back(self, index: int) -> None:
        self._usable.remove(index)
        self._release_buf(index)
        slot = self._slots[index]
        self._slots[index] = None
        if slot is not None:
            slot.close()
        slot_path(self.shm_dir, self.rank, index).unlink(missing_ok=True)
        if self._latest == index:
            self._latest = None

    def _drop_slots(self) -> None:
        """Forget every slot (their files are gone): the next save creates new ones."""
        for i in range(self.nslots):
            self._release_buf(i)
            slot = self._slots[i]
            if slot is not None:
                slot.close()
            self._slots[i] = None
        self._latest = None

    def _save_direct(self, meta: dict[str, Any], entries: list, tensors: list[torch.Tensor], data_len: int) -> bool:
        shmfault.write_direct(self.ckpt_dir, meta, entries, tensors, data_len, _env_keep())
        self.saves += 1
        return True

    def _shm_trouble(self, kind: str, fallback: str, step: int, message: str, problem: str) -> None:
        """One failed save of shared memory: an error event (kind ``checkpoint_<kind>``) and a
        console warning at the first and every ``shmfault.REPORT_EVERY`` failed saves after."""
        if not self._trouble.failed(kind, fallback):
            return
        text = f"rank {self.rank} step {step}: {message} ({self._trouble.total} failed save(s) so far)"
        log.warning("checkpoint: %s", text)
        self._report(f"checkpoint_{kind}", "error", text,
                     {"step": step, "fallback": fallback, "problem": problem, "shm_dir": str(self.shm_dir),
                      "failed_saves": self._trouble.total, "report_every": shmfault.REPORT_EVERY})

    def _slot_for(self, index: int, size: int) -> Slot:
        slot = self._slots[index]
        if slot is None:
            slot = Slot.create(slot_path(self.shm_dir, self.rank, index), size)
            self._slots[index] = slot
        elif size > slot.size:
            self._release_buf(index)
            slot.grow(size)
        return slot

    def _buf(self, index: int) -> torch.Tensor:
        buf = self._bufs[index]
        if buf is None:
            slot = self._slots[index]
            assert slot is not None
            buf = torch.frombuffer(slot.mm, dtype=torch.uint8)
            self._bufs[index] = buf
        return buf

    def _release_buf(self, index: int) -> None:
        buf = self._bufs[index]
        if buf is not None and self._pinned[index]:
            _cuda_host_unregister(buf.data_ptr())
            self._pinned[index] = False
        self._bufs[index] = None

    def _copy_tensors(self, data: torch.Tensor, entries: list, tensors: list[torch.Tensor], index: int,
                      pending: _Pending, overlap: bool) -> None:
        devices: set[torch.device] = set()
        for e, t in zip(entries, tensors, strict=True):
            if e.nbytes == 0:
                continue
            if overlap and t.device.type == "cpu":  # views are made when copied, not here
                if _plain(t):
                    pending.items.extend((e.offset + a, min(_CHUNK, e.nbytes - a), t, a, t._version)
                                         for a in range(0, e.nbytes, _CHUNK))
                else:
                    pending.items.append((e.offset, e.nbytes, t, -1, t._version))
                continue
            dst = data[e.offset : e.offset + e.nbytes].view(t.dtype).view(t.shape)
            if t.device.type == "cuda":
                if not self._pinned[index]:
                    self._pinned[index] = _cuda_host_register(self._buf(index))
                dst.copy_(t, non_blocking=True)
                devices.add(t.device)
            else:
                dst.copy_(t)
        for dev in devices:
            ev = torch.cuda.Event()
            ev.record(torch.cuda.current_stream(dev))
            pending.events.append(ev)

    def _publish(self, p: _Pending) -> None:
        slot = self._slots[p.index]
        assert slot is not None
        slot.publish(p.seq, p.step, p.manifest_len, p.data_len, self.rank, self.world)
        self._latest = p.index

    def _slot_files(self) -> list[tuple[Path, int]]:
        """(path, rank) of every slot file in the shm directory."""
        return slot_files(self.shm_dir)

    def _queue_completion(self, p: _Pending) -> None:
        if self._completer is None:
            self._completer = queue.Queue()
            threading.Thread(target=self._complete_loop, name="trainguard-ckpt-d2h", daemon=True).start()
        self._completer.put(p)

    def _complete_loop(self) -> None:
        assert self._completer is not None
        self._helper_tid = threading.get_native_id()
        while (p := self._completer.get()) is not None:
            try:
                if p.items:
                    self._helper_priority(idle=True)  # overlapped: only the CPU training leaves idle
                    if p.waited:  # the training thread got there first
                        self._helper_priority(idle=False)
                    while (item := p.take()) is not None:
                        _copy_item(p, item, fast=False)
                    p.all_copied()  # pieces the training thread took over
                    if p.changed:
                        raise _StateChanged(p.changed)
                for ev in p.events:
                    ev.synchronize()  # off the training thread: waits for the D2H copy only
                self._publish(p)
            except _StateChanged as exc:
                self._overlap_off = True
                self._report("checkpoint_overlap_off", "warning",
                             f"rank {self.rank}: snapshot of step {p.step} discarded: {exc}, an in-place change outside "
                             "optimizer.step() and module forward; later snapshots are copied inside save()",
                             {"step": p.step, "error": str(exc)})
            except Exception as exc:
                self._note_failure(p.step, exc)
            finally:
                p.items.clear()
                p.done.set()

    def _finish(self, p: _Pending) -> None:
        """The training thread needs the state: copy what the helper has not taken yet itself (with
        torch's parallel copy), then wait for the piece the helper is on and the publish."""
        if p.done.is_set():
            return
        start = time.perf_counter()
        p.waited = True
        self._helper_priority(idle=False)
        while (item := p.take()) is not None:
            _copy_item(p, item, fast=True)
        p.done.wait()
        self.finish_wait_s += time.perf_counter() - start

    def _helper_priority(self, idle: bool) -> None:
        """The copy helper runs at idle priority while nobody waits for it, and at normal priority
        once the training thread does (a busy machine would otherwise starve it meanwhile)."""
        with self._priority_lock:
            tid = self._helper_tid
            if tid is None or self._helper_idle == idle:
                return
            try:
                os.sched_setscheduler(tid, os.SCHED_IDLE if idle else os.SCHED_OTHER, os.sched_param(0))
                self._helper_idle = idle
            except (AttributeError, OSError):
                self._helper_tid = None  # not allowed here: leave it at normal priority

    def _wait_pending(self) -> None:
        if self._pending is not None:
            self._finish(self._pending)
            self._pending = None

    def wait(self) -> None:
        """Block until the last save is complete in memory (and, in local mode, on disk)."""
        with self._lock:
            self._wait_pending()
        if self._persister is not None:
            self._persister.run_pass()

    def _note_skip(self, step: int) -> None:
        self.skipped += 1
        if self.skipped in (1, 10, 100, 1000):
            self._report("checkpoint_skipped", "warning",
                         f"snapshot of step {step} skipped: the agent holds every slot of this rank "
                         f"({self.skipped} skipped so far)",
                         {"step": step, "skipped": self.skipped})

    def _note_failure(self, step: int, exc: BaseException) -> None:
        log.error("checkpoint: snapshot of step %s failed: %s", step, exc)
        if self._trouble.failed("failed", type(exc).__name__):  # the first and every 10th in a row
            self._report("checkpoint_failed", "error",
                         f"in-memory snapshot of step {step} on rank {self.rank} failed: {exc}; "
                         "training continues, the previous checkpoint stays valid",
                         {"step": step, "error": f"{type(exc).__name__}: {exc}", "shm_dir": str(self.shm_dir),
                          "failed_saves": self._trouble.total})

    def _report(self, kind: str, severity: str, message: str, evidence: dict[str, Any]) -> None:
        unsafe = shmfault.not_private_dir(self.shm_dir)
        if unsafe is not None:  # gone or replaced (a link would put the report elsewhere): the log line only
            log.warning("checkpoint: could not report %s: %s (%s)", kind, message, unsafe)
            return
        try:
            write_report(self.shm_dir, kind, message, severity, self.rank, evidence)
        except OSError as exc:  # shm itself is full or gone: the log line is all we can do
            log.warning("checkpoint: could not report %s: %s (%s)", kind, message, exc)

    # --- load ------------------------------------------------------------------------------------
    def load_latest(self, map_location: Any = None, mesh: Any = None, agree: bool = True) -> Any:
        """The newest state this rank can load, or None. With torch.distributed initialized (and
        ``agree``), all ranks settle on the newest step that every rank has and can verify, at the
        world size it was saved with (see the module doc for a changed world size). Raises
        IncompatibleCheckpoint when checkpoints exist but none can be loaded at this world size."""
        with self._lock:
            self._wait_pending()
        corrupt: list[dict[str, Any]] = []
        refused: list[dict[str, Any]] = []
        found = self._candidates(mesh, corrupt, refused)
        collective = agree and _dist_world() > 1
        result, chosen = None, None
        unshared: list[int] = []  # steps this rank holds when no rank holds one of them all (see below)
        while True:
            order = sorted(found.values(), key=self._preference, reverse=True)
            if collective:
                key = _agree_key([c.key for c in order])
                chosen = found.get(key) if key is not None else None
                if key is None and found and not corrupt and not refused:
                    unshared = sorted({c.step for c in found.values()})
                if key is not None and chosen is None:  # cannot happen: the intersection is ours too
                    raise RuntimeError(f"checkpoint: agreed on step key {key} this rank does not have")
            else:
                chosen = order[0] if order else None
            if chosen is None:
                result = None
                break
            sharded = _agree_any(chosen.sharded) if collective else chosen.sharded
            try:
                result = self._load(chosen, sharded, map_location, mesh)
            except IncompatibleCheckpoint as exc:
                result = None
                refused.append({"step": chosen.step, "saved_world_size": chosen.world, "error": str(exc)})
            except (disk.CorruptCheckpoint, FormatError) as exc:
                result = None
                corrupt.append({"step": chosen.step, "error": str(exc)})
            except Exception as exc:  # DCP raises its own CheckpointException for a failed read
                if not sharded:
                    raise
                result = None
                corrupt.append({"step": chosen.step, "error": f"resharding failed: {str(exc)[:500]}"})
            if result is not None and os.environ.get(ENV_FINITE_ONLY) == "1" and not _all_finite(result):
                result = None  # a NaN replay resumes from before the NaN, not from a state it already spoilt
                corrupt.append({"step": chosen.step, "error": "non-finite values (NaN replay: taken after the NaN)"})
            ok = _agree_all(result is not None) if collective else result is not None
            if ok:
                break
            result = None
            found.pop(chosen.key, None)
        if result is None:
            self._refuse_if_needed(refused, collective)
        if result is None and unshared:
            # Never a silent fresh start: this rank holds steps, another holds none of them (its
            # node's memory and checkpoint dir are gone, or the dirs are not shared).
            self._report("checkpoint_fallback", "error",
                         f"rank {self.rank}: holds step(s) {unshared} but no step is held by every rank (a rank's "
                         f"node lost its snapshots and none reached it: see checkpoint_fetch_failed, or "
                         f"{self.ckpt_dir} is not shared); starting from scratch",
                         {"held_steps": unshared, "loaded_step": None, "dir": str(self.ckpt_dir)})
        loaded = chosen if result is not None else None
        self._report_load(loaded, corrupt, refused)
        if loaded is not None and loaded.world == self.world:
            self._abandon_newer(loaded.step)
        return result

    def _abandon_newer(self, step: int) -> None:
        """This rank resumes from ``step``: its snapshots of later steps are from the attempt that
        died (an abandoned timeline). Left in place, a later restart could agree on one of those
        steps once another rank has saved it anew, and this rank would load the dead attempt's
        state beside the others' new one. Its slots of later steps are invalidated, then (once the
        agent has stopped persisting them) its files of later steps are moved to CKPT_DIR/abandoned/."""
        slots = self._invalidate_newer_slots(step)
        files = disk.abandon_newer(self.ckpt_dir, self.rank, step, self.world)
        if not slots and not files:
            return
        self._report("checkpoint_abandoned", "warning",
                     f"rank {self.rank}: resumed from step {step}; dropped its snapshots of later steps from the "
                     f"attempt that died (memory: {slots or 'none'}, disk: {files or 'none'}, moved to "
                     f"{self.ckpt_dir / disk.ABANDONED})",
                     {"loaded_step": step, "memory_steps": slots, "disk_steps": files,
                      "dir": str(self.ckpt_dir / disk.ABANDONED)})

    def _invalidate_newer_slots(self, step: int) -> list[int]:
        """Mark this rank's complete slots of steps after ``step`` as being written (no reader,
        agreement or persister trusts them again), and wait, up to ``shmfault.PIN_WAIT_S``, for the
        agent to finish persisting any of them: its seqlock check then discards that write, or the
        write commits before the caller moves the file aside. Returns the steps dropped."""
        dropped: list[int] = []
        busy: list[Slot] = []
        with self._lock:
            for i, slot in enumerate(self._slots):
                hdr = slot.header() if slot is not None else None
                if slot is None or hdr is None or not hdr.complete or hdr.step <= step or hdr.world != self.world:
                    continue
                self._seq += 1
                slot.begin_write(self._seq)  # the state word first: the snapshot is no longer valid
                dropped.append(hdr.step)
                busy.append(slot)
                if self._latest == i:
                    self._latest = None
            if self._latest is None:
                held = [i for i in range(self.nslots) if self._complete_seq(i) >= 0]
                self._latest = max(held, key=self._complete_seq) if held else None
        deadline = time.monotonic() + shmfault.PIN_WAIT_S
        while any((h := s.header()) is not None and h.pin for s in busy) and time.monotonic() < deadline:
            time.sleep(0.002)
        return sorted(dropped)

    def _preference(self, c: _Candidate) -> tuple[int, bool, int]:
        # The same total order on every rank: newest step, then this world size, then the bigger one.
        return (c.step, c.world == self.world, c.world)

    def _candidates(self, mesh: Any, corrupt: list[dict[str, Any]],
                    refused: list[dict[str, Any]]) -> dict[int, _Candidate]:
        """Every (step, world size) this rank could load. Same world size: its own copy only (in
        memory or on disk). Another world size: replicated state from any rank's copy; sharded
        state only when every old rank's file is on disk (and a mesh is given)."""
        found: dict[int, _Candidate] = {}

        def add(step: int, world: int, sharded: bool, source: _Source) -> None:
            c = found.setdefault(step << _WORLD_BITS | world, _Candidate(step, world, sharded))
            c.sources.append(source)

        for path, rank in self._slot_files():
            hdr, sharded = _peek_slot(path)
            if hdr is None or not hdr.complete or hdr.rank != rank:
                continue
            if hdr.world == self.world and rank == self.rank:
                add(hdr.step, hdr.world, sharded, _Source("memory", rank, path, hdr.time))
            elif hdr.world != self.world and not sharded:
                add(hdr.step, hdr.world, False, _Source("memory", rank, path))
        for step in disk.all_steps(self.ckpt_dir):
            present = disk.ranks_at(self.ckpt_dir, step)
            if not present:
                continue
            ref = self.rank if self.rank in present else present[0]
            try:
                meta = disk.read_manifest(self.ckpt_dir, ref, step)
            except disk.CorruptCheckpoint as exc:
                if ref == self.rank:
                    corrupt.append({"step": step, "error": str(exc)})
                continue
            world, sharded = meta.get("world_size"), bool(meta.get("sharded"))
            if not isinstance(world, int) or world < 1:
                continue
            if world == self.world:
                if ref == self.rank:
                    add(step, world, sharded, _Source("disk", ref, saved=disk.taken_at(meta)))
                continue
            if not sharded:
                for r in [ref, *(r for r in present if r != ref)]:
                    add(step, world, False, _Source("disk", r))
                continue
            why = why_not_reshardable(meta, present) or (
                None if mesh is not None else "sharded state: pass mesh= (the new DeviceMesh) to reshard it")
            if why is None:
                add(step, world, True, _Source("disk", ref if ref < world else 0))
            else:
                refused.append({"step": step, "saved_world_size": world, "error": why})
        for c in found.values():  # memory first, then this rank's own file, then the others'
            c.sources.sort(key=lambda src: (src.kind != "memory", src.rank != self.rank))
            if c.world == self.world:  # this rank's own copies: the newest save first (a slot is
                c.sources.sort(key=lambda src: -src.saved)  # published after its file's save time)
        return found

    def _load(self, c: _Candidate, sharded: bool, map_location: Any, mesh: Any) -> Any:
        if c.world == self.world:
            src = c.sources[0]
            if src.kind == "memory":
                index = self._own_slot_index(src.path)
                meta, tensors = self._read_slot(index) if index is not None else _read_slot_file(src.path)
            else:
                meta, tensors = _read_disk(self.ckpt_dir, src.rank, c.step)
            return unflatten(meta["tree"], _moved(tensors, map_location), mesh)
        if sharded:
            if mesh is None:
                raise IncompatibleCheckpoint("sharded state saved at another world size: pass mesh= to reshard it")
            ref = next(s.rank for s in c.sources if s.kind == "disk")
            collective = _dist_world() > 1
            return load_resharded(self.ckpt_dir, c.step, c.world, ref, mesh, map_location,
                                  agree=_agree_all if collective else (lambda ok: ok))
        errors = []
        for src in c.sources:  # replicated: any rank's copy serves
            try:
                if src.kind == "memory":
                    meta, tensors = _read_slot_file(src.path)
                else:
                    meta, tensors = _read_disk(self.ckpt_dir, src.rank, c.step)
                if meta.get("world_size") != c.world or meta.get("sharded"):
                    raise disk.CorruptCheckpoint(f"rank {src.rank}'s copy is not replicated state of world size {c.world}")
                return unflatten(meta["tree"], _moved(tensors, map_location), None)
            except (disk.CorruptCheckpoint, FormatError, OSError) as exc:
                errors.append(f"rank {src.rank} ({src.kind}): {exc}")
        raise disk.CorruptCheckpoint("; ".join(errors))

    def _own_slot_index(self, path: Path | None) -> int | None:
        for i, slot in enumerate(self._slots):
            if slot is not None and path is not None and slot.path == path:
                return i
        return None

    def _refuse_if_needed(self, refused: list[dict[str, Any]], collective: bool) -> None:
        """Nothing loaded although checkpoints exist that this world size cannot use: refuse rather
        than let the job start from scratch (all ranks, so none waits in a collective)."""
        anyone = _agree_any(bool(refused)) if collective else bool(refused)
        if not anyone:
            return
        if refused:
            why = "; ".join(f"step {r['step']} (saved by {r['saved_world_size']} ranks): {r['error']}" for r in refused[:4])
        else:
            why = "another rank found checkpoints it cannot load at this world size"
        self._report("checkpoint_incompatible", "error",
                     f"rank {self.rank}: no checkpoint in {self.ckpt_dir} can be loaded at world size {self.world}: {why}",
                     {"refused": refused, "world_size": self.world, "dir": str(self.ckpt_dir)})
        raise IncompatibleCheckpoint(
            f"no checkpoint can be loaded at world size {self.world}: {why}. Resume at the saved world size, "
            f"or move {self.ckpt_dir} aside to start from scratch")

    def _memory_steps(self) -> dict[int, int]:
        """step -> slot index of our complete in-memory snapshots."""
        out: dict[int, tuple[int, int]] = {}
        for i, slot in enumerate(self._slots):
            hdr = slot.header() if slot is not None else None
            if hdr is not None and hdr.complete and (hdr.step not in out or hdr.seq > out[hdr.step][1]):
                out[hdr.step] = (i, hdr.seq)
        return {step: i for step, (i, _) in out.items()}

    def _read_slot(self, index: int) -> tuple[dict[str, Any], list[torch.Tensor]]:
        slot = self._slots[index]
        assert slot is not None
        hdr = slot.header()
        assert hdr is not None and hdr.complete
        self._release_buf(index)  # before a remap: a live view would pin the old mapping
        slot.refresh()
        meta = decode_manifest(bytes(slot.mm[hdr.manifest_off : hdr.manifest_off + hdr.manifest_len]))
        data = self._buf(index)[hdr.data_off : hdr.data_off + hdr.data_len]
        entries = parse_entries(meta["tensors"], hdr.data_len)
        # Copies: the slot will be overwritten by a later save.
        return meta, [tensor_view(data, e).clone() for e in entries]

    def _report_load(self, c: _Candidate | None, corrupt: list[dict[str, Any]],
                     refused: list[dict[str, Any]]) -> None:
        step = c.step if c is not None else None
        source = c.sources[0].kind if c is not None else None
        skipped = [x for x in corrupt + refused if step is None or x["step"] > step]
        if skipped:
            bad = ", ".join(str(x["step"]) for x in skipped)
            where = f"step {step} from {source}" if step is not None else "nothing (starting fresh)"
            self._report("checkpoint_fallback", "warning",
                         f"rank {self.rank}: checkpoint step(s) {bad} partial, corrupt or not loadable here; loaded {where}",
                         {"corrupt": corrupt, "refused": refused, "loaded_step": step, "source": source,
                          "dir": str(self.ckpt_dir)})
        if c is not None and self.rank == 0:
            evidence: dict[str, Any] = {"step": c.step, "source": source}
            if c.world != self.world:
                evidence.update(saved_world_size=c.world, world_size=self.world,
                                mode="resharded" if c.sharded else "replicated")
                how = ("sharded state resharded by torch.distributed.checkpoint" if c.sharded
                       else f"replicated state, rank {c.sources[0].rank}'s copy")
                self._report("checkpoint_loaded", "info",
                             f"resumed from step {c.step} ({source}) saved by {c.world} ranks, now {self.world}: {how}",
                             evidence)
            else:
                self._report("checkpoint_loaded", "info", f"resumed from step {c.step} ({source})", evidence)

    # --- teardown --------------------------------------------------------------------------------
    def close(self) -> None:
        with self._lock:
            self._wait_pending()
            if self._completer is not None:
                self._completer.put(None)
                self._completer = None
            self._drop_slots()
        if self._persister is not None:
            self._persister.stop(flush=True)
            release_shm_dir(self.shm_dir)
            self._persister = None


def _plain(t: torch.Tensor) -> bool:
    """Its bytes are exactly what a copy must produce (no lazy conjugate / negative bit)."""
    return t.is_contiguous() and not t.is_conj() and not t.is_neg()


def _copy_item(p: _Pending, item: tuple[int, int, torch.Tensor, int, int], fast: bool) -> None:
    """One piece of an overlapped copy. ``fast`` (the training thread, which is waiting anyway):
    torch's copy, parallel over the intra-op threads. Else (the helper) one memmove, which releases
    the GIL and starts no OpenMP team of its own."""
    assert p.data is not None
    offset, nbytes, src, src_off, _ = item
    if src_off < 0:
        p.data[offset : offset + nbytes].view(src.dtype).view(src.shape).copy_(src)
    elif fast:
        p.data[offset : offset + nbytes].copy_(src.reshape(-1).view(torch.uint8)[src_off : src_off + nbytes])
    else:
        ctypes.memmove(p.data.data_ptr() + offset, src.data_ptr() + src_off, nbytes)
    p.copied(item)


def _peek_slot(path: Path, manifest: bool = True) -> tuple[Any, bool]:
    """(header, sharded) of a slot file without keeping it open; (None, False) when unreadable.
    ``manifest``: also read the manifest to tell whether the snapshot is sharded."""
    try:
        slot = Slot.open(path)
    except (OSError, ValueError):
        return None, False
    try:
        hdr = slot.header()
        if hdr is None or not hdr.complete or not manifest:
            return hdr, False
        meta = decode_manifest(bytes(slot.mm[hdr.manifest_off : hdr.manifest_off + hdr.manifest_len]))
        return hdr, bool(meta.get("sharded"))
    except FormatError:
        return None, False
    finally:
        slot.close()


def _read_slot_file(path: Path | None) -> tuple[dict[str, Any], list[torch.Tensor]]:
    """Copy a snapshot out of a slot file (another rank's, from an earlier world size). The seqlock
    check after the copy rejects one that changed meanwhile."""
    if path is None:
        raise disk.CorruptCheckpoint("no slot")
    slot = Slot.open(path, populate=True)
    try:
        hdr = slot.header()
        if hdr is None or not hdr.complete or hdr.data_off + hdr.data_len > slot.size:
            raise disk.CorruptCheckpoint(f"{path.name}: not a complete snapshot")
        meta = decode_manifest(bytes(slot.mm[hdr.manifest_off : hdr.manifest_off + hdr.manifest_len]))
        entries = parse_entries(meta["tensors"], hdr.data_len)
        buf = torch.frombuffer(slot.mm, dtype=torch.uint8)[hdr.data_off : hdr.data_off + hdr.data_len]
        tensors = [tensor_view(buf, e).clone() for e in entries]
        del buf
        now = slot.header()
        if now is None or now.seq != hdr.seq or not now.complete:
            raise disk.CorruptCheckpoint(f"{path.name}: overwritten while being read")
        return meta, tensors
    finally:
        slot.close()


def _read_disk(ckpt_dir: Path, rank: int, step: int) -> tuple[dict[str, Any], list[torch.Tensor]]:
    meta, data = disk.read_checkpoint(ckpt_dir, rank, step)
    entries = parse_entries(meta["tensors"], data.numel())
    return meta, [tensor_view(data, e) for e in entries]


def _all_finite(state: Any) -> bool:
    """Every floating-point tensor (and float) of a loaded state is finite."""
    if isinstance(state, torch.Tensor):
        local = getattr(state, "_local_tensor", state)  # a DTensor: this rank's shard
        return not local.is_floating_point() or bool(torch.isfinite(local).all())
    if isinstance(state, dict):
        return all(_all_finite(v) for v in state.values())
    if isinstance(state, list | tuple):
        return all(_all_finite(v) for v in state)
    return not isinstance(state, float) or math.isfinite(state)


def _moved(tensors: list[torch.Tensor], map_location: Any) -> list[torch.Tensor]:
    return tensors if map_location is None else [t.to(map_location) for t in tensors]


# --- guards for overlapped copies -------------------------------------------------------------
_guarded: weakref.WeakSet[Checkpointer] = weakref.WeakSet()
_guard_lock = threading.Lock()
_hooks_installed = False
_has_buffers: weakref.WeakKeyDictionary[torch.nn.Module, bool] = weakref.WeakKeyDictionary()


def _record_stall(start_ns: int) -> None:
    """The training thread's time in save() as a SaveCheckpoint span, as torch.save gets one."""
    from trainguard.worker import ring, spans

    rec = spans.recorder()
    if rec is not None and rec.flags() & ring.FLAG_BASIC:
        rec.record(ring.SAVE_CHECKPOINT, start_ns, time.perf_counter_ns())


def _install_guards(ck: Checkpointer) -> None:
    """Global hooks (installed once, never removed: removing from another thread would race the
    module call path) that hold mutations of the state until its overlapped copy is done."""
    global _hooks_installed
    with _guard_lock:
        if not _hooks_installed:
            from torch.nn.modules.module import register_module_forward_pre_hook
            from torch.optim.optimizer import register_optimizer_step_pre_hook

            register_optimizer_step_pre_hook(_before_optimizer_step)
            register_module_forward_pre_hook(_before_forward)
            _hooks_installed = True
        _guarded.add(ck)


def _wait_copies() -> None:
    for ck in list(_guarded):
        p = ck._pending
        if p is not None and p.items:
            ck._finish(p)


def _before_optimizer_step(optimizer: Any, args: Any, kwargs: Any) -> None:
    _wait_copies()


def _before_forward(module: torch.nn.Module, args: Any) -> None:
    if not any(ck._pending is not None and ck._pending.items for ck in list(_guarded)):
        return
    has = _has_buffers.get(module)
    if has is None:
        has = next(module.buffers(), None) is not None
        _has_buffers[module] = has
    if has:
        _wait_copies()


def _rank_world() -> tuple[int, int]:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


def _dist_world() -> int:
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _collective_device() -> torch.device:
    import torch.distributed as dist

    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _agree_key(keys: list[int]) -> int | None:
    """The first of ``keys`` (this rank's candidates, best first; every rank orders them alike)
    that every rank has (None when there is none)."""
    import torch.distributed as dist

    dev = _collective_device()
    mine = torch.full((MAX_CANDIDATES,), -1, dtype=torch.int64)
    top = keys[:MAX_CANDIDATES]
    mine[: len(top)] = torch.tensor(top, dtype=torch.int64)
    mine = mine.to(dev)
    gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, mine)
    common: set[int] | None = None
    for g in gathered:
        got = {int(k) for k in g.cpu().tolist() if k >= 0}
        common = got if common is None else common & got
    return next((k for k in top if k in common), None) if common else None


def _agree_any(flag: bool) -> bool:
    import torch.distributed as dist

    t = torch.tensor([1 if flag else 0], dtype=torch.int64, device=_collective_device())
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def _agree_all(ok: bool) -> bool:
    import torch.distributed as dist

    flag = torch.tensor([1 if ok else 0], dtype=torch.int64, device=_collective_device())
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def _cuda_host_register(buf: torch.Tensor) -> bool:
    """Page-lock the shm mapping so D2H copies into it are truly asynchronous. False: not pinned
    (copies then still work, only synchronously)."""
    try:
        cudart = torch.cuda.cudart()
        err = cudart.cudaHostRegister(buf.data_ptr(), buf.numel(), 0)  # cudaHostRegisterDefault
        return int(getattr(err, "value", err)) == 0
    except Exception as exc:
        log.info("checkpoint: cannot pin shared memory for CUDA copies: %s", exc)
        return False


def _cuda_host_unregister(ptr: int) -> None:
    try:
        torch.cuda.cudart().cudaHostUnregister(ptr)
    except Exception as exc:
        log.debug("cudaHostUnregister failed: %s", exc)


DEFAULT_KEEP = 3


def _env_slots() -> int:
    text = os.environ.get(ENV_SLOTS, "")
    return min(MAX_SLOTS, max(NSLOTS, int(text))) if text.isdigit() else NSLOTS


def _env_keep() -> int:
    """``TRAINGUARD_CKPT_KEEP``: checkpoints kept per rank. Anything but a positive integer (0 and
    -1 would delete the newest, text would raise inside ``save``) is one warning and the default."""
    text = os.environ.get(ENV_KEEP)
    if text is None:
        return DEFAULT_KEEP
    try:
        keep = int(text)
    except ValueError:
        keep = 0
    if keep < 1:
        log.warning("checkpoint: %s=%r is not a positive integer; keeping the newest %d checkpoints per rank",
                    ENV_KEEP, text, DEFAULT_KEEP)
        return DEFAULT_KEEP
    return keep


def _default_shm_root() -> Path:
    return Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(os.environ.get("TMPDIR") or "/tmp")


def _local_shm_root() -> Path:
    """Where local mode keeps its snapshots: ``TRAINGUARD_CKPT_SHM_ROOT`` when it is a writable
    directory, else (one warning) the default tmpfs."""
    given = os.environ.get(ENV_SHM_ROOT)
    if not given:
        return _default_shm_root()
    if os.path.isdir(given) and os.access(given, os.W_OK | os.X_OK):
        return Path(given)
    fallback = _default_shm_root()
    log.warning("checkpoint: %s=%s is not a writable directory; keeping snapshots in %s instead",
                ENV_SHM_ROOT, given, fallback)
    return fallback


def _log_event(kind: str, message: str, severity: str = "info", rank: int | None = None,
               evidence: dict[str, Any] | None = None) -> None:
    level = {"info": logging.INFO, "warning": logging.WARNING}.get(severity, logging.ERROR)
    log.log(level, "[%s]%s %s", kind, f" rank={rank}" if rank is not None else "", message)
