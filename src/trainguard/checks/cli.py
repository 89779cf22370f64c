"""`trainguard check`: the pre-flight check items of this node (seed item names and thresholds).

Prints one ``item <name> ... <status> (<detail>)`` line per item (grep for ``item``), with what to
do on a failure. Exit code 0 when no item failed, 1 otherwise.
"""

from __future__ import annotations

import argparse
import json

from trainguard.checks.items import ITEM_NAMES, CheckConfig, passed, run_checks


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print the results as JSON")
    p.add_argument("--nproc-per-node", type=int, default=None, help="GPUs the job will use on this node")
    p.add_argument("--gpu", choices=["auto", "require", "off"], default="auto",
                   help="auto: check GPUs when present; require: fail without them")  # fmt: skip
    p.add_argument("--hostfile", action="append", default=None, metavar="GLOB",
                   help="host files whose names must resolve (default /etc/volcano/*.host)")  # fmt: skip
    p.add_argument("--rdzv-endpoint", default=None, help="HOST[:PORT] that must resolve")
    p.add_argument("--master-addr", default=None, help="with --master-port: the port must be free here")
    p.add_argument("--master-port", type=int, default=None)
    p.add_argument("--root-dir", default="/", help="path checked by disk-size root")
    p.add_argument("--shm-dir", default="/dev/shm", help="path checked by disk-size shm")
    p.add_argument(
        "--cache-dir", default="/cache", help="path checked by disk-size cache (skipped if absent)"
    )
    p.add_argument(
        "--check-disk-root-gb", type=float, default=32.0, metavar="GB", help="free GB needed (> GB)"
    )
    p.add_argument("--check-disk-shm-gb", type=float, default=1.0, metavar="GB")
    p.add_argument("--check-disk-cache-gb", type=float, default=32.0, metavar="GB")
    p.add_argument("--ulimit", choices=["auto", "always", "never"], default="auto",
                   help="auto: check limits only with an InfiniBand device (seed)")  # fmt: skip
    p.add_argument("--ulimit-memlock-kb", type=int, default=16000)
    p.add_argument("--ulimit-nofile", type=int, default=1_000_000)
    p.add_argument("--ulimit-stack-kb", type=int, default=8000)
    p.add_argument("--ulimit-nproc", type=int, default=1_000_000)
    p.add_argument("--require-cuda-toolkit", action="store_true", help="fail when nvcc is missing")
    p.add_argument("--dns-timeout", type=float, default=3.0, metavar="SECONDS")
    p.add_argument(
        "--skip", action="append", default=[], metavar="ITEM", help=f"leave out: {', '.join(ITEM_NAMES)}"
    )


def config_from(args: argparse.Namespace) -> CheckConfig:
    cfg = CheckConfig(
        endpoints=[e for e in (args.rdzv_endpoint, args.master_addr) if e],
        dns_timeout_s=args.dns_timeout,
        root_path=args.root_dir,
        root_min_gb=args.check_disk_root_gb,
        shm_path=args.shm_dir,
        shm_min_gb=args.check_disk_shm_gb,
        cache_path=args.cache_dir,
        cache_min_gb=args.check_disk_cache_gb,
        ulimit_mode=args.ulimit,
        ulimit_memlock_kb=args.ulimit_memlock_kb,
        ulimit_nofile=args.ulimit_nofile,
        ulimit_stack_kb=args.ulimit_stack_kb,
        ulimit_nproc=args.ulimit_nproc,
        gpu_mode=args.gpu,
        nproc_per_node=args.nproc_per_node,
        master_addr=args.master_addr,
        master_port=args.master_port,
        require_cuda_toolkit=args.require_cuda_toolkit,
        skip=set(args.skip),
    )
    if args.hostfile:
        cfg.hostfile_globs = list(args.hostfile)
    return cfg


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
