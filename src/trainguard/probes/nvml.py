"""NVIDIA GPUs through NVML (the `pynvml` module of the nvidia-ml-py package).

Everything here degrades cleanly: without the package, without the driver library, or on a
machine with no GPU, the functions return ``None`` (or empty health data) instead of raising.
Indices are NVML device indices (all GPUs of the machine, not renumbered by CUDA_VISIBLE_DEVICES).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

log = logging.getLogger(__name__)

try:  # nvidia-ml-py installs the module `pynvml`
    import pynvml as _nv
except ImportError:  # pragma: no cover - depends on the environment
    _nv = None

_lock = threading.Lock()
_state: dict[str, Any] = {"initialised": False, "error": None}


def _init() -> bool:
    """Initialise NVML once per process. False (with the reason kept) when it cannot be used."""
    if _nv is None:
        _state["error"] = "the nvidia-ml-py package (module pynvml) is not installed"
        return False
    with _lock:
        if _state["initialised"]:
            return True
        try:
            _nv.nvmlInit()
        except Exception as exc:  # NVMLError_LibraryNotFound / DriverNotLoaded / ...
            _state["error"] = f"NVML unavailable: {exc}"
            return False
        _state["initialised"] = True
        _state["error"] = None
        return True


def unavailable_reason() -> str | None:
    """Why NVML cannot be used, or None when it can."""
    return None if _init() else str(_state["error"])


def available() -> bool:
    return _init()


def device_count() -> int | None:
    if not _init():
        return None
    try:
        return int(_nv.nvmlDeviceGetCount())
    except Exception as exc:
        log.debug("nvmlDeviceGetCount failed: %s", exc)
        return None


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _optional(fn: Any, *args: Any) -> Any:
    """Call an NVML query that some GPUs do not support (consumer cards, MIG, vGPU): None then."""
    try:
        return fn(*args)
    except Exception as exc:
        log.debug("%s unsupported: %s", getattr(fn, "__name__", fn), exc)
        return None


@dataclass(frozen=True)
class GpuId:
    """How CUDA_VISIBLE_DEVICES may name a GPU: its NVML index, its UUID, its MIG instances' UUIDs."""

    index: int
    uuid: str = ""
    mig: tuple[str, ...] = ()


def _mig_uuids(handle: Any) -> tuple[str, ...]:
    """UUIDs of the MIG instances of a GPU (none when MIG is off or unsupported)."""
    max_count = getattr(_nv, "nvmlDeviceGetMaxMigDeviceCount", None)  # absent in old nvidia-ml-py
    count = _optional(max_count, handle) if max_count is not None else 0
    out = []
    for i in range(int(count or 0)):
        mig = _optional(_nv.nvmlDeviceGetMigDeviceHandleByIndex, handle, i)  # empty slots raise
        uuid = _optional(_nv.nvmlDeviceGetUUID, mig) if mig is not None else None
        if uuid:
            out.append(_text(uuid))
    return tuple(out)


def gpu_ids() -> list[GpuId] | None:
    """Index and UUIDs of every GPU of this machine. None when NVML is unavailable."""
    count = device_count()
    if count is None:
        return None
    out = []
    for i in range(count):
        handle = _optional(_nv.nvmlDeviceGetHandleByIndex, i)
        if handle is None:
            out.append(GpuId(i))
            continue
        out.append(GpuId(i, _text(_optional(_nv.nvmlDeviceGetUUID, handle) or ""), _mig_uuids(handle)))
    return out


def _resolve(token: str, gpus: Sequence[GpuId]) -> int | None:
    if token.isdigit():
        index = int(token)
        return index if any(g.index == index for g in gpus) else None
    if token.startswith("MIG-GPU-"):  # the pre-R470 form: MIG-GPU-<gpu uuid>/<gi>/<ci>
        token = token[len("MIG-"):].split("/", 1)[0]
    if token.startswith("MIG-"):
        hits = {g.index for g in gpus for m in g.mig if m.startswith(token)}
    else:
        hits = {g.index for g in gpus if g.uuid and g.uuid.startswith(token)}
    return hits.pop() if len(hits) == 1 else None  # a prefix must name one device


