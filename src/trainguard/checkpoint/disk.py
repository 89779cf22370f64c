"""Checkpoints on disk: one directory per step, two files per rank, written so a crash never corrupts.

    CKPT_DIR/step-0000000120/rank-00000.bin    raw tensor bytes (the snapshot's data region)
    CKPT_DIR/step-0000000120/rank-00000.json   sealed manifest: structure, tensor table, the data's
                                               size and checksum, then the manifest's own CRC32

Write order: data to a temp file, fsync, rename; manifest likewise; fsync the directory. The
manifest is the commit record: a step without it, with a short data file, a bad checksum or an
edited manifest is skipped by the reader (which then falls back to the step before). Nothing here
unpickles anything.

The data is written with O_DIRECT where the file system allows it: straight from the shared-memory
snapshot to the disk, without copying 2 bytes of CPU work per byte into the page cache and without
filling the page cache with checkpoint pages that would push out the job's own (the buffered
fallback drops its pages with posix_fadvise after the fsync).

Pruning keeps the ``keep`` most recently persisted checkpoints of a rank that verify (the one just
written always among them). Checkpoints that do not verify are not counted as kept: they are moved
aside to ``CKPT_DIR/quarantine/`` (never deleted: the caller reports what was moved and why).
"""

from __future__ import annotations

import ctypes
import errno
import math
import mmap
import os
import shutil
import socket
import stat
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import torch

from trainguard import runfiles
from trainguard.checkpoint.format import (
    DEFAULT_CHECKSUM,
    MAX_MANIFEST_BYTES,
    ChecksumUnavailable,
    FormatError,
    checksum_fn,
    open_manifest,
    parse_entries,
    seal_manifest,
)

CHUNK = 8 << 20
_TMP_MARK = ".tmp-"
_DIRECT_ALIGN = 4096
QUARANTINE = "quarantine"
ABANDONED = "abandoned"  # a rank's checkpoints of steps after the one a restart resumed from


FILE_MODE = 0o600  # checkpoints hold the model's weights: readable by their owner only
DIR_MODE = 0o700


def make_private_dir(path: Path) -> None:
    """Create ``path`` and every missing parent as a 0700 directory (Path.mkdir gives parents the
    umask's mode, often 0755). One that exists is left as it is: the user's own directory."""
    path = Path(path)
    missing: list[Path] = []
    while not os.path.lexists(path) and path != path.parent:
        missing.append(path)
        path = path.parent
    for d in reversed(missing):
        try:
            d.mkdir(mode=DIR_MODE)
        except FileExistsError:  # made meanwhile by another process: theirs to have set
            pass


class CorruptCheckpoint(Exception):
    """A checkpoint that is partial or whose checksum does not verify."""


class CannotVerify(CorruptCheckpoint):
    """A checkpoint this installation cannot check (a checksum it cannot compute): not loaded, but
    not treated as damaged either (never quarantined)."""


class SnapshotChanged(Exception):
    """The shared-memory snapshot was overwritten while it was being persisted."""


@dataclass(frozen=True)
class Persisted:
    rank: int
    step: int
    path: Path
    nbytes: int
    seconds: float
    direct: bool = False  # written with O_DIRECT


def step_dir(ckpt_dir: Path, step: int) -> Path:
    return Path(ckpt_dir) / f"step-{step:010d}"


def data_name(rank: int) -> str:
    return f"rank-{rank:05d}.bin"


def manifest_name(rank: int) -> str:
    return f"rank-{rank:05d}.json"


def _parse_step(name: str) -> int | None:
    if not name.startswith("step-"):
        return None
    digits = name[5:]
    return int(digits) if digits.isdigit() else None


def _parse_rank(name: str) -> int | None:
    if not (name.startswith("rank-") and name.endswith(".json")):
        return None
    digits = name[5:-5]
    return int(digits) if digits.isdigit() else None


def own_step_dir(ckpt_dir: Path, step: int) -> Path | None:
    """The step's directory when it is a real directory inside ``ckpt_dir`` (not a symlink to one
    elsewhere), else None. Whatever deletes or moves checkpoint files goes through here: a
    ``step-*`` link (made by a user, or planted) must never lead pruning to files outside."""
    sdir = step_dir(ckpt_dir, step)
    try:
        st = os.lstat(sdir)
    except OSError:
        return None
    return sdir if stat.S_ISDIR(st.st_mode) else None


