"""The snapshot format: a nested state as a JSON tree plus raw tensor bytes. No pickle anywhere.

``flatten(state)`` turns a nested structure of dicts / lists / tuples / str / int / float / bool /
None / torch.dtype / torch.device / tensors into a JSON-able tree whose tensor leaves point into a
table; ``plan_layout`` places the tensors' bytes in one buffer (64-byte aligned so any dtype can be
viewed in place); ``unflatten`` rebuilds the state from a decoded manifest and a byte buffer,
checking every offset, size and dtype first because the manifest may come from a file on disk.

Tree nodes: scalars are stored as themselves; containers are one-key objects:
``{"D": [[key, value], ...]}`` (dict; int keys as ``{"i": k}``), ``{"L": [...]}``, ``{"U": [...]}``
(tuple), ``{"T": index}`` (tensor), ``{"DT": index, ...}`` (DTensor: the rank's local shard and its
placement), ``{"dtype": "float32"}``, ``{"device": "cuda:0"}``.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from typing import Any

import torch

FORMAT = "trainguard-ckpt/1"
ALIGN = 64
MAX_DEPTH = 64


class FormatError(ValueError):
    """A manifest or buffer that does not describe a valid snapshot."""


@dataclass(frozen=True)
class TensorEntry:
    dtype: str  # torch dtype name without the "torch." prefix
    shape: tuple[int, ...]
    offset: int  # byte offset in the data buffer
    nbytes: int
    device: str  # where the tensor lived when saved (informational)

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["shape"] = list(self.shape)
        return d


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
    try:
        meta = json.loads(raw)
    except (UnicodeDecodeError, ValueError) as exc:
        raise FormatError(f"manifest is not valid JSON: {exc}") from None
    except (RecursionError, MemoryError) as exc:  # a crafted file (arrays nested 100,000 deep): corrupt, not a crash
        raise FormatError(f"manifest cannot be decoded: {type(exc).__name__}") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise FormatError("not a trainguard checkpoint manifest")
    for key in ("tree", "tensors", "step"):
        if key not in meta:
            raise FormatError(f"manifest lacks {key!r}")
    if not isinstance(meta["step"], int) or not isinstance(meta["tensors"], list):
        raise FormatError("manifest has a bad step or tensor table")
    return meta


def parse_entries(raw: list[Any], data_len: int) -> list[TensorEntry]:
    """Validate a tensor table against the size of the data buffer it points into."""
    entries = []
    for i, e in enumerate(raw):
        try:
            dtype = parse_dtype(e["dtype"])
            shape = tuple(int(s) for s in e["shape"])
            offset, nbytes = int(e["offset"]), int(e["nbytes"])
        except (KeyError, TypeError, ValueError) as exc:
            raise FormatError(f"tensor {i}: bad entry ({exc})") from None
        itemsize = torch.empty((), dtype=dtype).element_size()
        # Strides are products of the dims (zeros counted as 1): they must fit in int64 even when
        # the tensor is empty, or torch fails building the view ("Stride calculation overflowed").
        if math.prod(max(s, 1) for s in shape) * itemsize >= 1 << 63:
            raise FormatError(f"tensor {i}: shape {shape} is too large")
        if any(s < 0 for s in shape) or nbytes != math.prod(shape) * itemsize:
            raise FormatError(f"tensor {i}: shape {shape} does not match {nbytes} bytes")
        if offset < 0 or offset % ALIGN or offset + nbytes > data_len:
            raise FormatError(f"tensor {i}: bytes [{offset}, {offset + nbytes}) outside the data ({data_len})")
        entries.append(TensorEntry(dtype_name(dtype), shape, offset, nbytes, str(e.get("device", "cpu"))))
    return entries


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
            for item in node["D"]:
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


def _dtensor(local: torch.Tensor, node: dict[str, Any], mesh: Any) -> Any:
    if mesh is None:
        return local
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

    placements = []
    for p in node.get("placements", []):
        if "shard" in p:
            placements.append(Shard(int(p["shard"])))
        elif "replicate" in p:
            placements.append(Replicate())
        elif "partial" in p:
            placements.append(Partial(str(p["partial"])))
        else:
            raise FormatError(f"bad placement {p!r}")
    if list(mesh.shape) != list(node.get("mesh_shape", [])):
        raise FormatError(f"DTensor saved on a mesh of shape {node.get('mesh_shape')}, loading on {list(mesh.shape)}")
    local = local.to(mesh.device_type)
    return DTensor.from_local(local, mesh, placements, run_check=False,
                              shape=torch.Size(node["shape"]), stride=tuple(node["stride"]))
