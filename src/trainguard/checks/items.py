"""Pre-flight check items of one node (seed: ModelArts fault-tolerance check).

Item names and default thresholds are the seed's: ``dns``, ``disk-size root`` (> 32 GB),
``disk-size shm`` (> 1 GB), ``disk-size cache`` (> 32 GB), ``ulimit`` (when an InfiniBand device is
present: max locked memory > 16000 KB, open files > 1000000, stack size > 8000 KB, max user
processes > 1000000) and ``gpu-check``; plus ``nccl-env``, ``master-port`` and ``cuda-toolkit``.
Each item returns an ``ItemResult``; its ``line()`` carries the keyword ``item`` like the seed's
logs (``item dns ... ok (...)``) so users can grep for it. Disk sizes are the space available to
the job (free space), since that is what a checkpoint or cache write needs.
"""

from __future__ import annotations

import argparse
import glob
import ipaddress
import os
import re
import resource
import shutil
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from trainguard import runfiles
from trainguard.checks import kernel_log
from trainguard.evidence import HardwareReport
from trainguard.probes import nvml

OK, FAILED, WARNING, SKIPPED = "ok", "failed", "warning", "skipped"
GB = 1e9


@dataclass
class ItemResult:
    item: str  # seed item name, e.g. "dns", "disk-size root"
    status: str  # ok | failed | warning | skipped
    detail: str
    fix: str = ""  # what to do (on failed / warning)
    data: dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0

    @property
    def failed(self) -> bool:
        return self.status == FAILED

    def line(self) -> str:
        text = f"item {self.item} ... {self.status} ({self.detail})"
        if self.fix and self.status in (FAILED, WARNING):
            text += f"; what to do: {self.fix}"
        return text

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class CheckConfig:
    # dns: names in host files (Volcano writes one per job role under /etc/volcano) + endpoints
    hostfile_globs: list[str] = field(default_factory=lambda: ["/etc/volcano/*.host"])
    endpoints: list[str] = field(default_factory=list)  # "host" or "host:port" (rendezvous, master)
    dns_timeout_s: float = 3.0
    # disk-size (free space, GB = 1e9 bytes); the item fails when free <= threshold
    root_path: str = "/"
    root_min_gb: float = 32.0
    shm_path: str = "/dev/shm"
    shm_min_gb: float = 1.0
    cache_path: str = "/cache"
    cache_min_gb: float = 32.0
    # ulimit: "auto" (only with an InfiniBand device, as in the seed), "always", "never"
    ulimit_mode: str = "auto"
    ulimit_memlock_kb: int = 16000
    ulimit_nofile: int = 1_000_000
    ulimit_stack_kb: int = 8000
    ulimit_nproc: int = 1_000_000
    # gpu-check: "auto" (check GPUs when present), "require" (fail without them), "off"
    gpu_mode: str = "auto"
    nproc_per_node: int | None = None
    # why the job is known to use GPUs ("--nproc-per-node gpu"): then "auto" fails a node without them
    gpus_requested: str = ""
    xid_window_s: float = 24 * 3600.0
    # master-port: checked only when a port is given and the address is this machine
    master_addr: str | None = None
    master_port: int | None = None
    require_cuda_toolkit: bool = False
    skip: set[str] = field(default_factory=set)  # item names (or first words) to leave out
    ib_class_dir: str = "/sys/class/infiniband"


# ---------------------------------------------------------------------------------------- dns


HOSTFILE_LIMIT = 1 << 20  # bytes read of one host file
_HOSTNAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,252}")


class HostFileError(ValueError):
    """A host file that is not a text list of host names (binary, a FIFO, a device)."""