def all_steps(ckpt_dir: Path) -> list[int]:
    """Every step directory, newest first (whoever's files are in it)."""
    try:
        names = os.listdir(ckpt_dir)
    except OSError:  # missing or unusable: nothing to resume from there
        return []
    return sorted((s for s in map(_parse_step, names) if s is not None), reverse=True)


def list_steps(ckpt_dir: Path, rank: int) -> list[int]:
    """Steps with a committed manifest for ``rank``, newest first (not yet verified)."""
    return [s for s in all_steps(ckpt_dir) if (step_dir(ckpt_dir, s) / manifest_name(rank)).is_file()]


def newer_on_disk(ckpt_dir: Path, rank: int, step: int) -> bool:
    """Whether a later step than ``step`` is complete on disk (every rank of its world committed,
    ``rank`` among them): a resume would take that one, so an older copy of ``rank`` is stale.

    What writes a snapshot out of band (a dead owner's rescued snapshots, a buddy's replicas at a
    breakpoint) skips it then: pruning keeps the most recently *persisted* checkpoints (that is
    how an abandoned timeline's higher steps go after a rollback), so writing an older step would
    count as the newest and prune the later ones. The soak bench (2026-11-28) saw exactly that: a
    standby's rescue of its own stale step 342 and a buddy's replicas of 204 and 343 pruned rank 2's
    steps 589-591, and the job resumed from step 0.

    Only a *complete* later step counts: after a node loss a buddy may write the lost rank's step
    17 and then its 16, the newest step whose every shard exists (another lost rank's replica
    reached 16 only); skipping 16 for the partial 17 left no complete step but an old one
    (bench/faults.py's kill-buddy-then-node fell back 8 steps to disk, 2026-11-28)."""
    return any(s > step and complete(ckpt_dir, s, rank) for s in list_steps(ckpt_dir, rank))


def complete(ckpt_dir: Path, step: int, rank: int) -> bool:
    """Whether every rank of the world that ``rank``'s manifest at ``step`` names has a committed
    manifest there (not verified: the data is read only by a resume)."""
    try:
        world = read_manifest(ckpt_dir, rank, step).get("world_size")
    except CorruptCheckpoint:
        return False
    return isinstance(world, int) and world > 0 and set(range(world)) <= set(ranks_at(ckpt_dir, step))


def ranks_at(ckpt_dir: Path, step: int) -> list[int]:
    """Ranks with a committed manifest at ``step``, ascending."""
    try:
        names = os.listdir(step_dir(ckpt_dir, step))
    except OSError:
        return []
    return sorted(r for r in map(_parse_rank, names) if r is not None)


# --- writing ---------------------------------------------------------------------------------------
class _Throttle:
    """Caps the write rate so persisting does not starve the job's own I/O (0: no cap)."""

    def __init__(self, bytes_per_s: float) -> None:
        self.rate = bytes_per_s
        self.start = time.monotonic()
        self.done = 0

    def account(self, n: int) -> None:
        if self.rate <= 0:
            return
        self.done += n
        ahead = self.done / self.rate - (time.monotonic() - self.start)
        if ahead > 0:
            time.sleep(ahead)


def _address(mv: memoryview) -> int | None:
    """The memory address of a writable buffer (None for read-only ones)."""
    try:
        return ctypes.addressof(ctypes.c_char.from_buffer(mv))
    except (TypeError, ValueError):
        return None


def _chunks(data: memoryview) -> Iterator[memoryview]:
    for i in range(0, len(data), CHUNK):
        yield data[i : i + CHUNK]


