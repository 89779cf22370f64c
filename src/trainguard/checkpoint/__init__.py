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
FSDP2). Each rank stores its local shards plus their placements; ``load_latest(mesh=mesh)``
rebuilds DTensors on the same device mesh, ready for ``set_state_dict``. Resuming on a different
world layout (resharding) is what ``torch.distributed.checkpoint.save/load`` are for: use them
for long-term checkpoints and trainguard for the fast, frequent ones.
"""

from __future__ import annotations

import threading
from typing import Any

from trainguard.checkpoint.client import Checkpointer
from trainguard.checkpoint.format import FormatError

__all__ = ["Checkpointer", "FormatError", "load_latest", "save", "wait"]

_default: Checkpointer | None = None
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
    why; training can go on). Raises TypeError for values that cannot be stored without pickle."""
    return _checkpointer().save(state, step)


def load_latest(map_location: Any = None, mesh: Any = None) -> Any:
    """The newest valid state of this rank, or None. Call it after ``init_process_group``: all ranks
    then agree on the newest step they all have. The in-memory snapshot wins when it is at least as
    new as the disk; a partial or corrupt checkpoint on disk is skipped (event
    ``checkpoint_fallback``). ``mesh``: rebuild saved DTensors on this DeviceMesh."""
    return _checkpointer().load_latest(map_location=map_location, mesh=mesh)


def wait() -> None:
    """Block until the last ``save`` is complete in memory (without an agent: also on disk)."""
    _checkpointer().wait()