def hostfile_names(globs: list[str]) -> list[str]:
    """Host names listed in host files (one or more per line; IP literals and comments skipped).
    HostFileError for a file that is not a text list of host names."""
    names: list[str] = []
    for pattern in globs:
        for path in sorted(glob.glob(pattern)):
            try:
                with runfiles.open_read(path) as f:  # a FIFO or device there must not block the check
                    data = f.read(HOSTFILE_LIMIT)
            except runfiles.UnsafeFile as exc:
                raise HostFileError(str(exc)) from None
            except OSError:
                continue
            try:
                lines = data.decode("utf-8").splitlines()
            except UnicodeDecodeError:
                raise HostFileError(f"{path} is not a text host file") from None
            bad = [t for ln in lines for t in ln.split("#", 1)[0].split() if not _is_ip(t) and not _HOSTNAME.fullmatch(t)]
            if b"\0" in data or bad:
                raise HostFileError(f"{path} is not a host file: {bad[0][:40]!r} is no host name" if bad
                                    else f"{path} is not a text host file")
            for line in lines:
                for token in line.split("#", 1)[0].split():
                    if not _is_ip(token) and token not in names:
                        names.append(token)
    return names


def _is_ip(text: str) -> bool:
    try:
        ipaddress.ip_address(text.strip("[]"))
        return True
    except ValueError:
        return False


def endpoint_host(endpoint: str) -> str:
    endpoint = endpoint.strip()
    if endpoint.startswith("["):  # [v6]:port
        return endpoint[1 : endpoint.find("]")]
    if endpoint.count(":") == 1:
        return endpoint.split(":", 1)[0]
    return endpoint


def resolve_all(names: list[str], timeout_s: float) -> dict[str, str | None]:
    """name -> first address, or None (error or no answer within the timeout). getaddrinfo has no
    timeout of its own, so each lookup runs on a daemon thread and we stop waiting at the deadline."""
    results: dict[str, str | None] = dict.fromkeys(names)

    def lookup(name: str) -> None:
        try:
            results[name] = socket.getaddrinfo(name, None, proto=socket.IPPROTO_TCP)[0][4][0]
        except (OSError, UnicodeError):
            results[name] = None

    threads = [threading.Thread(target=lookup, args=(n,), daemon=True) for n in names]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout_s
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    return dict(results)


def check_dns(cfg: CheckConfig) -> ItemResult:
    try:
        names = hostfile_names(cfg.hostfile_globs)
    except HostFileError as exc:
        return ItemResult("dns", FAILED, str(exc), fix="give --hostfile the job's host files (one host name per line)")
    for ep in cfg.endpoints:
        host = endpoint_host(ep)
        if host and not _is_ip(host) and host not in names:
            names.append(host)
    if not names:
        return ItemResult("dns", SKIPPED, "no host file and no rendezvous/master host name to resolve")
    resolved = resolve_all(names, cfg.dns_timeout_s)
    bad = [n for n, addr in resolved.items() if addr is None]
    if bad:
        return ItemResult(
            "dns",
            FAILED,
            f"{len(bad)} of {len(names)} name(s) do not resolve: {', '.join(bad[:8])}",
            fix="check /etc/hosts and /etc/resolv.conf, the host file, and that the peer pods/hosts exist",
            data={"unresolved": bad, "resolved": {n: a for n, a in resolved.items() if a}},
        )
    return ItemResult("dns", OK, f"{len(names)} name(s) resolve", data={"resolved": resolved})


# ----------------------------------------------------------------------------------- disk-size


def free_bytes(path: str) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def _fmt_bytes(n: float) -> str:
    if n >= GB:
        return f"{n / GB:.1f} GB"
    return f"{n / 1e6:.1f} MB"


def check_disk(label: str, path: str, min_gb: float, flag: str, path_flag: str = "") -> ItemResult:
    """Fails when the free space at ``path`` is not above ``min_gb``. With ``path_flag`` the path is
    optional (skipped when absent, as /cache is on most machines)."""
    name = f"disk-size {label}"
    if not os.path.exists(path):
        if path_flag:
            return ItemResult(name, SKIPPED, f"{path} does not exist (set {path_flag} to check another path)")
        return ItemResult(
            name, FAILED, f"{path} does not exist", fix=f"mount {path} or point the check elsewhere"
        )
    if not os.path.isdir(path):  # statvfs of a file answers for its filesystem: not what was asked
        return ItemResult(name, FAILED, f"{path} is not a directory", fix=f"point {path_flag or flag} at a directory")
    try:
        free = free_bytes(path)
    except OSError as exc:
        return ItemResult(name, FAILED, f"cannot stat {path}: {exc}", fix=f"check the mount at {path}")
    data = {"path": path, "free_bytes": free, "min_gb": min_gb}
    need = f"need > {min_gb:g} GB"
    if free <= min_gb * GB:
        return ItemResult(
            name,
            FAILED,
            f"{_fmt_bytes(free)} free at {path}, {need}",
            fix=f"free space on {path} (old checkpoints, caches) or give the job a larger volume; threshold: {flag}",
            data=data,
        )
    return ItemResult(name, OK, f"{_fmt_bytes(free)} free at {path}, {need}", data=data)


