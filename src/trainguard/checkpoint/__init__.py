"""Fast checkpoints: ``save`` snapshots into shared memory and returns; the agent persists in the
background; ``load_latest`` resumes from the newest state that verifies.

    from trainguard import checkpoint as ckpt

    state = ckpt.load_latest()                 # None when there is nothing to resume from
    if state is not None:
        model.load_state_dict(state["model"]); opt.load_state_dict(state["optim"])
    ...
    ckpt.save({"model": model.state_dict(), "optim": opt.state_dict(), "step": step}, step)

Every rank saves its own state (rank-scoped). States are nested dicts / lists / tuples of tensors
(CPU or CUDA) and plain values (str, int, float, bool, None); nothing is pickled, on disk the
structure is JSON and tensors are raw bytes with CRC32 checksums.

Sharded states (``torch.distributed.checkpoint``): pass the sharded state dict as it comes from
``torch.distributed.checkpoint.state_dict.get_state_dict(model, optim)`` (DTensor values, e.g.
FSDP2). Each rank stores its local shards plus their placements and global offsets (DCP's chunk
metadata); ``load_latest(mesh=mesh)`` rebuilds DTensors on the device mesh, ready for
``set_state_dict`` — on another world size too: torch.distributed.checkpoint reshards them from
every old rank's file on disk. ``export_dcp`` writes a step as a torch.distributed.checkpoint
directory.

After a world-size change (an elastic job that lost a node), replicated state (DDP) resumes from
any old rank's copy; sharded state that cannot be resharded (an old rank's file missing, no mesh
given) raises ``IncompatibleCheckpoint`` when no older step can be loaded: never a silently wrong
state, never a silent fresh start.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Any

from trainguard.checkpoint.client import Checkpointer, check_step
from trainguard.checkpoint.format import FormatError
from trainguard.checkpoint.reshard import IncompatibleCheckpoint

__all__ = ["Checkpointer", "FormatError", "IncompatibleCheckpoint", "export_dcp", "load_latest", "save", "wait"]

log = logging.getLogger(__name__)
_default: Checkpointer | None = None
_unavailable = False  # reported once: the snapshots' shared memory could not be set up
_lock = threading.Lock()


def _checkpointer() -> Checkpointer:
    # Built on first use, not at import: pre-started workers get their environment late.
    global _default
    with _lock:
        if _default is None:
            _default = Checkpointer.from_env()
        return _default


def save(state: Any, step: int) -> bool:
    """Snapshot ``state`` (this rank's) at ``step`` into shared memory; persisted in the background.
    Returns True when the snapshot was taken, False when it was skipped or failed (an event says
    why; training can go on: a vanished or full shared memory is reported and worked around, see
    docs/checkpoints.md). Raises TypeError for values that cannot be stored without pickle and for a
    ``step`` that is not an integer (bool, float, NaN, str), ValueError for a negative one or one above
    ``client.MAX_STEP``; nothing is saved then, with or without shared memory."""
    global _unavailable
    step = check_step(step)  # a bad step is the caller's bug: refused even when snapshots are off
    if _unavailable:
        return False
    try:
        checkpointer = _checkpointer()
    except OSError as exc:  # no usable shared memory / checkpoint dir: training goes on without snapshots
        _unavailable = True
        log.warning("checkpoint: cannot take snapshots (%s); training goes on without them", exc)
        return False
    return checkpointer.save(state, step)


def load_latest(map_location: Any = None, mesh: Any = None) -> Any:
    """The newest valid state of this rank, or None. Call it after ``init_process_group``: all ranks
    then agree on the newest step they all have. The in-memory snapshot wins when it is at least as
    new as the disk; a partial or corrupt checkpoint on disk is skipped (event
    ``checkpoint_fallback``). ``mesh``: rebuild saved DTensors on this DeviceMesh (resharded when
    the world size changed). Raises IncompatibleCheckpoint when checkpoints exist but none can be
    loaded at this world size."""
    return _checkpointer().load_latest(map_location=map_location, mesh=mesh)


def wait() -> None:
    """Block until the last ``save`` is complete in memory (without an agent: also on disk)."""
    _checkpointer().wait()


def export_dcp(dest: str | Path, ckpt_dir: str | Path, step: int | None = None) -> int:
    """Write checkpoint ``step`` of ``ckpt_dir`` (default: the newest whose ranks all verify) to
    ``dest`` as a torch.distributed.checkpoint directory with full tensors, loadable at any world
    size by ``torch.distributed.checkpoint.load``. Runs in one process; returns the step."""
    from trainguard.checkpoint.reshard import export_dcp as _export

    return _export(Path(dest), Path(ckpt_dir), step)
