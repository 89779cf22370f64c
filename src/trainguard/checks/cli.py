"""`trainguard check`: the pre-flight check items of this node (seed item names and thresholds).

Prints one ``item <name> ... <status> (<detail>)`` line per item (grep for ``item``), with what to
do on a failure. Exit code 0 when no item failed, 1 otherwise.
"""

from __future__ import annotations

import argparse
import json

from trainguard.checks.items import ITEM_NAMES, CheckConfig, passed, run_checks, skip_item
from trainguard.options import (
    dir_path,
    endpoint,
    given,
    non_negative,
    non_negative_int,
    port,
    positive_int,
    seconds,
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    d = CheckConfig()
    p.add_argument("--json", action="store_true", help="print the results as JSON")
    p.add_argument("--nproc-per-node", type=nproc_or_gpu, default=None,
                   help="GPUs the job will use on this node; 'gpu' (torchrun's: one per GPU) fails gpu-check without GPUs")  # fmt: skip
    p.add_argument("--gpu", choices=["auto", "require", "off"], default=None,
                   help=f"auto: check GPUs when present; require: fail without them (default {d.gpu_mode})")  # fmt: skip
    p.add_argument("--hostfile", action="append", default=None, metavar="GLOB",
                   help=f"host files whose names must resolve (default {' '.join(d.hostfile_globs)})")  # fmt: skip
    p.add_argument("--rdzv-endpoint", type=endpoint, default=None, help="HOST[:PORT] that must resolve")
    p.add_argument("--master-addr", default=None, help="with --master-port: the port must be free here")
    p.add_argument("--master-port", type=port, default=None)
    p.add_argument("--root-dir", type=dir_path, default=None, help=f"path checked by disk-size root (default {d.root_path})")
    p.add_argument("--shm-dir", type=dir_path, default=None, help=f"path checked by disk-size shm (default {d.shm_path})")
    p.add_argument("--cache-dir", type=dir_path, default=None,
                   help=f"path checked by disk-size cache, skipped if absent (default {d.cache_path})")  # fmt: skip
    p.add_argument("--check-disk-root-gb", type=non_negative, default=None, metavar="GB",
                   help=f"free GB needed (> GB, default {d.root_min_gb:g})")  # fmt: skip
    p.add_argument("--check-disk-shm-gb", type=non_negative, default=None, metavar="GB", help=f"(default {d.shm_min_gb:g})")
    p.add_argument("--check-disk-cache-gb", type=non_negative, default=None, metavar="GB", help=f"(default {d.cache_min_gb:g})")
    p.add_argument("--ib-dir", type=dir_path, default=None,
                   help=f"sysfs class directory of the RDMA devices read by rdma and ulimit (default {d.ib_class_dir})")  # fmt: skip
    p.add_argument("--ulimit", choices=["auto", "always", "never"], default=None,
                   help=f"auto: check limits only with an InfiniBand device (seed) (default {d.ulimit_mode})")  # fmt: skip
    p.add_argument("--ulimit-memlock-kb", type=non_negative_int, default=None, help=f"(default {d.ulimit_memlock_kb})")
    p.add_argument("--ulimit-nofile", type=non_negative_int, default=None, help=f"(default {d.ulimit_nofile})")
    p.add_argument("--ulimit-stack-kb", type=non_negative_int, default=None, help=f"(default {d.ulimit_stack_kb})")
    p.add_argument("--ulimit-nproc", type=non_negative_int, default=None, help=f"(default {d.ulimit_nproc})")
    p.add_argument("--require-cuda-toolkit", action="store_true", help="fail when nvcc is missing")
    p.add_argument("--dns-timeout", type=seconds, default=None, metavar="SECONDS", help=f"(default {d.dns_timeout_s:g})")
    p.add_argument(
        "--skip", action="append", default=[], metavar="ITEM", type=skip_item, help=f"leave out: {', '.join(ITEM_NAMES)}"
    )


# CheckConfig field -> option of `trainguard check`
_OPTIONS = {
    "dns_timeout_s": "dns_timeout",
    "root_path": "root_dir",
    "root_min_gb": "check_disk_root_gb",
    "shm_path": "shm_dir",
    "shm_min_gb": "check_disk_shm_gb",
    "cache_path": "cache_dir",
    "cache_min_gb": "check_disk_cache_gb",
    "ulimit_mode": "ulimit",
    "ulimit_memlock_kb": "ulimit_memlock_kb",
    "ulimit_nofile": "ulimit_nofile",
    "ulimit_stack_kb": "ulimit_stack_kb",
    "ulimit_nproc": "ulimit_nproc",
    "gpu_mode": "gpu",
    "ib_class_dir": "ib_dir",
    "master_addr": "master_addr",
    "master_port": "master_port",
    "hostfile_globs": "hostfile",
}


def nproc_or_gpu(text: str) -> int | str:
    """An argparse ``type``: a number of processes (>= 1) or torchrun's ``gpu`` (one per GPU)."""
    return "gpu" if text.strip() == "gpu" else positive_int(text)


nproc_or_gpu.__name__ = "nproc"


def config_from(args: argparse.Namespace) -> CheckConfig:
    nproc = args.nproc_per_node
    return CheckConfig(
        nproc_per_node=nproc if isinstance(nproc, int) else None,
        gpus_requested="--nproc-per-node gpu" if nproc == "gpu" else "",
        endpoints=[e for e in (args.rdzv_endpoint, args.master_addr) if e],
        require_cuda_toolkit=args.require_cuda_toolkit,
        skip=set(args.skip),
        **given(args, _OPTIONS),
    )


def main(args: argparse.Namespace) -> int:
    results = run_checks(config_from(args))
    ok = passed(results)
    if args.json:
        print(json.dumps({"passed": ok, "items": [r.to_dict() for r in results]}, indent=2, default=str))
    else:
        for r in results:
            print(r.line())
        failed = [r.item for r in results if r.failed]
        print("check passed" if ok else f"check failed: {', '.join(failed)}")
    return 0 if ok else 1
