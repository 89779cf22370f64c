"""Per-rank shared-memory ring of fixed-size span records: the layout and the (single) writer.

One worker process writes, its node's agent reads (``trainguard.probes.ring_reader``). The file
lives in ``/dev/shm`` (tmpfs: memory, never disk); the agent unlinks it as soon as it has mapped it,
so nothing is left behind even when everyone is killed.

Layout (little endian)::

    0     header (128 bytes, fields below)
    128   step history: STEP_HISTORY x (end_unix_ns i64, duration_ns i64), slot = (step - 1) % STEP_HISTORY
    4224  span names: MAX_NAMES x 32 bytes utf-8 (named spans: ``trainguard.span("name")``)
    8320  collectives: COLL_SLOTS x u32: [0] collectives started, [1] id of the last one started
          (1 + its index in COLL_OPS), [2 + i] calls of COLL_OPS[i] started
    8576  records: capacity x RECORD (kind u8, aux u8, name_id u16, step u32, start_ns i64, end_ns i64,
          seq u64)

Record times are ``time.perf_counter_ns()`` (CLOCK_MONOTONIC); the header's ``clock_offset_ns``
turns them into unix ns. A record carries its own sequence number (write index + 1), written last
in the same store, so publishing a record is one ``pack_into`` and no header write. The reader
takes slot ``i`` when its seq is ``i + 1``; a larger seq means the writer lapped it (the reader
counts the lost records and skips ahead). A reader lapped *while* copying a slot could take a torn
record; at 32768 slots and a drain every 0.2 s that needs >150k spans/s.

The header's step fields are written on every step whatever the profiling switch says, so the
hang detector always has step timing; the collective counters likewise on every collective (a
rank's sequence number and its calls per operation: the hang report says which of two ranks in
two different collectives is out of sequence, detect/sequence.py).
"""

from __future__ import annotations

import mmap
import os
import struct
import time
from dataclasses import dataclass

MAGIC = 0x31524754  # "TGR1"
VERSION = 2  # 2: the collective counters

# Span kinds. The first five are the seed's (TaskD lightweight profiling) names.
STEP, FP, DATALOADER, COMMUNICATION, SAVE_CHECKPOINT, USER = 1, 2, 3, 4, 5, 6
KIND_NAMES = {
    STEP: "Step",
    FP: "FP",
    DATALOADER: "DataLoader",
    COMMUNICATION: "Communication",
    SAVE_CHECKPOINT: "SaveCheckpoint",
    USER: "User",
}

# Switch bits in the header's flag word. Seed rule: Step, SaveCheckpoint, FP and DataLoader switch
# on and off together (BASIC); Communication separately, and only while BASIC is on.
FLAG_BASIC = 1
FLAG_COMM = 2
# Not a span switch: `trainguard chaos hang` holds the rank before its next collective while set
# (worker/hooks.py checks it in the collective wrappers; the agent sets it, monitors/profiling/monitor.py).
FLAG_HOLD = 1 << 8
KIND_FLAG = {
    STEP: FLAG_BASIC,
    FP: FLAG_BASIC,
    DATALOADER: FLAG_BASIC,
    SAVE_CHECKPOINT: FLAG_BASIC,
    USER: FLAG_BASIC,
    COMMUNICATION: FLAG_COMM,
}

HEADER = struct.Struct("<IIIIIiII")  # magic, version, capacity, record_size, flags, rank, pid, names
HEADER_SIZE = 128
# 8-byte fields after the first 32 bytes, as indexes into a u64/i64 view of the header.
# index 4 is reserved (records carry their own sequence numbers)
IDX_STEPS = 5  # steps completed (u64)
IDX_LAST_END = 6  # unix ns of the last step end
IDX_LAST_DUR = 7  # ns
IDX_CLOCK_OFFSET = 8  # time.time_ns() - time.perf_counter_ns()
IDX_DROPPED = 9  # records the writer had to drop (pending queue full)
# 32-bit field indexes into a u32 view.
IDX_FLAGS32 = 4
IDX_PID32 = 6
IDX_NAMES32 = 7

STEP_HISTORY = 256
STEP_OFF = HEADER_SIZE
NAME_SIZE = 32
MAX_NAMES = 128
NAMES_OFF = STEP_OFF + STEP_HISTORY * 16
COLL_OFF = NAMES_OFF + MAX_NAMES * NAME_SIZE
COLL_SLOTS = 64
# The operations counted (worker/hooks.py: the torch.distributed collectives it wraps and DDP's
# gradient all-reduce, one per bucket). Append only: the index is the id.
COLL_OPS = (
    "all_reduce", "all_reduce_coalesced", "broadcast", "reduce", "all_gather", "all_gather_into_tensor",
    "all_gather_coalesced", "reduce_scatter", "reduce_scatter_tensor", "all_to_all", "all_to_all_single", "barrier",
    "monitored_barrier", "gather", "scatter", "send", "recv", "all_gather_object", "broadcast_object_list",
    "gather_object", "scatter_object_list", "ddp_gradient_all_reduce",
)  # fmt: skip
RECORDS_OFF = COLL_OFF + COLL_SLOTS * 4
RECORD = struct.Struct("<BBHIqqQ")
DEFAULT_CAPACITY = 1 << 15  # 32768 records x 32 B = 1 MiB per rank


def ring_size(capacity: int) -> int:
    return RECORDS_OFF + capacity * RECORD.size


def ring_path(prefix: str, attempt: int | str, rank: int | str) -> str:
    """The one naming rule shared by the worker (creates) and the agent (opens)."""
    return f"{prefix}-a{attempt}-r{rank}"


