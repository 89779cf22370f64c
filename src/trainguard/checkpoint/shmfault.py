"""What a rank does when the shared memory under its snapshots fails, and how loudly it says so.

Two failures used to be silent. The slot directory removed under a running job (tmpwatch, systemd's
``RemoveIPC``): the rank's mappings of its unlinked slot files kept working, ``save`` kept returning
True and nothing newer reached the disk. A tmpfs too small for two slots per rank (Kubernetes'
default 64 MB ``/dev/shm``): every save retried the missing slot for ever. Now the rank falls back
and names the fallback in an error event, at the first failed save and every ``REPORT_EVERY``
failed saves after (``Reporter``):

- ``recreated``: the directory is made again (owner-only, and checked to be a real directory of
  this user's, not writable by others, before a slot is put in it) and the snapshot goes there;
- ``evicted_oldest``: the tmpfs is full: the rank keeps fewer slots, the new snapshot replaces its
  oldest one instead of retrying the missing slot;
- ``direct_to_disk``: neither is possible: the snapshot is written to the checkpoint dir by the
  training thread itself (slower, but nothing newer is lost).
"""

from __future__ import annotations

import errno
import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from trainguard.checkpoint import disk
from trainguard.checkpoint.shm import Slot

# A failure of the same kind is reported at its first save and every REPORT_EVERY failed saves after
# (a job that saves every step would otherwise put one event per step on the console).
REPORT_EVERY = 10
# With fewer slots than wanted the agent often holds the only one while persisting it: a save waits
# this long for it rather than being skipped (the persist of one snapshot takes far less).
PIN_WAIT_S = 30.0


def lost(shm_dir: Path, slots: list[Slot | None]) -> str | None:
    """Why this rank's snapshots are no longer in ``shm_dir`` (None: they are): the directory
    removed or replaced, or a slot file of ours removed (its mapping still works, but nobody else
    can see what we write into it)."""
    why = not_private_dir(shm_dir)
    if why is not None:
        return why
    for slot in slots:
        if slot is not None and not slot.is_file(slot.path):
            return f"slot file {slot.path.name} was removed from {shm_dir}"
    return None


def not_private_dir(path: Path) -> str | None:
    """Why ``path`` is not a real directory of this user's that only they can write (None: it is)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return f"the shared-memory directory {path} was removed"
    except OSError as exc:
        return f"the shared-memory directory {path} cannot be looked at ({exc.strerror or exc})"
    if stat.S_ISLNK(st.st_mode):
        return f"{path} was replaced by a symlink"
    if not stat.S_ISDIR(st.st_mode):
        return f"{path} was replaced by something that is not a directory"
    if st.st_uid != os.geteuid():
        return f"{path} was replaced by a directory of uid {st.st_uid}"
    if st.st_mode & 0o022:
        return f"{path} is writable by group or others (mode {stat.S_IMODE(st.st_mode):04o})"
    return None


def recreate(shm_dir: Path) -> str | None:
    """Make ``shm_dir`` again, owner-only (another rank or the agent may have made it first: that
    one is used when it passes the same checks). None when it is usable; else why not."""
    try:
        os.mkdir(shm_dir, 0o700)
    except FileExistsError:
        pass
    except OSError as exc:
        return f"cannot recreate {shm_dir}: {exc.strerror or exc}"
    return not_private_dir(shm_dir)


def is_full(exc: BaseException) -> bool:
    return isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.ENOMEM, errno.EDQUOT)


def write_direct(ckpt_dir: Path, meta: dict[str, Any], entries: list, tensors: list[torch.Tensor],
                 data_len: int, keep: int) -> disk.Persisted:
    """The snapshot straight into the checkpoint dir (same files the agent's persister writes),
    then this rank's older checkpoints pruned to ``keep``."""
    buf = torch.empty(data_len, dtype=torch.uint8)
    for e, t in zip(entries, tensors, strict=True):
        if e.nbytes:
            buf[e.offset : e.offset + e.nbytes].view(t.dtype).view(t.shape).copy_(t)
    disk.make_private_dir(ckpt_dir)
    done = disk.write_checkpoint(ckpt_dir, meta, memoryview(buf.numpy()))
    disk.prune(ckpt_dir, int(meta["rank"]), keep, newest=int(meta["step"]), world=int(meta["world_size"]))
    return done


@dataclass
class Reporter:
    """Counts failed saves: the first of a kind, and every REPORT_EVERY-th in a row after it, are
    reported; a save without trouble ends the run (the next failure is reported again)."""

    total: int = 0
    run: int = 0
    key: tuple[str, str] | None = None

    def failed(self, kind: str, fallback: str) -> bool:
        """Count one failed save; True when this one is to be reported."""
        self.total += 1
        if self.key != (kind, fallback):
            self.key, self.run = (kind, fallback), 0
        self.run += 1
        return (self.run - 1) % REPORT_EVERY == 0

    def ok(self) -> None:
        self.key, self.run = None, 0