# -------------------------------------------------------------------------------------- ulimit


def ib_devices(class_dir: str = "/sys/class/infiniband") -> list[str]:
    try:
        return sorted(os.listdir(class_dir))
    except OSError:
        return []


def _limit_value(res: int, unit: int) -> float:
    soft, _hard = resource.getrlimit(res)
    return float("inf") if soft == resource.RLIM_INFINITY else soft / unit


def check_ulimit(cfg: CheckConfig) -> ItemResult:
    devices = ib_devices(cfg.ib_class_dir)
    if cfg.ulimit_mode == "never" or (cfg.ulimit_mode == "auto" and not devices):
        return ItemResult("ulimit", SKIPPED, "no InfiniBand device (the seed checks ulimit only with IB)")
    # (label, ulimit flag, current value in ulimit's units, required minimum, exclusive)
    limits = [
        ("max locked memory", "-l", _limit_value(resource.RLIMIT_MEMLOCK, 1024), cfg.ulimit_memlock_kb),
        ("open files", "-n", _limit_value(resource.RLIMIT_NOFILE, 1), cfg.ulimit_nofile),
        ("stack size", "-s", _limit_value(resource.RLIMIT_STACK, 1024), cfg.ulimit_stack_kb),
        ("max user processes", "-u", _limit_value(resource.RLIMIT_NPROC, 1), cfg.ulimit_nproc),
    ]
    low = [(label, flag, cur, need) for label, flag, cur, need in limits if not cur > need]
    data = {label: ("unlimited" if cur == float("inf") else int(cur)) for label, _f, cur, _n in limits}
    if low:
        parts = [f"{label} {int(cur)} (need > {need})" for label, _f, cur, need in low]
        fixes = " ".join(
            f"ulimit {flag} {'unlimited' if flag == '-l' else need * 2};" for _l, flag, _c, need in low
        )
        return ItemResult(
            "ulimit",
            FAILED,
            "; ".join(parts),
            fix=f"raise the limits before launching ({fixes.strip()}) or in the container's ulimits / limits.conf",
            data=data,
        )
    return ItemResult("ulimit", OK, "memlock, nofile, stack and nproc limits are high enough", data=data)


# ----------------------------------------------------------------------------------- gpu-check


def visible_gpu_indices(all_health: list[nvml.GpuHealth], env: Mapping[str, str]) -> list[int]:
    """NVML indices of the GPUs that CUDA_VISIBLE_DEVICES lets the job see."""
    return nvml.visible_indices(env.get("CUDA_VISIBLE_DEVICES"), [h.id() for h in all_health])


