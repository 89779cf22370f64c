"""The snapshot format: a nested state as a JSON tree plus raw tensor bytes. No pickle anywhere.

``flatten(state)`` turns a nested structure of dicts / lists / tuples / str / int / float / bool /
None / torch.dtype / torch.device / tensors into a JSON-able tree whose tensor leaves point into a
table; ``plan_layout`` places the tensors' bytes in one buffer (64-byte aligned so any dtype can be
viewed in place); ``unflatten`` rebuilds the state from a decoded manifest and a byte buffer,
checking every offset, size and dtype first because the manifest may come from a file on disk.

Tree nodes: scalars are stored as themselves; containers are one-key objects:
``{"D": [[key, value], ...]}`` (dict; int keys as ``{"i": k}``), ``{"L": [...]}``, ``{"U": [...]}``
(tuple), ``{"T": index}`` (tensor), ``{"DT": index, ...}`` (DTensor: the rank's local shard, its
placements and, as in torch.distributed.checkpoint's metadata, the global offsets of the shard, so
that a sharded state can be resharded onto another world size), ``{"dtype": "float32"}``,
``{"device": "cuda:0"}``.

On disk the manifest is sealed: the JSON text, then a line with the CRC32 of that text
(``seal_manifest`` / ``open_manifest``), so an edited learning rate, step, shape or dtype is refused
like a flipped bit in the tensor data (whose checksum the manifest carries). Everything read from a
file is bounded: the manifest's size, the nesting depth, the sizes of the tensors it describes.
"""

from __future__ import annotations

import json
import math
import re
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

FORMAT = "trainguard-ckpt/2"
OLD_FORMATS = ("trainguard-ckpt/1",)  # no manifest checksum: refused, with a message that says so
ALIGN = 64
MAX_DEPTH = 64
# A manifest is structure, not data: 256 MiB is ~1M tensors. Bigger is a crafted or broken file.
MAX_MANIFEST_BYTES = 256 << 20
_SEAL = b"\ntrainguard-manifest-crc32="
_SEAL_TAIL = re.compile(rb"[0-9a-f]{8}\n")


class FormatError(ValueError):
    """A manifest or buffer that does not describe a valid snapshot."""


class ChecksumUnavailable(FormatError):
    """The manifest names a checksum this installation cannot compute: the checkpoint may be fine."""


def _crc32c() -> Callable[[Any, int], int] | None:
    try:
        import crc32c  # hardware CRC32C (SSE4.2 / ARMv8), several times faster than zlib's CRC32
    except ImportError:
        return None
    return lambda data, value: crc32c.crc32c(data, value)


_CHECKSUMS: dict[str, Callable[[Any, int], int]] = {"crc32": lambda data, value: zlib.crc32(data, value)}
if (_fast := _crc32c()) is not None:
    _CHECKSUMS["crc32c"] = _fast
# What new checkpoints use: the fastest one available here. The manifest names it.
DEFAULT_CHECKSUM = "crc32c" if "crc32c" in _CHECKSUMS else "crc32"


def checksum_fn(name: Any) -> Callable[[Any, int], int]:
    """``fn(bytes_like, running_value) -> value`` for the algorithm a manifest names."""
    fn = _CHECKSUMS.get(name) if isinstance(name, str) else None
    if fn is None and name == "crc32c":
        raise ChecksumUnavailable("the checkpoint is checksummed with CRC32C: install the crc32c package to read it")
    if fn is None:
        raise FormatError(f"unknown checksum algorithm {str(name)[:40]!r}")
    return fn


@dataclass(frozen=True)
class TensorEntry:
    dtype: str  # torch dtype name without the "torch." prefix
    shape: tuple[int, ...]
    offset: int  # byte offset in the data buffer
    nbytes: int
    device: str  # where the tensor lived when saved (informational)

    def to_json(self) -> dict[str, Any]:
        # By hand, not dataclasses.asdict (which deep-copies): this runs on the training thread.
        return {"dtype": self.dtype, "shape": list(self.shape), "offset": self.offset, "nbytes": self.nbytes,
                "device": self.device}


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def parse_dtype(name: Any) -> torch.dtype:
    # getattr on the torch module with a name from an untrusted file: accept dtypes only.
    if not isinstance(name, str) or not name.isidentifier():
        raise FormatError(f"bad dtype {name!r}")
    value = getattr(torch, name, None)
    if not isinstance(value, torch.dtype):
        raise FormatError(f"bad dtype {name!r}")
    return value


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def _dtensor_type() -> type | None:
    try:
        from torch.distributed.tensor import DTensor
    except Exception:  # torch built without distributed
        return None
    return DTensor


