"""Resharding a sharded (DTensor) checkpoint onto another world size, with torch.distributed.checkpoint.

Every rank's manifest records, for each DTensor shard it holds, the global shape, the placements
and the global offsets of the shard: the chunk metadata torch.distributed.checkpoint (DCP) keeps.
``SnapshotReader`` is a DCP ``StorageReader`` (DCP's documented extension point) that presents one
step of trainguard checkpoints as a DCP checkpoint: DCP's own load planner works out which pieces
of which old shards each new rank needs, and the reader copies them out of the verified files. No
pickle is involved (DCP's own file format keeps its metadata as a pickle; this does not use it).

``export_dcp`` writes a step as a real DCP directory (``torch.distributed.checkpoint.save``), for
tools that read DCP checkpoints, loadable at any world size with ``torch.distributed.checkpoint.load``.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from trainguard.checkpoint import disk
from trainguard.checkpoint.format import (
    MAX_DEPTH,
    FormatError,
    ShardInfo,
    TensorEntry,
    parse_dtype,
    parse_entries,
    placements_of,
    shard_info,
    tensor_view,
    unflatten,
)


class IncompatibleCheckpoint(FormatError):
    """A checkpoint that is intact but cannot be loaded here (e.g. sharded state saved at another
    world size whose shards are not all on disk, or no device mesh to rebuild it on)."""


@dataclass(frozen=True)
class Shard:
    path: str  # where the DTensor sits in the state ("state.model.w")
    index: int  # its tensor's index in the manifest's table
    info: ShardInfo
    entry: TensorEntry  # the local shard's bytes in that rank's data file


def shards(meta: dict[str, Any]) -> list[Shard]:
    """The DTensor leaves of one rank's manifest, validated."""
    entries = parse_entries(meta["tensors"], 1 << 62)
    out: list[Shard] = []
    stack: list[tuple[Any, str, int]] = [(meta["tree"], "state", 0)]
    while stack:
        node, path, depth = stack.pop()
        if depth > MAX_DEPTH or not isinstance(node, dict):
            continue
        if "DT" in node:
            idx = node["DT"]
            if not isinstance(idx, int) or not 0 <= idx < len(entries):
                raise FormatError(f"tensor index {idx!r} out of range")
            out.append(Shard(path, idx, shard_info(node), entries[idx]))
        for key in ("L", "U"):
            if isinstance(node.get(key), list):
                stack.extend((x, f"{path}[{i}]", depth + 1) for i, x in enumerate(node[key]))
        if isinstance(node.get("D"), list):
            for item in node["D"]:
                if isinstance(item, list) and len(item) == 2:
                    k = item[0]["i"] if isinstance(item[0], dict) else item[0]
                    stack.append((item[1], f"{path}.{k}", depth + 1))
    return sorted(out, key=lambda s: s.path)


def why_not_reshardable(meta: dict[str, Any], present: list[int]) -> str | None:
    """None when the step whose rank manifest is ``meta`` can be resharded from the ranks whose
    files are ``present``; else the reason, in words."""
    world = meta.get("world_size")
    if not isinstance(world, int) or world < 1:
        return "the manifest does not say how many ranks saved it"
    missing = sorted(set(range(world)) - set(present))
    if missing:
        more = f" (+{len(missing) - 8} more)" if len(missing) > 8 else ""
        return (f"sharded state saved by {world} ranks, but the files of rank(s) {missing[:8]}{more} are "
                "not on disk (their in-memory snapshots went with their node)")
    for s in shards(meta):
        if s.info.offsets is None:
            return f"{s.path}: saved without shard offsets"
        if any(kind == "partial" for kind, _ in s.info.placements):
            return f"{s.path}: a Partial (unreduced) placement cannot be resharded"
    return None