def check_gpu(cfg: CheckConfig, env: Mapping[str, str]) -> ItemResult:
    if cfg.gpu_mode == "off":
        return ItemResult("gpu-check", SKIPPED, "switched off")
    required = cfg.gpu_mode == "require" or bool(cfg.gpus_requested)
    health = nvml.health()
    if not health:
        why = nvml.unavailable_reason() or "NVML reports 0 GPUs"
        if required:
            asked = cfg.gpus_requested or "--check-gpu require"
            return ItemResult(
                "gpu-check",
                FAILED,
                f"GPUs were requested ({asked}) but NVML sees none: {why}",
                fix="run nvidia-smi; check the driver, the container's GPU runtime (--gpus / device plugin)",
            )
        return ItemResult(
            "gpu-check", SKIPPED, f"no NVIDIA GPU on this node ({why}); GPUs were not requested"
        )
    visible = visible_gpu_indices(health, env)
    faults = [f for h in health if h.index in visible for f in h.faults]
    xids = kernel_log.read_xids(window_s=cfg.xid_window_s)
    hw_xids = [x for x in xids or [] if x.hardware]
    faults += [
        f"Xid {x.xid} ({kernel_log.HARDWARE_XIDS[x.xid]}) on {x.pci}"
        + (f" {x.age_s / 60:.0f} min ago" if x.age_s is not None else "")
        for x in hw_xids
    ]
    data = {
        "gpus": [h.to_dict() for h in health],
        "visible": visible,
        "xids": None if xids is None else [asdict(x) for x in xids],
        "driver": nvml.driver_version(),
    }
    want = cfg.nproc_per_node
    status, fix = OK, ""
    if want and len(visible) < want:
        faults.append(f"{len(visible)} GPU(s) visible but --nproc-per-node is {want}")
        fix = "check CUDA_VISIBLE_DEVICES and nvidia-smi for a missing GPU, or lower --nproc-per-node"
        status = FAILED if required else WARNING
    if any(not f.endswith(f"--nproc-per-node is {want}") for f in faults):
        status = FAILED
        fix = "take the node out of service and reset or replace the GPU (nvidia-smi -q -d ECC,PAGE_RETIREMENT,ROW_REMAPPER)"
    xid_note = "" if xids is not None else "; kernel log not readable, Xid errors not checked"
    if faults:
        return ItemResult("gpu-check", status, "; ".join(faults) + xid_note, fix=fix, data=data)
    return ItemResult(
        "gpu-check", OK, f"{len(visible)} GPU(s) visible, no ECC/retired-page/Xid faults{xid_note}", data=data
    )


# ---------------------------------------------------------------------------------------- rdma

PORT_ACTIVE, PORT_LINK_UP = "4: ACTIVE", "5: LinkUp"  # what sysfs shows for a port that carries traffic
SYSFS_READ_LIMIT = 256  # bytes of one sysfs attribute


def _sysfs_value(path: str) -> str:
    """One sysfs attribute, stripped; "unreadable: ..." when it cannot be read (never blocks)."""
    try:
        with runfiles.open_read(path) as f:
            return f.read(SYSFS_READ_LIMIT).decode("ascii", "replace").strip()
    except (OSError, runfiles.UnsafeFile) as exc:
        return f"unreadable: {exc}"


def rdma_ports(class_dir: str) -> dict[str, tuple[str, str]]:
    """"device/port" -> (state, phys_state) of every InfiniBand/RoCE port under ``class_dir``."""
    ports: dict[str, tuple[str, str]] = {}
    for dev in ib_devices(class_dir):
        port_dir = os.path.join(class_dir, dev, "ports")
        try:
            numbers = sorted(os.listdir(port_dir), key=lambda p: (len(p), p))
        except OSError:
            continue
        for port in numbers:
            base = os.path.join(port_dir, port)
            ports[f"{dev}/{port}"] = (_sysfs_value(os.path.join(base, "state")), _sysfs_value(os.path.join(base, "phys_state")))
    return ports


def check_rdma(cfg: CheckConfig) -> ItemResult:
    """Every RDMA port is up: logical state ACTIVE and physical state LinkUp (a port in INIT or
    Polling has no link or no subnet manager; NCCL would fall back to sockets or fail)."""
    ports = rdma_ports(cfg.ib_class_dir)
    if not ports:
        return ItemResult("rdma", SKIPPED, f"no RDMA device with ports under {cfg.ib_class_dir}")
    data = {"ports": {p: {"state": s, "phys_state": ph} for p, (s, ph) in ports.items()}, "class_dir": cfg.ib_class_dir}
    down = [f"{p} state {s!r}, phys_state {ph!r}" for p, (s, ph) in ports.items() if s != PORT_ACTIVE or ph != PORT_LINK_UP]
    if down:
        return ItemResult(
            "rdma", FAILED, f"{len(down)} of {len(ports)} RDMA port(s) not up: " + "; ".join(down[:8]),
            fix="check the cable and the switch port (ibstat, ibv_devinfo), and that a subnet manager runs",
            data=data,
        )
    return ItemResult("rdma", OK, f"{len(ports)} RDMA port(s) ACTIVE and LinkUp: {', '.join(ports)}", data=data)