def _placement_json(p: Any) -> dict[str, Any]:
    name = type(p).__name__
    if name == "Shard":
        return {"shard": int(p.dim)}
    if name == "Replicate":
        return {"replicate": True}
    if name == "Partial":
        return {"partial": str(getattr(p, "reduce_op", "sum"))}
    raise TypeError(f"unsupported DTensor placement {p!r}")


def flatten(state: Any) -> tuple[Any, list[torch.Tensor]]:
    """Return (tree, tensors). Raises TypeError on values the format cannot hold."""
    tensors: list[torch.Tensor] = []
    dtensor = _dtensor_type()

    def tensor_leaf(t: torch.Tensor, path: str) -> int:
        if t.is_sparse or t.is_quantized or t.is_nested or t.device.type == "meta" or t.layout != torch.strided:
            raise TypeError(f"checkpoint: tensor at {path} has an unsupported layout/device ({t.layout}, {t.device})")
        tensors.append(t.detach())
        return len(tensors) - 1

    def walk(v: Any, path: str, depth: int) -> Any:
        if depth > MAX_DEPTH:
            raise TypeError(f"checkpoint: state nested deeper than {MAX_DEPTH} at {path}")
        if v is None or isinstance(v, bool | str):
            return v
        if isinstance(v, int):
            return int(v)
        if isinstance(v, float):
            return float(v)
        if dtensor is not None and isinstance(v, dtensor):
            mesh = v.device_mesh
            return {
                "DT": tensor_leaf(v.to_local(), path),
                "placements": [_placement_json(p) for p in v.placements],
                "shape": list(v.shape),
                "stride": list(v.stride()),
                "offsets": _global_offsets(v),
                "mesh_shape": list(mesh.shape),
                "mesh_dims": list(mesh.mesh_dim_names or []),
            }
        if isinstance(v, torch.Tensor):
            return {"T": tensor_leaf(v, path)}
        if isinstance(v, torch.dtype):
            return {"dtype": dtype_name(v)}
        if isinstance(v, torch.device):
            return {"device": str(v)}
        if isinstance(v, dict):
            items = []
            for k, x in v.items():
                if isinstance(k, bool) or not isinstance(k, str | int):
                    raise TypeError(f"checkpoint: dict key {k!r} at {path} is not a str or int")
                items.append([k if isinstance(k, str) else {"i": int(k)}, walk(x, f"{path}.{k}", depth + 1)])
            return {"D": items}
        if isinstance(v, list | tuple):
            key = "U" if isinstance(v, tuple) else "L"
            return {key: [walk(x, f"{path}[{i}]", depth + 1) for i, x in enumerate(v)]}
        raise TypeError(f"checkpoint: cannot store {type(v).__name__} at {path} (no pickle: use tensors, "
                        "dicts, lists, tuples, str, int, float, bool, None)")

    return walk(state, "state", 0), tensors


def _global_offsets(dt: Any) -> list[int]:
    """Where this rank's local shard starts in the global tensor (torch.distributed.checkpoint's
    chunk metadata for the shard)."""
    chunks = dt.__create_chunk_list__()
    return [int(o) for o in chunks[0].offsets] if chunks else [0] * dt.dim()


def is_sharded(tree: Any) -> bool:
    """True when the tree holds DTensor shards (its tensors differ from rank to rank)."""
    stack = [(tree, 0)]
    while stack:
        node, depth = stack.pop()
        if depth > MAX_DEPTH or not isinstance(node, dict):
            continue
        if "DT" in node:
            return True
        for key in ("L", "U"):
            if isinstance(node.get(key), list):
                stack.extend((x, depth + 1) for x in node[key])
        if isinstance(node.get("D"), list):
            stack.extend((item[1], depth + 1) for item in node["D"] if isinstance(item, list) and len(item) == 2)
    return False


def plan_layout(tensors: list[torch.Tensor]) -> tuple[list[TensorEntry], int]:
    """Byte layout of the tensors in one buffer; returns (entries, total bytes)."""
    entries = []
    off = 0
    for t in tensors:
        nbytes = t.numel() * t.element_size()
        entries.append(TensorEntry(dtype_name(t.dtype), tuple(t.shape), off, nbytes, str(t.device)))
        off = _align(off + nbytes)
    return entries, off


def encode_manifest(meta: dict[str, Any]) -> bytes:
    return json.dumps(meta, separators=(",", ":")).encode()


