"""Agent side of the per-rank shared-memory ring (layout in ``trainguard.worker.ring``).

Reads new span records, the always-on step history, and writes the profiling switch word.
"""

from __future__ import annotations

import mmap
import os
from dataclasses import dataclass

from trainguard.worker import ring as R


class RingNotReady(Exception):
    """The file is missing, too short, or its writer has not finished initialising it."""


@dataclass(frozen=True)
class StepEntry:
    step: int
    end_unix_ns: int
    duration_ns: int


@dataclass(frozen=True)
class CollectiveCounts:
    seq: int  # collectives started (the rank's sequence number)
    last: str  # the last one started (COLL_OPS name; "" before any)
    calls: dict[str, int]  # op -> calls started


class RingReader:
    def __init__(self, path: str, unlink: bool = False) -> None:
        """Map the ring at ``path``. With ``unlink`` the file name is removed once mapped, so the
        memory goes away with the last mapping (no leftovers in /dev/shm)."""
        try:
            fd = os.open(path, os.O_RDWR)
        except FileNotFoundError as exc:
            raise RingNotReady(f"no ring at {path}") from exc
        try:
            size = os.fstat(fd).st_size
            if size < R.RECORDS_OFF:
                raise RingNotReady(f"ring {path} not initialised yet")
            mm = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        magic, version, capacity, record_size, _, rank, pid, _ = R.HEADER.unpack_from(mm, 0)
        if magic != R.MAGIC or size < R.ring_size(capacity):
            mm.close()
            raise RingNotReady(f"ring {path} not initialised yet")
        if version != R.VERSION or record_size != R.RECORD.size:
            mm.close()
            raise ValueError(f"ring {path}: unsupported version {version} / record size {record_size}")
        self.path = path
        self.mm = mm
        self.rank = rank
        self.pid = pid
        self.capacity = capacity
        self.mask = capacity - 1
        self._u64 = memoryview(mm)[: R.HEADER_SIZE].cast("Q")
        self._i64 = memoryview(mm)[: R.HEADER_SIZE].cast("q")
        self._u32 = memoryview(mm)[: R.HEADER_SIZE].cast("I")
        self._steps = memoryview(mm)[R.STEP_OFF : R.NAMES_OFF].cast("q")
        self._coll = memoryview(mm)[R.COLL_OFF : R.RECORDS_OFF].cast("I")
        self.offset_ns = self._i64[R.IDX_CLOCK_OFFSET]
        self.read_index = 0
        self.lost = 0  # records overwritten before we read them
        self._names: dict[int, str] = {}
        if unlink:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass

    # ---- header -------------------------------------------------------------------------------
    @property
    def flags(self) -> int:
        return self._u32[R.IDX_FLAGS32]

    def set_flags(self, flags: int) -> None:
        self._u32[R.IDX_FLAGS32] = flags

    @property
    def step_count(self) -> int:
        return self._u64[R.IDX_STEPS]

    @property
    def last_step(self) -> StepEntry | None:
        n = self._u64[R.IDX_STEPS]
        if n == 0:
            return None
        return StepEntry(n, self._i64[R.IDX_LAST_END], self._i64[R.IDX_LAST_DUR])

    def collectives(self) -> CollectiveCounts:
        """The rank's collective counters (always on): its sequence number, its last call, and
        its calls per operation."""
        v = self._coll
        seq, last = v[0], v[1]
        calls = {op: v[2 + i] for i, op in enumerate(R.COLL_OPS) if v[2 + i]}
        return CollectiveCounts(seq, R.COLL_OPS[last - 1] if 0 < last <= len(R.COLL_OPS) else "", calls)

    @property
    def dropped(self) -> int:
        return self._u64[R.IDX_DROPPED]

    def steps_since(self, seen: int) -> list[StepEntry]:
        """Steps completed after step number ``seen`` that the history still holds."""
        n = self._u64[R.IDX_STEPS]
        out = []
        for step in range(max(seen + 1, n - R.STEP_HISTORY + 1, 1), n + 1):
            slot = ((step - 1) % R.STEP_HISTORY) * 2
            out.append(StepEntry(step, self._steps[slot], self._steps[slot + 1]))
        # Slots the writer reused while we copied (seqlock-style check) are dropped.
        n2 = self._u64[R.IDX_STEPS]
        return [e for e in out if e.step > n2 - R.STEP_HISTORY + 1]

    # ---- records ------------------------------------------------------------------------------
    def name(self, name_id: int) -> str:
        name = self._names.get(name_id)
        if name is None:
            off = R.NAMES_OFF + (name_id - 1) * R.NAME_SIZE
            name = bytes(self.mm[off : off + R.NAME_SIZE]).split(b"\0", 1)[0].decode("utf-8", "replace")
            if name:
                self._names[name_id] = name
        return name

    def read_new(self, limit: int = 1 << 30) -> list[R.Record]:
        """Records written since the last call (at most ``limit``), oldest first, times in unix ns."""
        out = []
        i = self.read_index
        off = self.offset_ns
        unpack, mm, mask, size = R.RECORD.unpack_from, self.mm, self.mask, R.RECORD.size
        while len(out) < limit:
            kind, aux, name_id, step, start, end, seq = unpack(mm, R.RECORDS_OFF + (i & mask) * size)
            if seq <= i:
                break  # not written yet
            if seq > i + 1:  # the writer lapped us: records before seq - capacity are gone
                skip = max(seq - self.capacity, i + 1) - i
                self.lost += skip
                i += skip
                continue
            out.append(R.Record(kind, aux, name_id, step, start + off, end + off))
            i += 1
        self.read_index = i
        return out

    def close(self) -> None:
        for view in (self._u64, self._i64, self._u32, self._steps, self._coll):
            view.release()
        self.mm.close()