# ------------------------------------------------------------------------------------ nccl-env


def _interfaces() -> list[str]:
    try:
        return [name for _i, name in socket.if_nameindex()]
    except OSError:
        return []


def ifname_matches(spec: str, names: list[str]) -> list[str]:
    """Interfaces NCCL would use for an NCCL_SOCKET_IFNAME / NCCL_IB_HCA value: a comma list of
    prefixes; '^' in front excludes them, '=' in front asks for exact names."""
    spec = spec.strip()
    exclude = spec.startswith("^")
    spec = spec.lstrip("^")
    exact = spec.startswith("=")
    spec = spec.lstrip("=")
    pats = [p.split(":", 1)[0].strip() for p in spec.split(",") if p.strip()]

    def hit(name: str) -> bool:
        return any(name == p if exact else name.startswith(p) for p in pats)

    return [n for n in names if hit(n) != exclude]


_DEPRECATED = {
    "NCCL_BLOCKING_WAIT": "TORCH_NCCL_BLOCKING_WAIT",
    "NCCL_ASYNC_ERROR_HANDLING": "TORCH_NCCL_ASYNC_ERROR_HANDLING",
    "NCCL_DESYNC_DEBUG": "TORCH_NCCL_DESYNC_DEBUG",
}
_SLOW_SWITCHES = {
    "NCCL_P2P_DISABLE": "disables GPU peer-to-peer transfers",
    "NCCL_SHM_DISABLE": "disables shared-memory transport",
    "NCCL_NVLS_ENABLE": None,
    "CUDA_LAUNCH_BLOCKING": "serialises every CUDA kernel launch",
}


def lint_nccl_env(
    env: Mapping[str, str], interfaces: list[str], ib: list[str]
) -> tuple[list[str], list[str]]:
    """Preset variables that break or slow a job -> (errors, warnings). Pure."""
    errors: list[str] = []
    warnings: list[str] = []
    ifname = env.get("NCCL_SOCKET_IFNAME")
    if ifname and not ifname_matches(ifname, interfaces):
        errors.append(
            f"NCCL_SOCKET_IFNAME={ifname} matches no interface (have: {', '.join(interfaces) or 'none'})"
        )
    gloo = env.get("GLOO_SOCKET_IFNAME")
    if gloo:
        missing = [n for n in (p.strip() for p in gloo.split(",")) if n and n not in interfaces]
        if missing:
            errors.append(f"GLOO_SOCKET_IFNAME names missing interface(s) {', '.join(missing)}")
    hca = env.get("NCCL_IB_HCA")
    if hca:
        if not ib:
            warnings.append(f"NCCL_IB_HCA={hca} is set but this node has no InfiniBand device")
        elif not ifname_matches(hca, ib):
            errors.append(f"NCCL_IB_HCA={hca} matches no InfiniBand device (have: {', '.join(ib)})")
    if ib and env.get("NCCL_IB_DISABLE", "0").strip() == "1":
        warnings.append("NCCL_IB_DISABLE=1 on a node with InfiniBand: NCCL falls back to slow TCP sockets")
    for var in ("NCCL_TOPO_FILE", "NCCL_GRAPH_FILE"):
        path = env.get(var)
        if path and not os.path.exists(path):
            errors.append(f"{var}={path} does not exist")
    level = env.get("NCCL_DEBUG", "").upper()
    if level in ("INFO", "TRACE"):
        warnings.append(f"NCCL_DEBUG={level} prints a lot and slows NCCL; use it only while debugging")
    for var, what in _SLOW_SWITCHES.items():
        if what and env.get(var, "0").strip() == "1":
            warnings.append(f"{var}=1 {what}: expect a slower job")
    for var in ("NCCL_ALGO", "NCCL_PROTO"):
        if env.get(var):
            warnings.append(f"{var}={env[var]} forces NCCL's choice; remove it unless you measured it helps")
    for old, new in _DEPRECATED.items():
        if old in env and new not in env:
            warnings.append(f"{old} is deprecated in PyTorch; use {new}")
    if env.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "").strip() == "0":
        warnings.append(
            "TORCH_NCCL_ASYNC_ERROR_HANDLING=0: NCCL errors and timeouts will hang instead of failing"
        )
    return errors, warnings