def shm_dir() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") else os.environ.get("TMPDIR", "/tmp")


@dataclass(frozen=True)
class Record:
    kind: int
    aux: int  # 1: device-timed (CUDA events)
    name_id: int
    step: int
    start_ns: int  # unix ns (converted by the reader)
    end_ns: int


class RingWriter:
    """Creates the ring and writes to it. Only the creating process writes (one writer).

    With ``path=None`` the ring starts in private memory (``MAP_PRIVATE``: a forked child gets its
    own copy) and ``claim(path)`` later moves it, with everything written so far, into the shared
    file the agent reads: a process only takes its rank's ring once it is known to train."""

    def __init__(self, path: str | None, rank: int, capacity: int = DEFAULT_CAPACITY, flags: int = 0) -> None:
        if capacity <= 0 or capacity & (capacity - 1):
            raise ValueError(f"ring capacity must be a power of two, got {capacity}")
        self.path = path
        self.capacity = capacity
        self.mask = capacity - 1
        size = ring_size(capacity)
        self.mm = _map_file(path, size, exclusive=False) if path else mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE)
        self._views()
        self.i64[IDX_CLOCK_OFFSET] = time.time_ns() - time.perf_counter_ns()
        # Magic last: a reader never sees a half-initialised header as valid.
        HEADER.pack_into(self.mm, 0, 0, VERSION, capacity, RECORD.size, flags, rank, os.getpid(), 0)
        self.u32[0] = MAGIC
        self.write_index = 0
        self.names: dict[str, int] = {}

    def _views(self) -> None:
        self.u64 = memoryview(self.mm)[:HEADER_SIZE].cast("Q")
        self.i64 = memoryview(self.mm)[:HEADER_SIZE].cast("q")
        self.u32 = memoryview(self.mm)[:HEADER_SIZE].cast("I")
        self.steps_view = memoryview(self.mm)[STEP_OFF:NAMES_OFF].cast("q")
        self.coll_view = memoryview(self.mm)[COLL_OFF:RECORDS_OFF].cast("I")

    def claim(self, path: str) -> None:
        """Move a private ring into a new file at ``path`` (FileExistsError when another process
        took it first). The views change: holders of ``u32`` must fetch it again."""
        mm = _map_file(path, len(self.mm), exclusive=True)
        mm[4:] = self.mm[4:]
        struct.pack_into("<I", mm, 4 * IDX_PID32, os.getpid())  # the header's pid: the claiming process
        mm[:4] = self.mm[:4]  # magic last, as in __init__
        # The private ring is not closed: a thread may still hold one of its views for an instant
        # (it reads stale flags, harmlessly); it is unmapped once the last view is dropped.
        self.mm, self.path = mm, path
        self._views()

    @property
    def flags(self) -> int:
        return self.u32[IDX_FLAGS32]

    @property
    def clock_offset_ns(self) -> int:
        return self.i64[IDX_CLOCK_OFFSET]

    def write(self, kind: int, name_id: int, step: int, start_ns: int, end_ns: int, aux: int = 0) -> None:
        i = self.write_index
        self.write_index = i + 1
        RECORD.pack_into(self.mm, RECORDS_OFF + (i & self.mask) * 32, kind, aux, name_id, step, start_ns, end_ns, i + 1)

    def write_step(self, step: int, end_ns: int, duration_ns: int) -> None:
        """Step count and timing, always (the hang detector reads these with profiling off)."""
        end_unix = end_ns + self.i64[IDX_CLOCK_OFFSET]
        slot = ((step - 1) % STEP_HISTORY) * 2
        self.steps_view[slot] = end_unix
        self.steps_view[slot + 1] = duration_ns
        self.i64[IDX_LAST_END] = end_unix
        self.i64[IDX_LAST_DUR] = duration_ns
        self.u64[IDX_STEPS] = step  # published last

    def collective(self, op_id: int) -> None:
        """One collective started: ``op_id`` is 1 + its index in COLL_OPS (any thread: the agent
        only reads these counters, and a rank runs one collective at a time per stream)."""
        v = self.coll_view
        v[2 + op_id - 1] += 1
        v[1] = op_id
        v[0] += 1  # published last

    def add_dropped(self, n: int) -> None:
        self.u64[IDX_DROPPED] += n

    def name_id(self, name: str) -> int:
        """Id of a named span (0 when the table is full: recorded as unnamed)."""
        nid = self.names.get(name)
        if nid is not None:
            return nid
        if len(self.names) >= MAX_NAMES - 1:
            return 0
        nid = len(self.names) + 1
        raw = name.encode("utf-8", "replace")[: NAME_SIZE - 1]
        off = NAMES_OFF + (nid - 1) * NAME_SIZE
        self.mm[off : off + NAME_SIZE] = raw.ljust(NAME_SIZE, b"\0")
        self.names[name] = nid
        self.u32[IDX_NAMES32] = nid
        return nid

    def close(self) -> None:
        for view in (self.u64, self.i64, self.u32, self.steps_view, self.coll_view):
            view.release()
        self.mm.close()


def _map_file(path: str, size: int, exclusive: bool) -> mmap.mmap:
    flags = os.O_RDWR | os.O_CREAT | (os.O_EXCL if exclusive else os.O_TRUNC)
    fd = os.open(path, flags, 0o600)
    try:
        os.ftruncate(fd, size)
        return mmap.mmap(fd, size)
    finally:
        os.close(fd)