def decode_manifest(raw: bytes) -> dict[str, Any]:
    if len(raw) > MAX_MANIFEST_BYTES:
        raise FormatError(f"manifest of {len(raw)} bytes is larger than the {MAX_MANIFEST_BYTES >> 20} MiB limit")
    try:
        meta = json.loads(raw)
    except (UnicodeDecodeError, ValueError) as exc:
        raise FormatError(f"manifest is not valid JSON: {str(exc)[:200]}") from None
    except (RecursionError, MemoryError):  # crafted nesting: refused, never a traceback
        raise FormatError("manifest is nested too deeply or too large to parse") from None
    if isinstance(meta, dict) and meta.get("format") in OLD_FORMATS:
        raise FormatError(f"checkpoint format {meta['format']} was written by an older trainguard "
                          f"(its manifest has no checksum); this version reads {FORMAT} only")
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise FormatError("not a trainguard checkpoint manifest")
    for key in ("tree", "tensors", "step"):
        if key not in meta:
            raise FormatError(f"manifest lacks {key!r}")
    if not isinstance(meta["step"], int) or not isinstance(meta["tensors"], list):
        raise FormatError("manifest has a bad step or tensor table")
    return meta


def seal_manifest(meta: dict[str, Any]) -> bytes:
    """The on-disk manifest: JSON, then a line with the CRC32 of the JSON bytes."""
    body = encode_manifest(meta)
    return body + _SEAL + b"%08x\n" % zlib.crc32(body)


def open_manifest(raw: bytes) -> dict[str, Any]:
    """Verify and decode a sealed manifest. Raises FormatError when it was modified or damaged."""
    if len(raw) > MAX_MANIFEST_BYTES + 64:
        raise FormatError(f"manifest of {len(raw)} bytes is larger than the {MAX_MANIFEST_BYTES >> 20} MiB limit")
    body, sep, tail = raw.rpartition(_SEAL)
    if not sep:
        decode_manifest(raw)  # an older format says so; anything else:
        raise FormatError("manifest has no checksum line")
    if not _SEAL_TAIL.fullmatch(tail):
        raise FormatError("manifest checksum line is damaged")
    want, got = int(tail[:8], 16), zlib.crc32(body)
    if want != got:
        raise FormatError(f"manifest checksum {got:08x} != {want:08x}: the manifest was modified or damaged")
    return decode_manifest(body)


def parse_entries(raw: list[Any], data_len: int) -> list[TensorEntry]:
    """Validate a tensor table against the size of the data buffer it points into."""
    entries = []
    if not isinstance(raw, list):
        raise FormatError("bad tensor table")
    for i, e in enumerate(raw):
        try:
            dtype = parse_dtype(e["dtype"])
            shape = tuple(_int(s) for s in e["shape"])
            offset, nbytes = _int(e["offset"]), _int(e["nbytes"])
        except (KeyError, TypeError, ValueError) as exc:
            raise FormatError(f"tensor {i}: bad entry ({str(exc)[:200]})") from None
        itemsize = dtype.itemsize
        # Strides are products of the dims (zeros counted as 1): they must fit in int64 even when
        # the tensor is empty, or torch fails building the view ("Stride calculation overflowed").
        if len(shape) <= MAX_DEPTH and math.prod(max(s, 1) for s in shape) * itemsize >= 1 << 63:
            raise FormatError(f"tensor {i}: shape {shape} is too large")
        if len(shape) > MAX_DEPTH or any(not 0 <= s < 1 << 62 for s in shape) or nbytes != math.prod(shape) * itemsize:
            raise FormatError(f"tensor {i}: shape {shape} does not match {nbytes} bytes")
        if offset < 0 or offset % ALIGN or offset + nbytes > data_len:
            raise FormatError(f"tensor {i}: bytes [{offset}, {offset + nbytes}) outside the data ({data_len})")
        entries.append(TensorEntry(dtype_name(dtype), shape, offset, nbytes, str(e.get("device", "cpu"))))
    return entries


def _int(v: Any) -> int:
    # JSON ints only: no floats (1e300), bools or digit strings sneaking through int().
    if isinstance(v, bool) or not isinstance(v, int):
        raise TypeError(f"expected an integer, got {str(v)[:40]!r}")
    return v


def tensor_view(buf: torch.Tensor, e: TensorEntry) -> torch.Tensor:
    """A view of entry ``e`` inside a flat uint8 buffer (no copy)."""
    dtype = parse_dtype(e.dtype)
    if e.nbytes == 0:
        return torch.empty(e.shape, dtype=dtype)
    return buf[e.offset : e.offset + e.nbytes].view(dtype).view(e.shape)