def _write_direct(fd: int, data: memoryview, fn: Callable[[Any, int], int], throttle: _Throttle) -> int:
    """O_DIRECT: whole aligned blocks straight from ``data``; the tail through an aligned bounce
    page, then the file is cut to its real length. Returns the checksum."""
    value = 0
    whole = len(data) // _DIRECT_ALIGN * _DIRECT_ALIGN
    for chunk in _chunks(data[:whole]):
        value = fn(chunk, value)
        if os.write(fd, chunk) != len(chunk):
            raise OSError(errno.EIO, "short O_DIRECT write")
        throttle.account(len(chunk))
    tail = data[whole:]
    if len(tail):
        value = fn(tail, value)
        with mmap.mmap(-1, _DIRECT_ALIGN) as page:  # page-aligned, zero-filled
            page[: len(tail)] = tail
            if os.write(fd, page) != _DIRECT_ALIGN:
                raise OSError(errno.EIO, "short O_DIRECT write")
        os.ftruncate(fd, len(data))
    return value


def _write_buffered(fd: int, data: memoryview, fn: Callable[[Any, int], int], throttle: _Throttle) -> int:
    value = 0
    for chunk in _chunks(data):
        value = fn(chunk, value)
        view = chunk
        while len(view):
            view = view[os.write(fd, view) :]
        throttle.account(len(chunk))
    return value


def _write_data(path: Path, data: memoryview, throttle: _Throttle, algo: str) -> tuple[int, bool]:
    """Write ``data`` to ``path`` and fsync. Returns (checksum, written with O_DIRECT)."""
    fn = checksum_fn(algo)
    addr = _address(data)
    direct = hasattr(os, "O_DIRECT") and addr is not None and addr % _DIRECT_ALIGN == 0 and len(data) >= CHUNK
    if direct:
        try:
            fd = _create(path, os.O_DIRECT)
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise
            direct = False  # this file system does not do O_DIRECT
        else:
            try:
                value = _write_direct(fd, data, fn, throttle)
                os.fsync(fd)
                return value, True
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
                direct = False  # alignment this device does not accept: write it buffered
            finally:
                os.close(fd)
    fd = _create(path)
    try:
        value = _write_buffered(fd, data, fn, throttle)
        os.fsync(fd)
        if hasattr(os, "posix_fadvise"):  # written and synced: keep the page cache for the job
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        return value, False
    finally:
        os.close(fd)


def _create(path: Path, extra: int = 0) -> int:
    """A new file at ``path`` (a temp name of this process): never through a symlink or onto
    something planted there (O_EXCL | O_NOFOLLOW), whatever a shared checkpoint dir holds."""
    path.unlink(missing_ok=True)  # a leftover of an earlier process with this pid (the name itself, never a target)
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC | extra, FILE_MODE)


def _write_small(path: Path, raw: bytes) -> None:
    with open(_create(path), "wb") as f:
        f.write(raw)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_checkpoint(
    ckpt_dir: Path,
    meta: dict[str, Any],
    data: memoryview,
    still_valid: Callable[[], bool] = lambda: True,
    max_bytes_per_s: float = 0,
    checksum: str = DEFAULT_CHECKSUM,
) -> Persisted:
    """Persist one rank's snapshot. ``meta`` is the snapshot manifest (rank, step, tree, tensors).
    ``still_valid`` is asked before committing: False discards the write (SnapshotChanged).
    On any error the temp files are removed and the previous checkpoints are untouched."""
    t0 = time.monotonic()
    rank, step = int(meta["rank"]), int(meta["step"])
    sdir = step_dir(ckpt_dir, step)
    make_private_dir(sdir)
    runfiles.safe_dir(sdir)  # a step-* symlink would take the snapshot outside the checkpoint dir
    tag = f"{_TMP_MARK}{socket.gethostname()}-{os.getpid()}"
    tmp_data = sdir / (data_name(rank) + tag)
    tmp_meta = sdir / (manifest_name(rank) + tag)
    try:
        value, direct = _write_data(tmp_data, data, _Throttle(max_bytes_per_s), checksum)
        if not still_valid():
            raise SnapshotChanged(f"rank {rank} step {step} was overwritten while persisting")
        full = dict(meta, data={"file": data_name(rank), "size": len(data), "checksum": checksum, "value": value},
                    persisted_at=time.time(), host=socket.gethostname())
        _write_small(tmp_meta, seal_manifest(full))
        # Data first, manifest last: the manifest's presence commits the step.
        os.replace(tmp_data, sdir / data_name(rank))
        os.replace(tmp_meta, sdir / manifest_name(rank))
        _fsync_dir(sdir)
    except BaseException:
        for p in (tmp_data, tmp_meta):
            p.unlink(missing_ok=True)
        _remove_if_empty(sdir)
        raise
    return Persisted(rank, step, sdir, len(data), time.monotonic() - t0, direct)


