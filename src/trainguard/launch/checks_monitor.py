"""Checks inside `trainguard run`: pre-flight items, the node health check, periodic hardware checks.

- Before workers first start (``on_before_start``, first round of this agent only), the node runs
  the ``trainguard check`` items and records ``precheck_passed`` / ``precheck_failed``. Every round,
  all agents publish their pre-check outcome in the rendezvous store and wait for each other's, so
  they agree: a failed node is excluded ("The node is down.", seed scenarios 1-2) and the others
  re-rendezvous without it, or stop when the job is not elastic enough to go on.
- With ``--node-check``, every round all agents run the paired GEMM + collective benchmark
  (``trainguard.checks.nodecheck_run``) and agree on faulty nodes and stragglers the same way
  (``nodecheck_result``, ``node_excluded``).
- While workers run, a background thread repeats a light hardware check every
  ``--health-check-interval`` seconds; ``poll`` turns a fault into an EXCLUDE_NODE decision.
- When workers fail, ``on_workers_failed`` runs the hardware check at once and leaves
  ``ctx.extra["hardware"] = {"healthy": bool, "faults": [...]}`` for ``policy.decide_on_failure``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from trainguard import policy
from trainguard.checks.items import (
    CheckConfig,
    HardwareReport,
    ItemResult,
    hardware_check,
    passed,
    run_checks,
)
from trainguard.checks.nodecheck_cli import add_check_arguments, config_from
from trainguard.checks.nodecheck_run import NodeChecker, get_when_set
from trainguard.launch.monitor import Monitor, MonitorContext

log = logging.getLogger(__name__)

PRECHECK_KEY = "trainguard/precheck"
NODECHECK_PREFIX = "trainguard/nodecheck"


def add_run_arguments(group: argparse._ArgumentGroup) -> None:
    g = group
    g.add_argument("--precheck", choices=["on", "off"], default="on",
                   help="run the pre-flight check items on each node before workers first start (default on)")  # fmt: skip
    g.add_argument(
        "--check-disk-root-gb", type=float, default=32.0, help="disk-size root: free GB needed (> N)"
    )
    g.add_argument(
        "--check-disk-shm-gb", type=float, default=1.0, help="disk-size shm: free GB needed in /dev/shm"
    )
    g.add_argument("--check-disk-cache-gb", type=float, default=32.0, help="disk-size cache: free GB needed")
    g.add_argument("--check-root-dir", default="/", help="path checked by disk-size root")
    g.add_argument(
        "--check-cache-dir", default="/cache", help="path checked by disk-size cache (skipped if absent)"
    )
    g.add_argument("--check-hostfile", action="append", default=None, metavar="GLOB",
                   help="host files whose names must resolve (default /etc/volcano/*.host)")  # fmt: skip
    g.add_argument("--check-gpu", choices=["auto", "require", "off"], default="auto",
                   help="gpu-check: auto checks GPUs when present, require fails without them")  # fmt: skip
    g.add_argument("--check-ulimit", choices=["auto", "always", "never"], default="auto",
                   help="ulimit item: auto = only with an InfiniBand device (seed)")  # fmt: skip
    g.add_argument(
        "--check-require-cuda-toolkit", action="store_true", help="fail the pre-check without nvcc"
    )
    g.add_argument("--check-skip", action="append", default=[], metavar="ITEM", help="leave out an item")
    g.add_argument("--check-wait", type=float, default=120.0, metavar="SECONDS",
                   help="how long agents wait for each other's pre-check results")  # fmt: skip
    g.add_argument("--node-check", action="store_true",
                   help="run the GEMM + collective node check in paired groups before workers start")  # fmt: skip
    add_check_arguments(g, prefix="node-check-")
    g.add_argument("--node-check-exclude-straggler", action="store_true",
                   help="exclude a node the node check names a straggler")  # fmt: skip
    g.add_argument("--health-check-interval", type=float, default=300.0, metavar="SECONDS",
                   help="periodic light hardware check while training (0: off)")  # fmt: skip


def _int_or_none(value: Any) -> int | None:
    try:
        return int(value)
    except (TypeError, ValueError):
        return None  # torchrun also accepts "auto", "gpu", "cpu"


def check_config_from(options: argparse.Namespace) -> CheckConfig:
    get = lambda name, default=None: getattr(options, name, default)  # noqa: E731
    endpoints = [e for e in (get("rdzv_endpoint"), get("master_addr")) if e]
    cfg = CheckConfig(
        endpoints=endpoints,
        root_path=get("check_root_dir", "/"),
        root_min_gb=get("check_disk_root_gb", 32.0),
        shm_min_gb=get("check_disk_shm_gb", 1.0),
        cache_path=get("check_cache_dir", "/cache"),
        cache_min_gb=get("check_disk_cache_gb", 32.0),
        gpu_mode=get("check_gpu", "auto"),
        ulimit_mode=get("check_ulimit", "auto"),
        nproc_per_node=_int_or_none(get("nproc_per_node")),
        require_cuda_toolkit=bool(get("check_require_cuda_toolkit", False)),
        # master-port stays unchecked (no port given): the rendezvous already listens on its port
        # and the agent picks a free MASTER_PORT for the workers.
        skip=set(get("check_skip", []) or []),
    )
    if get("check_hostfile"):
        cfg.hostfile_globs = list(get("check_hostfile"))
    return cfg


def _say(line: str) -> None:
    """Check lines go to the agent's stderr as they are (users grep them for ``item``)."""
    print(f"[trainguard] {line}", file=sys.stderr, flush=True)