class SnapshotReader:
    """A torch.distributed.checkpoint StorageReader over one step of trainguard checkpoints."""

    def __init__(self, ckpt_dir: Path, step: int, world: int) -> None:
        self.ckpt_dir = Path(ckpt_dir)
        self.step = step
        self.world = world
        self._where: dict[tuple[str, tuple[int, ...]], tuple[int, TensorEntry]] = {}
        self._data: dict[int, torch.Tensor] = {}

    # StorageReader protocol ------------------------------------------------------------------------
    def reset(self, checkpoint_id: Any = None) -> None:
        self._data.clear()

    def read_metadata(self, *args: Any) -> Any:
        from torch.distributed.checkpoint.metadata import (
            ChunkStorageMetadata,
            Metadata,
            TensorProperties,
            TensorStorageMetadata,
        )

        tables: dict[str, TensorStorageMetadata] = {}
        for rank in range(self.world):
            meta = disk.read_manifest(self.ckpt_dir, rank, self.step)
            if meta.get("world_size") != self.world:
                raise disk.CorruptCheckpoint(f"step {self.step} rank {rank} was saved by another world size")
            for s in shards(meta):
                offsets = s.info.offsets or ()
                key = (s.path, offsets)
                if key in self._where:
                    continue  # the same chunk on another rank (a replicated mesh dimension)
                self._where[key] = (rank, s.entry)
                dtype = parse_dtype(s.entry.dtype)
                md = tables.get(s.path)
                if md is None:
                    md = tables[s.path] = TensorStorageMetadata(TensorProperties(dtype=dtype), torch.Size(s.info.shape), [])
                elif md.size != torch.Size(s.info.shape) or md.properties.dtype != dtype:
                    raise FormatError(f"{s.path}: ranks disagree on the global shape or dtype")
                md.chunks.append(ChunkStorageMetadata(torch.Size(offsets), torch.Size(s.entry.shape)))
        return Metadata(state_dict_metadata=dict(tables))

    def set_up_storage_reader(self, metadata: Any, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        pass

    def prepare_local_plan(self, plan: Any) -> Any:
        return plan

    def prepare_global_plan(self, plans: list[Any]) -> list[Any]:
        return plans

    def read_data(self, plan: Any, planner: Any) -> Any:
        for item in plan.items:
            rank, entry = self._where[(item.storage_index.fqn, tuple(item.storage_index.offset or ()))]
            src = tensor_view(self._rank_data(rank), entry)
            for dim, (off, length) in enumerate(zip(item.storage_offsets, item.lengths, strict=True)):
                src = src.narrow(dim, off, length)
            dst = planner.resolve_tensor(item).detach()
            dst.copy_(src)
            planner.commit_tensor(item, dst)
        fut: torch.futures.Future[None] = torch.futures.Future()
        fut.set_result(None)
        return fut

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return False

    # ----------------------------------------------------------------------------------------------
    def _rank_data(self, rank: int) -> torch.Tensor:
        if rank not in self._data:
            self._data[rank] = disk.read_checkpoint(self.ckpt_dir, rank, self.step)[1]  # checksum verified
        return self._data[rank]


def _reader_class() -> type:
    # Subclass at first use: importing torch.distributed.checkpoint costs ~0.3 s, paid only here.
    from torch.distributed.checkpoint import StorageReader

    global _Reader
    if _Reader is None:
        _Reader = type("TrainguardSnapshotReader", (SnapshotReader, StorageReader), {})
    return _Reader


_Reader: type | None = None


def load_resharded(ckpt_dir: Path, step: int, world: int, ref_rank: int, mesh: Any,
                   map_location: Any = None, agree: Callable[[bool], bool] = lambda ok: ok) -> Any:
    """Load ``step`` (saved by ``world`` ranks) onto ``mesh``: DTensor leaves are rebuilt with their
    saved placements on the new mesh and filled by DCP from the old shards; every other value comes
    from rank ``ref_rank``'s copy. Collective when torch.distributed is initialized: ``agree(ok)``
    (true when every rank's is) settles whether all ranks are ready before DCP's collectives, so a
    rank that cannot even start never leaves the others waiting in them."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    error: Exception | None = None
    try:
        meta, tensors, targets, by_index = _prepare(ckpt_dir, step, ref_rank, mesh)
    except (disk.CorruptCheckpoint, FormatError) as exc:
        error = exc
    if not agree(error is None):
        raise error or disk.CorruptCheckpoint(f"step {step}: another rank cannot reshard it")
    no_dist = not (dist.is_available() and dist.is_initialized())
    dcp.load(targets, storage_reader=_reader_class()(ckpt_dir, step, world), no_dist=no_dist)
    if map_location is not None:
        tensors = [t.to(map_location) for t in tensors]
    tensors = [by_index.get(i, t) for i, t in enumerate(tensors)]
    return unflatten(_as_plain_dt(meta["tree"]), tensors)


def _prepare(ckpt_dir: Path, step: int, ref_rank: int, mesh: Any) -> tuple[dict[str, Any], list[Any],
                                                                          dict[str, Any], dict[int, Any]]:
    """The reference rank's manifest and tensors, and empty DTensors on ``mesh`` to load into."""
    from torch.distributed.tensor import empty as dtensor_empty

    meta, data = disk.read_checkpoint(ckpt_dir, ref_rank, step)
    entries = parse_entries(meta["tensors"], data.numel())
    tensors: list[Any] = [tensor_view(data, e) for e in entries]
    targets: dict[str, Any] = {}
    by_index: dict[int, Any] = {}
    for s in shards(meta):
        if len(s.info.placements) != mesh.ndim:
            raise IncompatibleCheckpoint(f"{s.path} was saved on a {len(s.info.mesh_shape)}-D device mesh; "
                                         f"the mesh given has {mesh.ndim} dimension(s)")
        try:
            target = dtensor_empty(*s.info.shape, dtype=parse_dtype(s.entry.dtype), device_mesh=mesh,
                                   placements=placements_of(s.info))
        except (RuntimeError, ValueError, TypeError) as exc:
            raise FormatError(f"{s.path}: cannot lay it out on the mesh: {str(exc)[:200]}") from None
        targets[s.path] = by_index[s.index] = target
    return meta, tensors, targets, by_index


def _as_plain_dt(tree: Any, depth: int = 0) -> Any:
    """The tree with DTensor leaves turned into plain tensor leaves (their tensors are already the
    resharded DTensors)."""
    if depth > 3 * MAX_DEPTH:
        raise FormatError("tree nested too deep")
    if isinstance(tree, dict):
        if "DT" in tree:
            return {"T": tree["DT"]}
        return {k: _as_plain_dt(v, depth + 1) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_as_plain_dt(x, depth + 1) for x in tree]
    return tree


def export_dcp(dest: Path, ckpt_dir: Path, step: int | None = None) -> int:
    """Write checkpoint ``step`` (default: the newest whose ranks all verify) of ``ckpt_dir`` to
    ``dest`` as a torch.distributed.checkpoint directory with full (unsharded) tensors, in this one
    process. Returns the step written. Raises IncompatibleCheckpoint when no step qualifies."""
    import torch.distributed.checkpoint as dcp

    problems: list[str] = []
    for s in [step] if step is not None else disk.all_steps(ckpt_dir):
        try:
            meta0 = disk.read_manifest(ckpt_dir, 0, s)
            why = why_not_reshardable(meta0, disk.ranks_at(ckpt_dir, s))
            if why is not None:
                raise IncompatibleCheckpoint(why)
            state = _full_state(ckpt_dir, s, meta0)
        except (disk.CorruptCheckpoint, FormatError) as exc:
            problems.append(f"step {s}: {exc}")
            continue
        disk.make_private_dir(dest)
        # torch's writer takes no file mode: a 077 umask meanwhile keeps the weights owner-only
        # (process-wide, but an export runs alone in its process).
        old_umask = os.umask(0o077)
        try:
            with warnings.catch_warnings():  # "assuming the intent is to save in a single process": it is
                warnings.simplefilter("ignore", UserWarning)
                dcp.save(state, checkpoint_id=str(dest), no_dist=True)
        finally:
            os.umask(old_umask)
        return s
    raise IncompatibleCheckpoint("no checkpoint to export in " + str(ckpt_dir) + (": " + "; ".join(problems) if problems else ""))


def _full_state(ckpt_dir: Path, step: int, meta0: dict[str, Any]) -> Any:
    import torch.distributed.checkpoint as dcp

    world = meta0["world_size"]
    meta, data = disk.read_checkpoint(ckpt_dir, 0, step)
    entries = parse_entries(meta["tensors"], data.numel())
    tensors = [tensor_view(data, e) for e in entries]
    full: dict[str, torch.Tensor] = {}
    for s in shards(meta):
        full[s.path] = tensors[s.index] = torch.empty(s.info.shape, dtype=parse_dtype(s.entry.dtype))
    if full:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            dcp.load(full, storage_reader=_reader_class()(ckpt_dir, step, world), no_dist=True)
    return unflatten(_as_plain_dt(meta["tree"]), tensors)