# --- reading ---------------------------------------------------------------------------------------
def read_manifest(ckpt_dir: Path, rank: int, step: int) -> dict[str, Any]:
    """One rank's sealed manifest at ``step``, checksum verified. Raises CorruptCheckpoint."""
    path = step_dir(ckpt_dir, step) / manifest_name(rank)
    try:
        with open(path, "rb") as f:
            if os.fstat(f.fileno()).st_size > _manifest_limit():
                raise CorruptCheckpoint(f"{path.name}: manifest larger than {_manifest_limit() >> 20} MiB")
            raw = f.read(_manifest_limit() + 1)
        if len(raw) > _manifest_limit():
            raise CorruptCheckpoint(f"{path.name}: manifest larger than {_manifest_limit() >> 20} MiB")
        meta = open_manifest(raw)
        info = meta.get("data")
        if not isinstance(info, dict) or not all(isinstance(info.get(k), int) for k in ("size", "value")):
            raise CorruptCheckpoint(f"{path.name}: manifest lacks the data size and checksum")
        if meta.get("rank") != rank or meta["step"] != step:
            raise CorruptCheckpoint(f"{path.name}: manifest says rank {meta.get('rank')} step {meta['step']}")
    except CorruptCheckpoint:
        raise
    except FormatError as exc:
        raise CorruptCheckpoint(f"step {step} rank {rank}: {exc}") from None
    except OSError as exc:
        raise CorruptCheckpoint(f"step {step} rank {rank}: {exc}") from None
    return meta


def _manifest_limit() -> int:
    return MAX_MANIFEST_BYTES + 64


def _algo(meta: dict[str, Any]) -> str:
    return str(meta["data"].get("checksum", "checksum")).upper()


def _open_data(ckpt_dir: Path, rank: int, step: int, meta: dict[str, Any]) -> tuple[Any, int, Callable, int]:
    info = meta["data"]
    size, want = info["size"], info["value"]
    fn = checksum_fn(info.get("checksum"))
    path = step_dir(ckpt_dir, step) / data_name(rank)
    f = open(path, "rb")  # noqa: SIM115 (closed by the callers)
    actual = os.fstat(f.fileno()).st_size
    if actual != size:
        f.close()
        raise CorruptCheckpoint(f"{path.name}: {actual} bytes, manifest says {size}")
    return f, size, fn, want


def read_checkpoint(ckpt_dir: Path, rank: int, step: int) -> tuple[dict[str, Any], torch.Tensor]:
    """(manifest, flat uint8 data) of one rank's checkpoint, verified. Raises CorruptCheckpoint."""
    return _read_verified(ckpt_dir, rank, step, keep=True)


def verify_checkpoint(ckpt_dir: Path, rank: int, step: int) -> dict[str, Any]:
    """Check one rank's checkpoint end to end without keeping its data (one reused buffer).
    Returns the manifest; raises CorruptCheckpoint."""
    return _read_verified(ckpt_dir, rank, step, keep=False)[0]


