"""Checkpoints on disk: one directory per step, two files per rank, written so a crash never corrupts.

    CKPT_DIR/step-0000000120/rank-00000.bin    raw tensor bytes (the snapshot's data region)
    CKPT_DIR/step-0000000120/rank-00000.json   manifest: structure, tensor table, size and CRC32

Write order: data to a temp file, fsync, rename; manifest likewise; fsync the directory. The
manifest is the commit record: a step without it, with a short data file or a bad CRC is skipped
by the reader (which then falls back to the step before). Nothing here unpickles anything.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import torch

from trainguard.checkpoint.format import decode_manifest, parse_entries

CHUNK = 8 << 20
_TMP_MARK = ".tmp-"


class CorruptCheckpoint(Exception):
    """A checkpoint that is partial or whose checksum does not verify."""


class SnapshotChanged(Exception):
    """The shared-memory snapshot was overwritten while it was being persisted."""


@dataclass(frozen=True)
class Persisted:
    rank: int
    step: int
    path: Path
    nbytes: int
    seconds: float


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


def list_steps(ckpt_dir: Path, rank: int) -> list[int]:
    """Steps with a committed manifest for ``rank``, newest first (not yet verified)."""
    try:
        names = os.listdir(ckpt_dir)
    except OSError:  # missing or unusable: nothing to resume from there
        return []
    steps = []
    for name in names:
        step = _parse_step(name)
        if step is not None and (Path(ckpt_dir) / name / manifest_name(rank)).is_file():
            steps.append(step)
    return sorted(steps, reverse=True)


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


def _write_file(path: Path, chunks: Callable[[], Any], throttle: _Throttle) -> tuple[int, int]:
    """Write the chunks, fsync; returns (bytes, crc32)."""
    crc, n = 0, 0
    with open(path, "wb") as f:
        for chunk in chunks():
            f.write(chunk)
            crc = zlib.crc32(chunk, crc)
            n += len(chunk)
            throttle.account(len(chunk))
        f.flush()
        os.fsync(f.fileno())
    return n, crc


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
) -> Persisted:
    """Persist one rank's snapshot. ``meta`` is the snapshot manifest (rank, step, tree, tensors).
    ``still_valid`` is asked before committing: False discards the write (SnapshotChanged).
    On any error the temp files are removed and the previous checkpoints are untouched."""
    t0 = time.monotonic()
    rank, step = int(meta["rank"]), int(meta["step"])
    sdir = step_dir(ckpt_dir, step)
    sdir.mkdir(parents=True, exist_ok=True)
    tag = f"{_TMP_MARK}{socket.gethostname()}-{os.getpid()}"
    tmp_data = sdir / (data_name(rank) + tag)
    tmp_meta = sdir / (manifest_name(rank) + tag)
    throttle = _Throttle(max_bytes_per_s)
    try:
        nbytes, crc = _write_file(
            tmp_data, lambda: (data[i : i + CHUNK] for i in range(0, len(data), CHUNK)), throttle
        )
        if not still_valid():
            raise SnapshotChanged(f"rank {rank} step {step} was overwritten while persisting")
        full = dict(meta, data={"file": data_name(rank), "size": nbytes, "crc32": crc},
                    persisted_at=time.time(), host=socket.gethostname())
        raw = json.dumps(full, separators=(",", ":")).encode()
        _write_file(tmp_meta, lambda: [raw], _Throttle(0))
        # Data first, manifest last: the manifest's presence commits the step.
        os.replace(tmp_data, sdir / data_name(rank))
        os.replace(tmp_meta, sdir / manifest_name(rank))
        _fsync_dir(sdir)
    except BaseException:
        for p in (tmp_data, tmp_meta):
            p.unlink(missing_ok=True)
        _remove_if_empty(sdir)
        raise
    return Persisted(rank, step, sdir, nbytes, time.monotonic() - t0)


def read_checkpoint(ckpt_dir: Path, rank: int, step: int) -> tuple[dict[str, Any], torch.Tensor]:
    """(manifest, flat uint8 data) of one rank's checkpoint, verified. Raises CorruptCheckpoint."""
    sdir = step_dir(ckpt_dir, step)
    try:
        meta = decode_manifest((sdir / manifest_name(rank)).read_bytes())
        info = meta["data"]
        size, want_crc = int(info["size"]), int(info["crc32"])
        if meta.get("rank") != rank or meta["step"] != step:
            raise CorruptCheckpoint(f"manifest says rank {meta.get('rank')} step {meta['step']}")
        path = sdir / data_name(rank)
        if path.stat().st_size != size:
            raise CorruptCheckpoint(f"{path.name}: {path.stat().st_size} bytes, manifest says {size}")
        buf = bytearray(size)
        crc = 0
        with open(path, "rb") as f, memoryview(buf) as mv:
            for i in range(0, size, CHUNK):
                part = mv[i : i + CHUNK]
                if f.readinto(part) != len(part):
                    raise CorruptCheckpoint(f"{path.name}: short read")
                crc = zlib.crc32(part, crc)
        if crc != want_crc:
            raise CorruptCheckpoint(f"{path.name}: CRC32 {crc:#010x} != {want_crc:#010x} in the manifest")
        parse_entries(meta["tensors"], size)
    except CorruptCheckpoint:
        raise
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CorruptCheckpoint(f"step {step} rank {rank}: {exc}") from None
    data = torch.frombuffer(buf, dtype=torch.uint8) if size else torch.empty(0, dtype=torch.uint8)
    return meta, data


def prune(ckpt_dir: Path, rank: int, keep: int) -> list[int]:
    """Delete this rank's files in all but the ``keep`` newest committed steps. Returns removed steps."""
    steps = list_steps(ckpt_dir, rank)
    removed = []
    for step in steps[keep:]:
        sdir = step_dir(ckpt_dir, step)
        for name in (manifest_name(rank), data_name(rank)):  # manifest first: uncommit, then data
            (sdir / name).unlink(missing_ok=True)
        _remove_if_empty(sdir)
        removed.append(step)
    return removed


def clean_temp_files(ckpt_dir: Path) -> int:
    """Remove temp files left by killed persists (this host's, whose writer process is gone)."""
    mark = f"{_TMP_MARK}{socket.gethostname()}-"
    n = 0
    try:
        dirs = [d for d in Path(ckpt_dir).iterdir() if _parse_step(d.name) is not None]
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


def _remove_if_empty(d: Path) -> None:
    try:
        d.rmdir()
    except OSError:
        pass


def remove_tree(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)