def visible_indices(spec: str | None, gpus: Sequence[GpuId]) -> list[int]:
    """NVML indices of the GPUs a process sees under ``CUDA_VISIBLE_DEVICES=spec``, in CUDA's order.

    ``spec`` None: every GPU. Entries are indices, GPU UUIDs (``GPU-...``) or MIG instance UUIDs
    (``MIG-...``, also the older ``MIG-GPU-<uuid>/<gi>/<ci>``), each possibly a unique prefix, and
    are matched against the UUIDs NVML reports. Like CUDA, the list ends at the first entry that
    names no device. A MIG instance counts as its GPU (health and utilisation are per GPU)."""
    if spec is None:
        return [g.index for g in gpus]
    out: list[int] = []
    for token in (t.strip() for t in spec.split(",")):
        index = _resolve(token, gpus) if token else None
        if index is None:
            break
        out.append(index)
    return out


@dataclass
class GpuHealth:
    index: int
    name: str = ""
    uuid: str = ""
    mig: tuple[str, ...] = ()  # UUIDs of its MIG instances
    ecc_uncorrected_volatile: int | None = None  # uncorrectable ECC errors since the driver loaded
    retired_pages_dbe: int | None = None  # pages retired for double-bit ECC errors (pre-Ampere)
    retired_pages_pending: bool | None = None  # a retirement waits for a GPU reset
    remap_pending: bool | None = None  # row remapping (Ampere+) waits for a GPU reset
    remap_failed: bool | None = None  # row remapping failed: the GPU must be replaced
    error: str | None = None  # the handle itself could not be read
    faults: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def id(self) -> GpuId:
        return GpuId(self.index, self.uuid, tuple(self.mig))


def _health_of(index: int) -> GpuHealth:
    h = GpuHealth(index=index)
    try:
        handle = _nv.nvmlDeviceGetHandleByIndex(index)
    except Exception as exc:  # a GPU that fell off the bus shows up here (NVML_ERROR_GPU_IS_LOST)
        h.error = str(exc)
        h.faults.append(f"GPU {index} cannot be read through NVML: {exc}")
        return h
    h.name = _text(_optional(_nv.nvmlDeviceGetName, handle) or "")
    h.uuid = _text(_optional(_nv.nvmlDeviceGetUUID, handle) or "")
    h.mig = _mig_uuids(handle)
    h.ecc_uncorrected_volatile = _optional(
        _nv.nvmlDeviceGetTotalEccErrors, handle, _nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, _nv.NVML_VOLATILE_ECC
    )
    pages = _optional(
        _nv.nvmlDeviceGetRetiredPages, handle, _nv.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR
    )
    h.retired_pages_dbe = None if pages is None else len(pages)
    pending = _optional(_nv.nvmlDeviceGetRetiredPagesPendingStatus, handle)
    h.retired_pages_pending = None if pending is None else bool(pending)
    rows = _optional(_nv.nvmlDeviceGetRemappedRows, handle)
    if rows is not None:
        _corr, _unc, is_pending, failure = rows
        h.remap_pending, h.remap_failed = bool(is_pending), bool(failure)
    if h.ecc_uncorrected_volatile:
        h.faults.append(
            f"GPU {index}: {h.ecc_uncorrected_volatile} uncorrectable ECC error(s) since driver load"
        )
    if h.retired_pages_pending:
        h.faults.append(f"GPU {index}: page retirement pending (reset the GPU)")
    if h.remap_pending:
        h.faults.append(f"GPU {index}: row remapping pending (reset the GPU)")
    if h.remap_failed:
        h.faults.append(f"GPU {index}: row remapping failed (the GPU needs replacing)")
    return h


def health(indices: list[int] | None = None) -> list[GpuHealth] | None:
    """Per-GPU health (ECC, retired pages, row remapping). None when NVML is unavailable."""
    count = device_count()
    if count is None:
        return None
    wanted = range(count) if indices is None else indices
    return [_health_of(i) for i in wanted]


def utilization(indices: list[int]) -> list[float] | None:
    """GPU utilisation in percent (0-100) over NVML's last sample period, one value per index.

    None when NVML is unavailable or any of the GPUs cannot be read (callers then treat
    utilisation as unknown rather than as 0 %)."""
    if not _init():
        return None
    out: list[float] = []
    try:
        for i in indices:
            rates = _nv.nvmlDeviceGetUtilizationRates(_nv.nvmlDeviceGetHandleByIndex(i))
            out.append(float(rates.gpu))
    except Exception as exc:
        log.debug("utilization(%s) failed: %s", indices, exc)
        return None
    return out


def driver_version() -> str | None:
    if not _init():
        return None
    return _optional(lambda: _text(_nv.nvmlSystemGetDriverVersion()))