def check_nccl_env(cfg: CheckConfig, env: Mapping[str, str]) -> ItemResult:
    errors, warnings = lint_nccl_env(env, _interfaces(), ib_devices(cfg.ib_class_dir))
    preset = sorted(k for k in env if k.startswith(("NCCL_", "TORCH_NCCL_", "GLOO_")))
    data = {"preset": {k: env[k] for k in preset}, "errors": errors, "warnings": warnings}
    if errors:
        return ItemResult(
            "nccl-env",
            FAILED,
            "; ".join(errors + warnings),
            fix="unset or correct these variables (images migrated from other platforms often preset them)",
            data=data,
        )
    if warnings:
        return ItemResult(
            "nccl-env", WARNING, "; ".join(warnings), fix="unset them unless you need them", data=data
        )
    return ItemResult("nccl-env", OK, f"{len(preset)} NCCL/Gloo variable(s) preset, none harmful", data=data)


# --------------------------------------------------------------------------------- master-port


def is_local_address(host: str) -> bool:
    if host in ("localhost", "", socket.gethostname(), socket.getfqdn()):
        return True
    try:
        addr = ipaddress.ip_address(host) if _is_ip(host) else None
    except ValueError:
        addr = None
    if addr is not None and addr.is_loopback:
        return True
    try:  # an address of this machine can be bound
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.bind((host, 0))
        return True
    except OSError:
        return False


def check_master_port(cfg: CheckConfig) -> ItemResult:
    if not cfg.master_port:
        return ItemResult("master-port", SKIPPED, "no master port given")
    host = cfg.master_addr or "127.0.0.1"
    if not is_local_address(host):
        return ItemResult("master-port", SKIPPED, f"master {host} is another machine")
    port = cfg.master_port
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # like TCPStore: TIME_WAIT is fine
            s.bind(("", port))
    except OSError as exc:
        return ItemResult(
            "master-port",
            FAILED,
            f"port {port} cannot be bound: {exc.strerror or exc}",
            fix=f"another process holds it (ss -ltnp 'sport = :{port}'): stop it or choose another port",
            data={"port": port},
        )
    return ItemResult("master-port", OK, f"port {port} is free", data={"port": port})


# -------------------------------------------------------------------------------- cuda-toolkit


def find_nvcc(env: Mapping[str, str]) -> str | None:
    for home in (env.get("CUDA_HOME"), env.get("CUDA_PATH")):
        if home and os.access(os.path.join(home, "bin", "nvcc"), os.X_OK):
            return os.path.join(home, "bin", "nvcc")
    return shutil.which("nvcc", path=env.get("PATH"))


def check_cuda_toolkit(cfg: CheckConfig, env: Mapping[str, str]) -> ItemResult:
    nvcc = find_nvcc(env)
    if not cfg.require_cuda_toolkit:
        where = f"nvcc at {nvcc}" if nvcc else "no nvcc"
        return ItemResult("cuda-toolkit", SKIPPED, f"not requested ({where})")
    if nvcc is None:
        return ItemResult(
            "cuda-toolkit",
            FAILED,
            "nvcc not found (CUDA_HOME, PATH); DeepSpeed and JIT-built extensions need it",
            fix="use an image with the CUDA toolkit or install it and set CUDA_HOME",
        )
    try:
        out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.TimeoutExpired) as exc:
        return ItemResult(
            "cuda-toolkit", FAILED, f"{nvcc} does not run: {exc}", fix="reinstall the CUDA toolkit"
        )
    release = next((ln.strip() for ln in out.splitlines() if "release" in ln), out.strip()[-80:])
    return ItemResult("cuda-toolkit", OK, f"{nvcc}: {release}", data={"nvcc": nvcc})


