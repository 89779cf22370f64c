"""The worker side: ``save`` copies a state into this rank's shared-memory slot and returns;
``load_latest`` finds the newest state every rank can load (memory first, then verified disk).

Under ``trainguard run`` the agent owns the shm directory and persists snapshots (see
``trainguard.launch.checkpoint_monitor``). Without an agent (plain python / torchrun) the process
runs the same persister on a thread of its own ("local mode"): saves still return at memory speed,
but a snapshot survives the process only once it is on disk.

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
import os
import queue
import threading
import time
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from trainguard.checkpoint import disk
from trainguard.checkpoint.format import (
    FORMAT,
    FormatError,
    decode_manifest,
    encode_manifest,
    flatten,
    parse_entries,
    plan_layout,
    tensor_view,
    unflatten,
)
from trainguard.checkpoint.persist import Persister, write_report
from trainguard.checkpoint.shm import Slot, make_shm_dir, payload_offsets, release_shm_dir, slot_path

log = logging.getLogger(__name__)

ENV_SHM_DIR = "TRAINGUARD_CKPT_SHM_DIR"
ENV_CKPT_DIR = "TRAINGUARD_CKPT_DIR"
ENV_KEEP = "TRAINGUARD_CKPT_KEEP"
ENV_OVERLAP = "TRAINGUARD_CKPT_OVERLAP"
MAX_CANDIDATES = 64
NSLOTS = 2


@dataclass
class _Pending:
    """A save whose copies are not all finished: queued device->host copies (CUDA events) and,
    with ``overlap``, CPU copies left to the helper thread."""

    index: int
    seq: int
    step: int
    manifest_len: int
    data_len: int
    events: list[Any]
    cpu_copies: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)  # (dst, src)
    done: threading.Event = field(default_factory=threading.Event)


class Checkpointer:
    def __init__(self, shm_dir: Path, ckpt_dir: Path, rank: int, world: int,
                 persister: Persister | None = None) -> None:
        self.shm_dir = Path(shm_dir)
        self.ckpt_dir = Path(ckpt_dir)
        self.rank = rank
        self.world = world
        self.saves = 0
        self.skipped = 0
        self._persister = persister  # local mode only: we own the shm dir and the persister
        self._slots: list[Slot | None] = [None] * NSLOTS
        self._bufs: list[torch.Tensor | None] = [None] * NSLOTS
        self._pinned: list[bool] = [False] * NSLOTS
        self._latest: int | None = None  # slot index of our newest complete snapshot
        self._seq = 0
        self._pending: _Pending | None = None
        self._completer: queue.Queue[_Pending | None] | None = None
        self._failing = False
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
        root = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(os.environ.get("TMPDIR", "/tmp"))
        shm_dir = make_shm_dir(root)
        keep = int(os.environ.get(ENV_KEEP, "3"))
        persister = Persister(shm_dir, ckpt_dir, keep, _log_event)
        self = cls(shm_dir, ckpt_dir, rank, world, persister)
        persister.start()
        atexit.register(self.close)
        return self

    def _adopt_existing_slots(self) -> None:
        """After a restart on the same node: find the snapshots the previous process left."""
        for i in range(NSLOTS):
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

    # --- save ------------------------------------------------------------------------------------
    def save(self, state: Any, step: int, overlap: bool | None = None) -> bool:
        """Snapshot ``state`` into shared memory. True when taken; False when skipped or failed
        (reported as an event; training goes on). Raises TypeError for values it cannot store.

        ``overlap`` (default: env TRAINGUARD_CKPT_OVERLAP=1, else off): CPU tensors are copied by a
        helper thread while training goes on; the next optimizer step, and the next forward of a
        module that has buffers (BatchNorm statistics, DDP's buffer broadcast), wait until the copy
        is done, so the snapshot is still exactly the state at this call. Only in-place changes to
        state tensors made elsewhere before the next optimizer step would leak into it."""
        start = time.perf_counter_ns()
        try:
            return self._save(state, step, overlap)
        finally:
            _record_stall(start)

    def _save(self, state: Any, step: int, overlap: bool | None) -> bool:
        tree, tensors = flatten(state)
        entries, data_len = plan_layout(tensors)
        meta = {"format": FORMAT, "rank": self.rank, "world_size": self.world, "step": int(step),
                "time": time.time(), "tree": tree, "tensors": [e.to_json() for e in entries]}
        raw = encode_manifest(meta)
        manifest_off, data_off = payload_offsets(len(raw))
        if overlap is None:
            overlap = os.environ.get(ENV_OVERLAP, "0") == "1"
        with self._lock:
            try:
                self._wait_pending()
                index = self._target_slot()
                if index is None:
                    self._note_skip(step)
                    return False
                slot = self._slot_for(index, data_off + data_len)
                self._seq += 1
                slot.begin_write(self._seq)
                slot.mm[manifest_off : manifest_off + len(raw)] = raw
                buf = self._buf(index)
                pending = _Pending(index, self._seq, int(step), len(raw), data_len, [])
                self._copy_tensors(buf[data_off : data_off + data_len], entries, tensors, index, pending, overlap)
                if pending.events or pending.cpu_copies:
                    if pending.cpu_copies:
                        _install_guards(self)
                    self._pending = pending
                    self._queue_completion(pending)
                else:
                    self._publish(pending)
            except Exception as exc:
                self._note_failure(step, exc)
                return False
        self.saves += 1
        if self._failing:
            self._failing = False
        return True

    def _target_slot(self) -> int | None:
        """The slot to write: the one not holding our newest snapshot, unless the agent is
        persisting it right now (pinned); then overwrite the newest one instead of skipping the save
        (only a death in the middle of that write falls back to the pinned, older snapshot)."""
        order = [i for i in range(NSLOTS) if i != self._latest]
        if self._latest is not None:
            order.append(self._latest)
        for i in order:
            slot = self._slots[i]
            hdr = slot.header() if slot is not None else None
            if hdr is None or not hdr.pin:
                return i
        return None

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
            dst = data[e.offset : e.offset + e.nbytes].view(t.dtype).view(t.shape)
            if t.device.type == "cuda":
                if not self._pinned[index]:
                    self._pinned[index] = _cuda_host_register(self._buf(index))
                dst.copy_(t, non_blocking=True)
                devices.add(t.device)
            elif overlap:
                pending.cpu_copies.append((dst, t))
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

    def _queue_completion(self, p: _Pending) -> None:
        if self._completer is None:
            self._completer = queue.Queue()
            threading.Thread(target=self._complete_loop, name="trainguard-ckpt-d2h", daemon=True).start()
        self._completer.put(p)

    def _complete_loop(self) -> None:
        assert self._completer is not None
        while (p := self._completer.get()) is not None:
            try:
                for dst, src in p.cpu_copies:
                    _copy_cpu(dst, src)
                p.cpu_copies.clear()
                for ev in p.events:
                    ev.synchronize()  # off the training thread: waits for the D2H copy only
                self._publish(p)
            except Exception as exc:
                self._note_failure(p.step, exc)
            finally:
                p.done.set()

    def _wait_pending(self) -> None:
        if self._pending is not None:
            self._pending.done.wait()
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
                         f"snapshot of step {step} skipped: the agent holds both of this rank's slots "
                         f"({self.skipped} skipped so far)",
                         {"step": step, "skipped": self.skipped})

    def _note_failure(self, step: int, exc: BaseException) -> None:
        log.error("checkpoint: snapshot of step %s failed: %s", step, exc)
        if not self._failing:  # one event per run of failures, not one per save
            self._failing = True
            self._report("checkpoint_failed", "error",
                         f"in-memory snapshot of step {step} on rank {self.rank} failed: {exc}; "
                         "training continues, the previous checkpoint stays valid",
                         {"step": step, "error": f"{type(exc).__name__}: {exc}", "shm_dir": str(self.shm_dir)})

    def _report(self, kind: str, severity: str, message: str, evidence: dict[str, Any]) -> None:
        try:
            write_report(self.shm_dir, kind, message, severity, self.rank, evidence)
        except OSError as exc:  # shm itself is full or gone: the log line is all we can do
            log.warning("checkpoint: could not report %s: %s (%s)", kind, message, exc)

    # --- load ------------------------------------------------------------------------------------
    def load_latest(self, map_location: Any = None, mesh: Any = None, agree: bool = True) -> Any:
        """The newest state this rank can load, or None. With torch.distributed initialized (and
        ``agree``), all ranks settle on the newest step that every rank has and can verify."""
        with self._lock:
            self._wait_pending()
        in_memory = self._memory_steps()
        candidates = sorted(set(in_memory) | set(disk.list_steps(self.ckpt_dir, self.rank)), reverse=True)
        collective = agree and _dist_world() > 1
        corrupt: list[dict[str, Any]] = []
        while True:
            step = _agree_step(candidates) if collective else (candidates[0] if candidates else None)
            if step is None:
                result, source = None, None
                break
            source = "memory" if step in in_memory else "disk"
            try:
                result = self._load_step(step, in_memory.get(step), map_location, mesh)
            except disk.CorruptCheckpoint as exc:
                result = None
                corrupt.append({"step": step, "error": str(exc)})
            except FormatError as exc:
                result = None
                corrupt.append({"step": step, "error": f"bad manifest: {exc}"})
            ok = _agree_all(result is not None) if collective else result is not None
            if ok:
                break
            if result is None:
                candidates.remove(step)
        self._report_load(step if result is not None else None, source, corrupt)
        return result

    def _memory_steps(self) -> dict[int, int]:
        """step -> slot index of our complete in-memory snapshots."""
        out: dict[int, tuple[int, int]] = {}
        for i, slot in enumerate(self._slots):
            hdr = slot.header() if slot is not None else None
            if hdr is not None and hdr.complete and (hdr.step not in out or hdr.seq > out[hdr.step][1]):
                out[hdr.step] = (i, hdr.seq)
        return {step: i for step, (i, _) in out.items()}

    def _load_step(self, step: int, index: int | None, map_location: Any, mesh: Any) -> Any:
        if index is not None:
            meta, tensors = self._read_slot(index)
        else:
            meta, data = disk.read_checkpoint(self.ckpt_dir, self.rank, step)
            entries = parse_entries(meta["tensors"], data.numel())
            tensors = [tensor_view(data, e) for e in entries]
        if map_location is not None:
            tensors = [t.to(map_location) for t in tensors]
        return unflatten(meta["tree"], tensors, mesh)

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

    def _report_load(self, step: int | None, source: str | None, corrupt: list[dict[str, Any]]) -> None:
        if corrupt:
            bad = ", ".join(str(c["step"]) for c in corrupt)
            where = f"step {step} from {source}" if step is not None else "nothing (starting fresh)"
            self._report("checkpoint_fallback", "warning",
                         f"rank {self.rank}: checkpoint step(s) {bad} partial or corrupt; loaded {where}",
                         {"corrupt": corrupt, "loaded_step": step, "source": source, "dir": str(self.ckpt_dir)})
        if step is not None and self.rank == 0:
            self._report("checkpoint_loaded", "info", f"resumed from step {step} ({source})",
                         {"step": step, "source": source})

    # --- teardown --------------------------------------------------------------------------------
    def close(self) -> None:
        with self._lock:
            self._wait_pending()
            if self._completer is not None:
                self._completer.put(None)
                self._completer = None
            for i in range(NSLOTS):
                self._release_buf(i)
                slot = self._slots[i]
                if slot is not None:
                    slot.close()
                self._slots[i] = None
        if self._persister is not None:
            self._persister.stop(flush=True)
            release_shm_dir(self.shm_dir)
            self._persister = None


def _copy_cpu(dst: torch.Tensor, src: torch.Tensor) -> None:
    if src.is_contiguous() and not src.is_conj() and not src.is_neg():
        # One plain memmove: releases the GIL and, unlike copy_ from a second thread, does not
        # start another OpenMP team competing with the training thread's kernels.
        ctypes.memmove(dst.data_ptr(), src.data_ptr(), src.numel() * src.element_size())
    else:
        dst.copy_(src)


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
        if p is not None and p.cpu_copies:
            p.done.wait()


def _before_optimizer_step(optimizer: Any, args: Any, kwargs: Any) -> None:
    _wait_copies()


def _before_forward(module: torch.nn.Module, args: Any) -> None:
    if not any(ck._pending is not None and ck._pending.cpu_copies for ck in list(_guarded)):
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


def _agree_step(candidates: list[int]) -> int | None:
    """The newest step present in every rank's candidate list (None when there is none)."""
    import torch.distributed as dist

    dev = _collective_device()
    mine = torch.full((MAX_CANDIDATES,), -1, dtype=torch.int64)
    top = candidates[:MAX_CANDIDATES]
    mine[: len(top)] = torch.tensor(top, dtype=torch.int64)
    mine = mine.to(dev)
    gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, mine)
    common: set[int] | None = None
    for g in gathered:
        steps = {int(s) for s in g.cpu().tolist() if s >= 0}
        common = steps if common is None else common & steps
    return max(common) if common else None


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


def _log_event(kind: str, message: str, severity: str = "info", rank: int | None = None,
               evidence: dict[str, Any] | None = None) -> None:
    level = {"info": logging.INFO, "warning": logging.WARNING}.get(severity, logging.ERROR)
    log.log(level, "[%s]%s %s", kind, f" rank={rank}" if rank is not None else "", message)