def unflatten(tree: Any, tensors: list[torch.Tensor], mesh: Any = None) -> Any:
    """Rebuild the state. DTensor leaves become DTensors on ``mesh`` when given, else local shards."""

    def leaf(idx: Any) -> torch.Tensor:
        if not isinstance(idx, int) or not 0 <= idx < len(tensors):
            raise FormatError(f"tensor index {idx!r} out of range")
        return tensors[idx]

    def walk(node: Any, depth: int) -> Any:
        if depth > MAX_DEPTH:
            raise FormatError("tree nested too deep")
        if node is None or isinstance(node, bool | int | float | str):
            return node
        if not isinstance(node, dict) or not node:
            raise FormatError(f"bad tree node {str(node)[:80]!r}")
        if "T" in node:
            return leaf(node["T"])
        if "DT" in node:
            return _dtensor(leaf(node["DT"]), node, mesh)
        if "D" in node:
            out = {}
            for item in _items(node["D"]):
                if not isinstance(item, list) or len(item) != 2:
                    raise FormatError("bad dict item")
                k = item[0]
                if isinstance(k, dict) and isinstance(k.get("i"), int):
                    k = k["i"]
                elif not isinstance(k, str):
                    raise FormatError(f"bad dict key {k!r}")
                out[k] = walk(item[1], depth + 1)
            return out
        if "L" in node:
            return [walk(x, depth + 1) for x in _items(node["L"])]
        if "U" in node:
            return tuple(walk(x, depth + 1) for x in _items(node["U"]))
        if "dtype" in node:
            return parse_dtype(node["dtype"])
        if "device" in node:
            try:
                return torch.device(str(node["device"]))
            except RuntimeError as exc:
                raise FormatError(str(exc)) from None
        raise FormatError(f"unknown tree node {list(node)[:3]}")

    return walk(tree, 0)


def _items(v: Any) -> list[Any]:
    if not isinstance(v, list):
        raise FormatError("bad list node")
    return v


@dataclass(frozen=True)
class ShardInfo:
    """A DTensor leaf's description, validated: global shape and stride, placements, the mesh it
    was saved on, and where the local shard starts in the global tensor."""

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    placements: tuple[tuple[str, Any], ...]  # ("shard", dim) | ("replicate", None) | ("partial", op)
    mesh_shape: tuple[int, ...]
    offsets: tuple[int, ...] | None  # None: saved by a version that did not record it


def _ints(v: Any, what: str, limit: int = MAX_DEPTH) -> tuple[int, ...]:
    if not isinstance(v, list) or len(v) > limit:
        raise FormatError(f"bad DTensor {what} {str(v)[:80]!r}")
    try:
        out = tuple(_int(x) for x in v)
    except TypeError as exc:
        raise FormatError(f"bad DTensor {what}: {exc}") from None
    if any(not 0 <= x < 1 << 62 for x in out):
        raise FormatError(f"bad DTensor {what} {out}")
    return out


def shard_info(node: dict[str, Any]) -> ShardInfo:
    placements = []
    raw = node.get("placements")
    if not isinstance(raw, list) or len(raw) > MAX_DEPTH:
        raise FormatError("bad DTensor placements")
    for p in raw:
        if isinstance(p, dict) and isinstance(p.get("shard"), int) and not isinstance(p["shard"], bool):
            placements.append(("shard", p["shard"]))
        elif isinstance(p, dict) and p.get("replicate") is True:
            placements.append(("replicate", None))
        elif isinstance(p, dict) and isinstance(p.get("partial"), str):
            placements.append(("partial", p["partial"][:32]))
        else:
            raise FormatError(f"bad placement {str(p)[:80]!r}")
    shape = _ints(node.get("shape"), "shape")
    stride = _ints(node.get("stride"), "stride")
    offsets = _ints(node["offsets"], "offsets") if "offsets" in node else None
    if len(stride) != len(shape) or (offsets is not None and len(offsets) != len(shape)):
        raise FormatError("DTensor shape, stride and offsets disagree")
    if any(d >= len(shape) for kind, d in placements if kind == "shard"):
        raise FormatError("DTensor shard dimension out of range")
    return ShardInfo(shape, stride, tuple(placements), _ints(node.get("mesh_shape"), "mesh shape"), offsets)


def placements_of(info: ShardInfo) -> list[Any]:
    from torch.distributed.tensor import Partial, Replicate, Shard

    out = []
    for kind, arg in info.placements:
        if kind == "shard":
            out.append(Shard(arg))
        elif kind == "replicate":
            out.append(Replicate())
        else:
            out.append(Partial(arg))
    return out


def _dtensor(local: torch.Tensor, node: dict[str, Any], mesh: Any) -> Any:
    if mesh is None:
        return local
    from torch.distributed.tensor import DTensor

    info = shard_info(node)
    if tuple(mesh.shape) != info.mesh_shape:
        raise FormatError(f"DTensor saved on a mesh of shape {list(info.mesh_shape)}, loading on {list(mesh.shape)}")
    try:
        return DTensor.from_local(local.to(mesh.device_type), mesh, placements_of(info), run_check=False,
                                  shape=torch.Size(info.shape), stride=info.stride)
    except (RuntimeError, ValueError, TypeError) as exc:
        raise FormatError(f"cannot rebuild a DTensor from the manifest: {str(exc)[:200]}") from None