def _read_verified(ckpt_dir: Path, rank: int, step: int, keep: bool) -> tuple[dict[str, Any], torch.Tensor]:
    meta = read_manifest(ckpt_dir, rank, step)
    try:
        f, size, fn, want = _open_data(ckpt_dir, rank, step, meta)
        with f:
            parse_entries(meta["tensors"], size)  # before allocating: the table must fit the file
            if keep:
                available = psutil.virtual_memory().available
                if size > available:
                    raise CorruptCheckpoint(f"step {step} rank {rank}: {size / 1e9:.1f} GB of data, "
                                            f"only {available / 1e9:.1f} GB of memory available")
            data = torch.empty(size if keep else min(CHUNK, size), dtype=torch.uint8)
            value = 0
            with memoryview(data.numpy()) as mv:
                for i in range(0, size, CHUNK):
                    part = mv[i : i + CHUNK] if keep else mv[: min(CHUNK, size - i)]
                    if f.readinto(part) != len(part):
                        raise CorruptCheckpoint(f"{data_name(rank)}: short read")
                    value = fn(part, value)
        if value != want:
            raise CorruptCheckpoint(f"{data_name(rank)}: {_algo(meta)} {value:#010x} != {want:#010x} in the manifest")
    except CorruptCheckpoint:
        raise
    except ChecksumUnavailable as exc:
        raise CannotVerify(f"step {step} rank {rank}: {exc}") from None
    except (OSError, ValueError, KeyError, TypeError, MemoryError) as exc:  # FormatError is a ValueError
        raise CorruptCheckpoint(f"step {step} rank {rank}: {str(exc)[:300]}") from None
    return meta, data


# --- pruning ---------------------------------------------------------------------------------------
@dataclass
class VerifiedCache:
    """Checkpoints already verified (or written) by this process, keyed by the files' identity, so
    pruning reads each checkpoint at most once."""

    ok: dict[tuple[int, int], tuple[tuple[int, ...], float]] = field(default_factory=dict)

    @staticmethod
    def _identity(ckpt_dir: Path, rank: int, step: int) -> tuple[int, ...] | None:
        sdir = step_dir(ckpt_dir, step)
        try:
            a, b = os.stat(sdir / manifest_name(rank)), os.stat(sdir / data_name(rank))
        except OSError:
            return None
        return (a.st_ino, a.st_size, a.st_mtime_ns, b.st_ino, b.st_size, b.st_mtime_ns)

    def add(self, ckpt_dir: Path, rank: int, step: int, taken: float) -> None:
        ident = self._identity(ckpt_dir, rank, step)
        if ident is not None:
            self.ok[(rank, step)] = (ident, taken)

    def check(self, ckpt_dir: Path, rank: int, step: int) -> float:
        """When the checkpoint's state was taken (``taken_at``); raises CorruptCheckpoint when it
        does not verify."""
        ident = self._identity(ckpt_dir, rank, step)
        known = self.ok.get((rank, step))
        if known is not None and ident is not None and known[0] == ident:
            return known[1]
        meta = verify_checkpoint(ckpt_dir, rank, step)
        when = taken_at(meta)
        self.add(ckpt_dir, rank, step, when)
        return when


def taken_at(meta: dict[str, Any]) -> float:
    """When the rank took the snapshot (``save``), which orders checkpoints for pruning; the time it
    was persisted for a manifest without one; 0 for neither. Not the time it was written: at a
    breakpoint the agent writes a rank's older snapshots after its newest, and a restart from an
    older step (a NaN replay) makes newer snapshots of lower steps; the taking time orders both."""
    for key in ("time", "persisted_at"):
        when = meta.get(key)
        if isinstance(when, int | float) and not isinstance(when, bool) and math.isfinite(when):
            return float(when)
    return 0.0


@dataclass
class Pruned:
    removed: list[int] = field(default_factory=list)
    quarantined: dict[int, str] = field(default_factory=dict)  # step -> why it did not verify
    quarantine_dir: Path | None = None