# --------------------------------------------------------------------------------------- all


ITEM_NAMES = [
    "dns",
    "disk-size root",
    "disk-size shm",
    "disk-size cache",
    "ulimit",
    "rdma",
    "gpu-check",
    "nccl-env",
    "master-port",
    "cuda-toolkit",
]


def _items(cfg: CheckConfig, env: Mapping[str, str]) -> list[tuple[str, Callable[[], ItemResult]]]:
    return [
        ("dns", lambda: check_dns(cfg)),
        (
            "disk-size root",
            lambda: check_disk("root", cfg.root_path, cfg.root_min_gb, "--check-disk-root-gb"),
        ),
        ("disk-size shm", lambda: check_disk("shm", cfg.shm_path, cfg.shm_min_gb, "--check-disk-shm-gb")),
        (
            "disk-size cache",
            lambda: check_disk(
                "cache", cfg.cache_path, cfg.cache_min_gb, "--check-disk-cache-gb", "--check-cache-dir"
            ),
        ),
        ("ulimit", lambda: check_ulimit(cfg)),
        ("rdma", lambda: check_rdma(cfg)),
        ("gpu-check", lambda: check_gpu(cfg, env)),
        ("nccl-env", lambda: check_nccl_env(cfg, env)),
        ("master-port", lambda: check_master_port(cfg)),
        ("cuda-toolkit", lambda: check_cuda_toolkit(cfg, env)),
    ]


def is_skipped(name: str, skip: set[str]) -> bool:
    return name in skip or name.split()[0] in skip or name.replace(" ", "-") in skip


# Items cheap enough, and about state that changes while a job trains (a disk or /dev/shm fills, a
# GPU or a port goes down), to run again before every restart of the workers.
RECHECKED_ITEMS = ("disk-size root", "disk-size shm", "disk-size cache", "rdma", "gpu-check")


def run_checks(
    cfg: CheckConfig, env: Mapping[str, str] | None = None, only: tuple[str, ...] | None = None
) -> list[ItemResult]:
    """Run every item (or those named in ``only``) in order. A bug in an item never fails the
    node: it becomes a warning."""
    env = os.environ if env is None else env
    results = []
    for name, fn in _items(cfg, env):
        if only is not None and name not in only:
            continue
        if is_skipped(name, cfg.skip):
            results.append(ItemResult(name, SKIPPED, "left out (--check-skip)"))
            continue
        t0 = time.perf_counter()
        try:
            res = fn()
        except Exception as exc:
            res = ItemResult(name, WARNING, f"the check itself failed: {type(exc).__name__}: {exc}")
        res.seconds = round(time.perf_counter() - t0, 4)
        results.append(res)
    return results


def passed(results: list[ItemResult]) -> bool:
    return not any(r.failed for r in results)


def hardware_check(cfg: CheckConfig, env: Mapping[str, str] | None = None) -> HardwareReport:
    """The light hardware check (periodic, and after a worker failure): GPU health only.

    A node without GPUs has nothing to check here and is reported healthy."""
    env = os.environ if env is None else env
    try:
        res = check_gpu(cfg, env)
    except Exception as exc:  # never call hardware broken because the checker broke
        res = ItemResult("gpu-check", WARNING, f"the check itself failed: {exc}")
    faults = [res.detail] if res.failed else []
    return HardwareReport(healthy=not faults, faults=faults, items=[res])


def skip_item(text: str) -> str:
    """An argparse ``type``: a check item's name or its first word ("disk-size": every disk item)."""
    if text in ITEM_NAMES or text in {n.split()[0] for n in ITEM_NAMES}:
        return text
    raise argparse.ArgumentTypeError(f"unknown check item {text!r} (items: {', '.join(ITEM_NAMES)})")


skip_item.__name__ = "item"