class ChecksMonitor(Monitor):
    name = "checks"

    def __init__(
        self,
        options: argparse.Namespace,
        hardware_check_fn: Callable[[CheckConfig], HardwareReport] | None = None,
        node_check_env: dict[str, str] | None = None,
    ) -> None:
        """``hardware_check_fn`` replaces the GPU health check and ``node_check_env`` adds variables
        to the benchmark processes' environment (tests use them for fault injection)."""
        self.options = options
        self.cfg = check_config_from(options)
        self.precheck_on = getattr(options, "precheck", "on") == "on"
        self.node_check = bool(getattr(options, "node_check", False))
        self.interval = float(getattr(options, "health_check_interval", 0.0) or 0.0)
        self.wait_s = float(getattr(options, "check_wait", 120.0))
        self._hardware_check = hardware_check_fn or hardware_check
        self._node_check_env = dict(node_check_env or {})
        self._precheck: list[ItemResult] | None = None
        self._started_at = time.time()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._fault: HardwareReport | None = None
        self._fault_reported = False
        self._ctx: MonitorContext | None = None

    # ------------------------------------------------------------------------- before start

    def on_before_start(self, ctx: MonitorContext) -> policy.Decision | None:
        if self.precheck_on:
            decision = self._precheck_round(ctx)
            if decision is not None:
                return decision
        if self.node_check:
            return self._node_check_round(ctx)
        return None

    def _run_precheck(self, ctx: MonitorContext) -> list[ItemResult]:
        """Once per agent (the first round): later rounds reuse the result."""
        if self._precheck is None:
            t0 = time.perf_counter()
            results = run_checks(self.cfg)
            elapsed = time.perf_counter() - t0
            for r in results:
                _say(r.line())
            ok = passed(results)
            failed = [r for r in results if r.failed]
            ctx.events.emit(
                "precheck_passed" if ok else "precheck_failed",
                "pre-check passed"
                if ok
                else "pre-check failed: " + "; ".join(f"{r.item}: {r.detail}" for r in failed)[:400],
                severity="info" if ok else "error",
                evidence={"items": [r.to_dict() for r in results], "seconds": round(elapsed, 4)},
            )
            self._precheck = results
        return self._precheck

    def _precheck_round(self, ctx: MonitorContext) -> policy.Decision | None:
        results = self._run_precheck(ctx)
        mine = {
            "passed": passed(results),
            "failed": [r.line() for r in results if r.failed],
            "hardware_fault": any(r.failed and r.item == "gpu-check" for r in results),
            "node": ctx.node,
        }
        outcomes = {ctx.node_rank: mine}
        if ctx.store is not None and ctx.nnodes > 1:
            ctx.store.set(f"{PRECHECK_KEY}/{ctx.node_rank}", json.dumps(mine))
            outcomes = self._gather(ctx, PRECHECK_KEY)
        faulty = {
            n: ("pre-check failed: " + "; ".join(o["failed"])) if o else "no pre-check result (agent gone?)"
            for n, o in outcomes.items()
            if not o or not o.get("passed")
        }
        evidence = {
            "stage": "precheck",
            "scenario": (1 if mine["hardware_fault"] else 2) if not mine["passed"] else None,
            "outcomes": {str(k): v for k, v in outcomes.items()},
        }
        names = {n: o["node"] for n, o in outcomes.items() if o and o.get("node")}
        decision = policy.decide_before_start(
            ctx.node_rank, ctx.nnodes, self._min_nodes(ctx), faulty, evidence=evidence, names=names
        )
        return decision

    def _gather(self, ctx: MonitorContext, prefix: str) -> dict[int, dict[str, Any] | None]:
        """Every node's published value under ``prefix/<node_rank>``; None for nodes that never
        published within --check-wait seconds."""
        deadline = time.monotonic() + self.wait_s
        out: dict[int, dict[str, Any] | None] = {}
        for n in range(ctx.nnodes):
            raw = get_when_set(ctx.store, f"{prefix}/{n}", deadline)
            out[n] = json.loads(raw) if raw is not None else None
        return out

    def _node_check_round(self, ctx: MonitorContext) -> policy.Decision | None:
        cfg = config_from(self.options, prefix="node-check-")
        cfg.env.update(self._node_check_env)
        endpoint = getattr(self.options, "rdzv_endpoint", None) or getattr(self.options, "master_addr", None)
        if endpoint:
            from trainguard.checks.items import endpoint_host

            cfg.peer_host = endpoint_host(str(endpoint))
        if getattr(self.options, "local_addr", None):
            cfg.advertise_addr = self.options.local_addr
        if ctx.store is None:
            log.warning("node check needs the rendezvous store; skipped")
            return None
        t0 = time.monotonic()
        checker = NodeChecker(
            ctx.store, ctx.node_rank, ctx.nnodes, cfg, prefix=NODECHECK_PREFIX, say=_say, name=ctx.node
        )
        verdict = checker.run()
        elapsed = time.monotonic() - t0
        bad = bool(verdict.faulty or verdict.undetermined or verdict.stragglers)
        faulty = [verdict.label(n) for n in sorted(verdict.faulty)]
        slow = [verdict.label(n) for n in sorted(verdict.stragglers)]
        summary = (
            f"faulty: {', '.join(faulty) or 'none'}; stragglers: {', '.join(slow) or 'none'}"
            + (f"; {verdict.undetermined}" if verdict.undetermined else "")
            if bad
            else f"all {ctx.nnodes} node(s) healthy"
        )
        for n, why in sorted(verdict.faulty.items()):
            _say(f"node check: {verdict.label(n)} is faulty: {why}")
        for n, why in sorted(verdict.stragglers.items()):
            _say(f"node check: {verdict.label(n)} is a straggler: {why}")
        ctx.events.emit(
            "nodecheck_result",
            f"node check ({elapsed:.1f} s): {summary}",
            severity="warning" if bad else "info",
            evidence={
                "verdict": verdict.to_dict(),
                "node_rank": ctx.node_rank,
                "measurements": checker.metrics,
            },
        )
        decision = policy.decide_before_start(
            ctx.node_rank,
            ctx.nnodes,
            self._min_nodes(ctx),
            verdict.faulty,
            verdict.stragglers,
            exclude_stragglers=bool(getattr(self.options, "node_check_exclude_straggler", False)),
            undetermined=verdict.undetermined,
            evidence={
                "stage": "node_check",
                "times_s_per_iteration": verdict.to_dict()["times_s_per_iteration"],
            },
        )
        return decision

    def _min_nodes(self, ctx: MonitorContext) -> int:
        return policy.min_nodes_of(getattr(self.options, "nnodes", None), ctx.nnodes)

    # ------------------------------------------------------------------------ while running

    def on_workers_started(self, ctx: MonitorContext) -> None:
        self._ctx = ctx
        if self.interval > 0 and self._thread is None:
            self._thread = threading.Thread(target=self._health_loop, name="trainguard-health", daemon=True)
            self._thread.start()

    def _periodic_config(self) -> CheckConfig:
        # Only Xid errors logged since this agent started count as new faults.
        return dataclasses.replace(self.cfg, xid_window_s=max(1.0, time.time() - self._started_at))

    def _health_loop(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                report = self._hardware_check(self._periodic_config())
            except Exception as exc:  # the checker breaking is not a hardware fault
                log.warning("periodic hardware check failed to run: %s", exc)
                continue
            if not report.healthy:
                with self._lock:
                    if self._fault is None:
                        self._fault = report
                ctx = self._ctx
                if ctx is not None:
                    ctx.events.emit(
                        "hardware_fault",
                        "periodic hardware check: " + "; ".join(report.faults)[:400],
                        severity="critical",
                        evidence=report.to_dict(),
                    )

    def poll(self, ctx: MonitorContext) -> policy.Decision | None:
        with self._lock:
            if self._fault is None or self._fault_reported:
                return None
            self._fault_reported = True
            faults = list(self._fault.faults)
        return policy.decide_on_hardware_fault(faults, {"node": ctx.node, "node_rank": ctx.node_rank})

    def on_workers_failed(self, ctx: MonitorContext, failures: dict[int, dict[str, Any]]) -> None:
        try:
            report = self._hardware_check(self._periodic_config())
        except Exception as exc:
            log.warning("hardware check after the failure could not run: %s", exc)
            return
        ctx.extra["hardware"] = {"healthy": report.healthy, "faults": report.faults}
        ctx.events.emit(
            "hardware_check",
            "hardware healthy after the worker failure"
            if report.healthy
            else "hardware fault after the worker failure: " + "; ".join(report.faults)[:400],
            severity="info" if report.healthy else "critical",
            evidence=report.to_dict(),
        )

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)


def create(options: argparse.Namespace) -> Monitor | None:
    on = (
        getattr(options, "precheck", "on") == "on"
        or getattr(options, "node_check", False)
        or float(getattr(options, "health_check_interval", 0.0) or 0.0) > 0
    )
    return ChecksMonitor(options) if on else None