def prune(ckpt_dir: Path, rank: int, keep: int, cache: VerifiedCache | None = None,
          newest: int | None = None, world: int | None = None) -> Pruned:
    """Keep this rank's ``keep`` most recently taken checkpoints that verify (``taken_at``;
    ``newest``, the step just written, always); delete its older ones; move the ones that do not verify to the
    quarantine (they are not counted as kept, and not deleted). Rank 0 also deletes, with the
    steps it deletes, the files of ranks >= ``world`` (a bigger world's, after a shrink)."""
    cache = cache or VerifiedCache()
    keep = max(1, keep)  # the newest is never deleted, whatever keep says (0, -1: a bad setting)
    out = Pruned()
    good: list[tuple[float, int]] = []
    for step in list_steps(ckpt_dir, rank):
        if own_step_dir(ckpt_dir, step) is None:
            continue  # a symlinked step dir: neither kept nor touched (its files live elsewhere)
        try:
            when = cache.check(ckpt_dir, rank, step)
        except CannotVerify:
            continue  # neither kept nor touched: it may be fine elsewhere
        except CorruptCheckpoint as exc:
            out.quarantine_dir = quarantine(ckpt_dir, rank, step)
            out.quarantined[step] = str(exc)
            continue
        good.append((float("inf") if step == newest else when, step))
    good.sort(reverse=True)
    for _, step in good[keep:]:
        sdir = step_dir(ckpt_dir, step)
        for name in (manifest_name(rank), data_name(rank)):  # manifest first: uncommit, then data
            (sdir / name).unlink(missing_ok=True)
        cache.ok.pop((rank, step), None)
        if rank == 0 and world is not None:
            remove_ranks_from(ckpt_dir, step, world)
        _remove_if_empty(sdir)
        out.removed.append(step)
    return out


def abandon_newer(ckpt_dir: Path, rank: int, step: int, world: int) -> list[int]:
    """Move ``rank``'s checkpoints of steps after ``step`` saved at world size ``world`` (what the
    rank saved before the restart that resumed from ``step``: an abandoned timeline) to
    CKPT_DIR/abandoned/, like the quarantine (moved, never deleted). Returns the steps moved."""
    moved = []
    for later in list_steps(ckpt_dir, rank):
        if later <= step:
            break
        try:
            saved_by = read_manifest(ckpt_dir, rank, later).get("world_size")
        except CorruptCheckpoint:
            continue  # not loadable anyway; pruning quarantines it
        if saved_by == world and own_step_dir(ckpt_dir, later) is not None:
            quarantine(ckpt_dir, rank, later, ABANDONED)
            moved.append(later)
    return sorted(moved)


def quarantine(ckpt_dir: Path, rank: int, step: int, place: str = QUARANTINE) -> Path:
    """Move one rank's files of ``step`` to CKPT_DIR/<place>/step-N.<time>/ (same file system:
    a rename). Returns that directory."""
    qdir = Path(ckpt_dir) / place / f"{step_dir(ckpt_dir, step).name}.{time.strftime('%Y%m%dT%H%M%S')}"
    make_private_dir(qdir)
    sdir = own_step_dir(ckpt_dir, step)
    if sdir is None:  # a symlinked step dir: its files are not ours to move
        return qdir
    for name in (manifest_name(rank), data_name(rank)):  # manifest first: uncommit, then data
        try:
            os.replace(sdir / name, qdir / name)
        except FileNotFoundError:
            pass
    _remove_if_empty(sdir)
    return qdir


def clean_temp_files(ckpt_dir: Path) -> int:
    """Remove temp files left by killed persists (this host's, whose writer process is gone)."""
    mark = f"{_TMP_MARK}{socket.gethostname()}-"
    n = 0
    try:
        dirs = [d for d in Path(ckpt_dir).iterdir() if _parse_step(d.name) is not None and not d.is_symlink()]
    except FileNotFoundError:
        return 0
    for d in dirs:
        for p in d.glob(f"*{mark}*"):
            pid = p.name.rpartition("-")[2]
            if pid.isdigit() and psutil.pid_exists(int(pid)):
                continue  # another agent on this host is writing it right now
            p.unlink(missing_ok=True)
            n += 1
        _remove_if_empty(d)
    return n


def remove_ranks_from(ckpt_dir: Path, step: int, first_rank: int) -> int:
    """Delete the files of ranks >= ``first_rank`` at ``step`` (left by a bigger world after a
    shrink, which no agent persists for any more). Returns how many ranks' files went."""
    n = 0
    sdir = own_step_dir(ckpt_dir, step)
    if sdir is None:
        return 0
    for r in ranks_at(ckpt_dir, step):
        if r >= first_rank:
            for name in (manifest_name(r), data_name(r)):
                (sdir / name).unlink(missing_ok=True)
            n += 1
    _remove_if_empty(sdir)
    return n


def _remove_if_empty(d: Path) -> None:
    try:
        d.rmdir()
    except OSError:
        pass


def remove_tree(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)
