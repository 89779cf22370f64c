"""Checks inside `trainguard run`: pre-flight items, the node health check, periodic hardware checks.

- Before workers first start (``on_before_start``, first round of this agent), the node runs the
  ``trainguard check`` items and records ``precheck_passed`` / ``precheck_failed``; before every
  later round (a restart) it runs the cheap items about changing state again (disk sizes, rdma,
  gpu-check: ``RECHECKED_ITEMS``). Every round,
  all agents publish their pre-check outcome in the rendezvous store and wait for each other's, so
  they agree on one ``CheckOutcome``; the policy then excludes a failed node ("The node is down.",
  seed scenarios 1-2) and the others re-rendezvous without it, or stop when the job is not elastic
  enough to go on.
- With ``--node-check``, every round the agents run the paired GEMM + collective benchmark
  (``trainguard.checks.nodecheck_run``) and agree on faulty nodes and stragglers the same way
  (``nodecheck_result``) — only the nodes without a recent healthy result, or involved in the
  failure that caused the round, with as many healthy partners; the rest reuse their result
  (``monitors/nodecheck_reuse.py``, ``--node-check-reuse``).
- While workers run, a background thread repeats a light hardware check every
  ``--health-check-interval`` seconds (``hardware_fault``); ``poll`` hands a fault to the policy.
- When workers fail, ``on_workers_failed`` runs the hardware check at once and returns its
  ``HardwareReport`` for ``policy.decide_on_failure``.
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
from dataclasses import dataclass, field
from typing import Any

from trainguard.checks.items import (
    FAILED,
    OK,
    RECHECKED_ITEMS,
    CheckConfig,
    HardwareReport,
    ItemResult,
    endpoint_host,
    hardware_check,
    is_skipped,
    passed,
    run_checks,
    skip_item,
)
from trainguard.checks.nodecheck_cli import add_check_arguments, config_from
from trainguard.checks.nodecheck_run import NodeCheckConfig, NodeChecker, get_when_set
from trainguard.cluster import node_history
from trainguard.cluster.node_history import HistorySettings, HistoryUnavailable, NodeHistory
from trainguard.detect.nodecheck import Verdict, recheck_nodes
from trainguard.evidence import CheckOutcome, HardwareFault, RankFailure
from trainguard.monitors.api import Monitor, MonitorContext
from trainguard.monitors.nodecheck_reuse import NEVER_CHECKED, NodeCheckMemory, fingerprint
from trainguard.options import given, non_negative, seconds
from trainguard.probes import identity
from trainguard.rundir import chaos_hold
from trainguard.spawn.failures import lost_peer

log = logging.getLogger(__name__)

PRECHECK_KEY = "trainguard/precheck"
NODECHECK_PREFIX = "trainguard/nodecheck"


@dataclass(frozen=True)
class ChecksSettings:
    """The checks monitor's settings, parsed once from `trainguard run`'s flags."""

    precheck: bool = True
    node_check: bool = False
    health_interval_s: float = 300.0  # 0: no periodic hardware check
    wait_s: float = 120.0  # how long agents wait for each other's pre-check results
    node_check_reuse_s: float = 600.0  # a node's healthy node-check result stands this long (0: never)
    check: CheckConfig = field(default_factory=CheckConfig)
    node: NodeCheckConfig = field(default_factory=NodeCheckConfig)
    history: HistorySettings = field(default_factory=HistorySettings)

    @property
    def refuses_gpu_less_node(self) -> bool:
        """Whether a GPU job (``--nproc-per-node gpu``) on a node without GPUs is refused by the
        pre-check's gpu-check (the seed's "The node is down.") rather than by torch's usage error."""
        c = self.check
        return self.precheck and bool(c.gpus_requested) and c.gpu_mode != "off" and not is_skipped("gpu-check", c.skip)

    @property
    def enabled(self) -> bool:
        return self.precheck or self.node_check or self.health_interval_s > 0

    @classmethod
    def from_options(cls, options: argparse.Namespace) -> ChecksSettings:
        endpoint = options.rdzv_endpoint or options.master_addr
        check = CheckConfig(
            endpoints=[e for e in (options.rdzv_endpoint, options.master_addr) if e],
            nproc_per_node=_int_or_none(options.nproc_per_node),
            gpus_requested=gpus_requested(options.nproc_per_node),
            require_cuda_toolkit=bool(options.check_require_cuda_toolkit),
            # master-port stays unchecked (no port given): the rendezvous already listens on its
            # port and the agent picks a free MASTER_PORT for the workers.
            skip=set(options.check_skip or []),
            **given(options, _CHECK_OPTIONS),
        )
        node = dataclasses.replace(
            config_from(options, prefix="node-check-"),
            peer_host=endpoint_host(str(endpoint)) if endpoint else None,
            advertise_addr=options.local_addr or None,
        )
        fields = given(
            options,
            {"health_interval_s": "health_check_interval", "wait_s": "check_wait", "node_check_reuse_s": "node_check_reuse"},
        )
        if options.precheck is not None:
            fields["precheck"] = options.precheck == "on"
        return cls(node_check=bool(options.node_check), check=check, node=node,
                   history=HistorySettings.from_options(options), **fields)


# CheckConfig field -> `trainguard run` option
_CHECK_OPTIONS = {
    "root_path": "check_root_dir",
    "root_min_gb": "check_disk_root_gb",
    "shm_path": "check_shm_dir",
    "shm_min_gb": "check_disk_shm_gb",
    "ib_class_dir": "check_ib_dir",
    "cache_path": "check_cache_dir",
    "cache_min_gb": "check_disk_cache_gb",
    "gpu_mode": "check_gpu",
    "ulimit_mode": "check_ulimit",
    "hostfile_globs": "check_hostfile",
}


def add_run_arguments(group: argparse._ArgumentGroup) -> None:
    g, d, c = group, ChecksSettings(), CheckConfig()
    g.add_argument("--precheck", choices=["on", "off"], default=None,
                   help="run the pre-flight check items on each node before workers first start (default on)")  # fmt: skip
    g.add_argument("--check-disk-root-gb", type=float, default=None,
                   help=f"disk-size root: free GB needed (> N, default {c.root_min_gb:g})")  # fmt: skip
    g.add_argument("--check-disk-shm-gb", type=float, default=None,
                   help=f"disk-size shm: free GB needed in /dev/shm (default {c.shm_min_gb:g})")  # fmt: skip
    g.add_argument("--check-disk-cache-gb", type=float, default=None,
                   help=f"disk-size cache: free GB needed (default {c.cache_min_gb:g})")  # fmt: skip
    g.add_argument("--check-root-dir", default=None, help=f"path checked by disk-size root (default {c.root_path})")
    g.add_argument("--check-shm-dir", default=None, help=f"path checked by disk-size shm (default {c.shm_path})")
    g.add_argument("--check-ib-dir", default=None,
                   help=f"sysfs class directory of the RDMA devices read by rdma (default {c.ib_class_dir})")  # fmt: skip
    g.add_argument("--check-cache-dir", default=None,
                   help=f"path checked by disk-size cache, skipped if absent (default {c.cache_path})")  # fmt: skip
    g.add_argument("--check-hostfile", action="append", default=None, metavar="GLOB",
                   help=f"host files whose names must resolve (default {' '.join(c.hostfile_globs)})")  # fmt: skip
    g.add_argument("--check-gpu", choices=["auto", "require", "off"], default=None,
                   help=f"gpu-check: auto checks GPUs when present, require fails without them (default {c.gpu_mode})")  # fmt: skip
    g.add_argument("--check-ulimit", choices=["auto", "always", "never"], default=None,
                   help=f"ulimit item: auto = only with an InfiniBand device, seed (default {c.ulimit_mode})")  # fmt: skip
    g.add_argument(
        "--check-require-cuda-toolkit", action="store_true", help="fail the pre-check without nvcc"
    )
    g.add_argument("--check-skip", action="append", default=[], metavar="ITEM", type=skip_item, help="leave out an item")
    g.add_argument("--check-wait", type=seconds, default=None, metavar="SECONDS",
                   help=f"how long agents wait for each other's pre-check results (default {d.wait_s:g})")  # fmt: skip
    g.add_argument("--node-check", "--network-check", action="store_true", dest="node_check",
                   help="run the GEMM + collective node check in paired groups before workers start "
                   "(--network-check: DLRover's name for it)")  # fmt: skip
    add_check_arguments(g, prefix="node-check-")
    g.add_argument("--node-check-exclude-straggler", action="store_true",
                   help="exclude a node the node check names a straggler (--exclude-straggler does too)")  # fmt: skip
    g.add_argument("--node-check-reuse", type=non_negative, default=None, metavar="SECONDS",
                   help="reuse a node's healthy node-check result this long while the node is unchanged and "
                   f"not involved in a failure; only the others are rechecked (0: always all, default {d.node_check_reuse_s:g})")  # fmt: skip
    g.add_argument("--health-check-interval", type=non_negative, default=None, metavar="SECONDS",
                   help=f"periodic light hardware check while training (0: off, default {d.health_interval_s:g})")  # fmt: skip


def gpus_requested(nproc_per_node: Any) -> str:
    """Why the job is known to use GPUs ("" when it is not): torchrun's ``--nproc-per-node gpu``
    starts one worker per GPU, so a node without GPUs cannot run it (gpu-check fails it)."""
    return "--nproc-per-node gpu" if str(nproc_per_node).strip() == "gpu" else ""


def _int_or_none(value: Any) -> int | None:
    try:
        return int(value)
    except (TypeError, ValueError):
        return None  # torchrun also accepts "auto", "gpu", "cpu"


def _recheck_note(reasons: dict[int, str], taking_part: list[int], nnodes: int) -> str:
    """Why the check ran, unless it was the first check of every node."""
    why = {n: w for n, w in reasons.items() if w and w != NEVER_CHECKED}
    if not why:
        return ""
    said = "; ".join(f"node {n}: {w}" for n, w in sorted(why.items()))
    return f", nodes {taking_part} of {nnodes} checked — {said}"


HISTORY_ITEM = "node-history"
# Pre-check items whose failure is a hardware fault of the node (seed scenario 1), not its setup
# (a full disk, a name that does not resolve: scenario 2).
HARDWARE_ITEMS = frozenset({"gpu-check", "rdma", HISTORY_ITEM})


def history_item(settings: HistorySettings, ctx: MonitorContext) -> ItemResult | None:
    """The pre-check item that reads the site's node history: failed when this host had
    ``--node-history-faults`` hardware-class faults in the window (seed scenario 1: the node is
    isolated before it trains). None when the history is off or cannot be read (said in one line:
    the job goes on without it)."""
    if settings.max_faults <= 0:
        return None
    path = node_history.path_for(settings.path, ctx.run_dir)
    try:
        faults = NodeHistory(path).faults(time.time() - settings.window_s, host=ctx.node)
    except HistoryUnavailable as exc:
        _say(str(exc))
        return None
    refused = node_history.refused_hosts(faults, settings.max_faults).get(ctx.node)
    if refused:
        return ItemResult(HISTORY_ITEM, FAILED, node_history.refusal(ctx.node, refused, settings.window_s),
                          fix=f"repair the host, or remove its rows from {path}",
                          data={"faults": [f.to_dict() for f in refused], "path": str(path)})
    n = len(node_history.counted(faults))
    return ItemResult(HISTORY_ITEM, OK, f"{n} hardware-class fault(s) of {ctx.node} in the window", data={"path": str(path)})


def _record_bench(ctx: MonitorContext, pid: int) -> None:
    """A node-check process started: who it is (``trainguard chaos nodecheck-kill`` verifies it
    against this before it signals the pid)."""
    ctx.events.emit("nodecheck_started", f"node-check process {pid} started",
                    evidence={"pid": pid, "identity": identity.record({0: pid})})


def _say(line: str) -> None:
    """Check lines go to the agent's stderr as they are (users grep them for ``item``)."""
    print(f"[trainguard] {line}", file=sys.stderr, flush=True)


class ChecksMonitor(Monitor):
    name = "checks"

    def __init__(
        self,
        settings: ChecksSettings,
        hardware_check_fn: Callable[[CheckConfig], HardwareReport] | None = None,
        node_check_env: dict[str, str] | None = None,
    ) -> None:
        """``hardware_check_fn`` replaces the GPU health check and ``node_check_env`` adds variables
        to the benchmark processes' environment (tests use them for fault injection)."""
        self.settings = settings
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
        self._memory = NodeCheckMemory(settings.node_check_reuse_s)

    # ------------------------------------------------------------------------- before start

    def on_before_start(self, ctx: MonitorContext) -> CheckOutcome | None:
        outcome = self._precheck_round(ctx) if self.settings.precheck else None
        if outcome is not None and outcome.faulty:
            return outcome  # no benchmark with nodes that failed their pre-check: they leave first
        if self.settings.node_check:
            return self._node_check_round(ctx) or outcome
        return outcome

    def _run_precheck(self, ctx: MonitorContext) -> list[ItemResult]:
        """Every item at this agent's first round; before each later round (a restart of the
        workers) the items about state that changes while training (``RECHECKED_ITEMS``: a disk or
        /dev/shm that filled, a GPU or an RDMA port that went down) run again and the others' first
        results stand."""
        t0 = time.perf_counter()
        if self._precheck is None:
            results = run_checks(self.settings.check)
            history = history_item(self.settings.history, ctx)
            if history is not None:
                results.append(history)
            rechecked: list[str] = []
        else:
            fresh = {r.item: r for r in run_checks(self.settings.check, only=RECHECKED_ITEMS)}
            results = [fresh.get(r.item, r) for r in self._precheck]
            rechecked = [r.item for r in results if r.item in fresh]
        self._precheck = results
        self._record_precheck(ctx, results, rechecked, time.perf_counter() - t0)
        return results

    def _record_precheck(self, ctx: MonitorContext, results: list[ItemResult], rechecked: list[str], elapsed: float) -> None:
        shown = [r for r in results if not rechecked or r.item in rechecked]
        for r in shown:
            _say(r.line())
        ok = passed(results)
        failed = [r for r in results if r.failed]
        when = f" before attempt {ctx.restart_count} (rechecked: {', '.join(rechecked)})" if rechecked else ""
        ctx.events.emit(
            "precheck_passed" if ok else "precheck_failed",
            f"pre-check passed{when}"
            if ok
            else f"pre-check failed{when}: " + "; ".join(f"{r.item}: {r.detail}" for r in failed)[:400],
            severity="info" if ok else "error",
            evidence={"items": [r.to_dict() for r in results], "seconds": round(elapsed, 4), "rechecked": rechecked},
        )

    def _precheck_round(self, ctx: MonitorContext) -> CheckOutcome:
        results = self._run_precheck(ctx)
        mine = {
            "passed": passed(results),
            "failed": [r.line() for r in results if r.failed],
            "hardware_fault": any(r.failed and r.item in HARDWARE_ITEMS for r in results),
            "history_refused": any(r.failed and r.item == HISTORY_ITEM for r in results),
            "node": ctx.node,
        }
        outcomes: dict[int, dict[str, Any] | None] = {ctx.node_rank: mine}
        if ctx.store is not None and ctx.nnodes > 1:
            ctx.store.set(f"{PRECHECK_KEY}/{ctx.node_rank}", json.dumps(mine))
            outcomes = self._gather(ctx, PRECHECK_KEY)
        faulty = {
            n: ("pre-check failed: " + "; ".join(o["failed"])) if o else "no pre-check result (agent gone?)"
            for n, o in outcomes.items()
            if not o or not o.get("passed")
        }
        return CheckOutcome(
            "precheck",
            faulty,
            hardware_faulty=frozenset(n for n, o in outcomes.items() if o and o.get("hardware_fault")),
            names={n: o["node"] for n, o in outcomes.items() if o and o.get("node")},
            details={"outcomes": {str(k): v for k, v in outcomes.items()}},
        )

    def _gather(self, ctx: MonitorContext, prefix: str) -> dict[int, dict[str, Any] | None]:
        """Every node's published value under ``prefix/<node_rank>``; None for nodes that never
        published within --check-wait seconds."""
        deadline = time.monotonic() + self.settings.wait_s
        out: dict[int, dict[str, Any] | None] = {}
        for n in range(ctx.nnodes):
            raw = get_when_set(ctx.store, f"{prefix}/{n}", deadline)
            out[n] = json.loads(raw) if raw is not None else None
        return out

    def _node_check_round(self, ctx: MonitorContext) -> CheckOutcome | None:
        if ctx.store is None:
            log.warning("node check needs the rendezvous store; skipped")
            return None
        cfg = dataclasses.replace(self.settings.node, env={**self.settings.node.env, **self._node_check_env},
                                  hold_file=str(chaos_hold.nodecheck_hold_path(ctx.run_dir)))
        t0 = time.monotonic()
        current = fingerprint(ctx.node, cfg)
        reasons = self._gather_reasons(ctx, self._memory.reason_to_check(current))
        needy = {n for n, why in reasons.items() if why}
        if not needy:
            return self._reused(ctx, reasons)
        everyone = list(range(ctx.nnodes))
        taking_part = everyone if len(needy) == ctx.nnodes else recheck_nodes(everyone, needy)
        metrics: list[dict[str, Any]] = []
        if ctx.node_rank in taking_part:
            checker = NodeChecker(
                ctx.store, ctx.node_rank, ctx.nnodes, cfg, prefix=NODECHECK_PREFIX, say=_say, name=ctx.node,
                nodes=taking_part, on_start=lambda pid: _record_bench(ctx, pid),
            )  # fmt: skip
            verdict = checker.run()
            metrics = checker.metrics
            if ctx.node_rank == taking_part[0] and len(taking_part) < ctx.nnodes:
                ctx.store.set(f"{NODECHECK_PREFIX}/verdict", json.dumps(verdict.to_dict()))
            me_ok = ctx.node_rank not in verdict.faulty and ctx.node_rank not in verdict.stragglers
            self._memory.record(me_ok and not verdict.undetermined, current)
        else:
            verdict = self._wait_verdict(ctx, taking_part, cfg)
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
            f"node check ({elapsed:.1f} s{_recheck_note(reasons, taking_part, ctx.nnodes)}): {summary}",
            severity="warning" if bad else "info",
            evidence={
                "verdict": verdict.to_dict(),
                "node_rank": ctx.node_rank,
                "measurements": metrics,
                "checked": taking_part,
                "why": {str(n): why for n, why in reasons.items() if why},
            },
        )
        return CheckOutcome(
            "node_check",
            dict(verdict.faulty),
            dict(verdict.stragglers),
            verdict.undetermined,
            details={"times_s_per_iteration": verdict.to_dict()["times_s_per_iteration"]},
        )

    def _gather_reasons(self, ctx: MonitorContext, mine: str) -> dict[int, str]:
        """Every node's reason to be rechecked ("" = its last result stands); a node that says
        nothing in time is rechecked."""
        if ctx.nnodes <= 1:
            return {ctx.node_rank: mine}
        ctx.store.set(f"{NODECHECK_PREFIX}/reason/{ctx.node_rank}", json.dumps({"why": mine}))
        got = self._gather(ctx, f"{NODECHECK_PREFIX}/reason")
        return {n: (o["why"] if o is not None else "no answer from its agent") for n, o in got.items()}

    def _reused(self, ctx: MonitorContext, reasons: dict[int, str]) -> CheckOutcome:
        summary = f"all {ctx.nnodes} node(s) have a healthy result from the last {self.settings.node_check_reuse_s:g} s and were not involved in a failure"
        _say(f"node check reused: {summary}")
        verdict = Verdict(nodes=list(range(ctx.nnodes)))
        ctx.events.emit(
            "nodecheck_result",
            f"node check reused: {summary}",
            evidence={"verdict": verdict.to_dict(), "node_rank": ctx.node_rank, "reused": True, "checked": []},
        )
        return CheckOutcome("node_check")

    def _wait_verdict(self, ctx: MonitorContext, taking_part: list[int], cfg: NodeCheckConfig) -> Verdict:
        """The verdict of a recheck this node does not take part in (its first node publishes it)."""
        _say(f"node check: this node's result stands; waiting for the recheck of nodes {taking_part}")
        waves = 4  # at most two per round (an odd node), two rounds
        deadline = time.monotonic() + waves * (cfg.timeout_s + 30.0) + self.settings.wait_s
        raw = get_when_set(ctx.store, f"{NODECHECK_PREFIX}/verdict", deadline)
        if raw is None:
            return Verdict(nodes=taking_part, undetermined=f"no verdict from the recheck of nodes {taking_part}")
        return Verdict.from_dict(json.loads(raw))

    # ------------------------------------------------------------------------ while running

    def on_workers_started(self, ctx: MonitorContext) -> None:
        self._ctx = ctx
        if self.settings.health_interval_s > 0 and self._thread is None:
            self._thread = threading.Thread(target=self._health_loop, name="trainguard-health", daemon=True)
            self._thread.start()

    def _periodic_config(self) -> CheckConfig:
        # Only Xid errors logged since this agent started count as new faults.
        return dataclasses.replace(self.settings.check, xid_window_s=max(1.0, time.time() - self._started_at))

    def _health_loop(self) -> None:
        while not self._stop.wait(self.settings.health_interval_s):
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

    def poll(self, ctx: MonitorContext) -> HardwareFault | None:
        with self._lock:
            if self._fault is None or self._fault_reported:
                return None
            self._fault_reported = True
            faults = list(self._fault.faults)
        self._memory.involve("a periodic hardware check found a fault")
        return HardwareFault(faults, ctx.node, ctx.node_rank)

    def on_workers_failed(self, ctx: MonitorContext, failures: dict[int, RankFailure]) -> HardwareReport | None:
        own = sorted(r for r, f in failures.items() if not f.collateral and not lost_peer(f))
        if own:  # its workers failed of their own, not of a lost peer: recheck it before going on
            self._memory.involve(f"its rank(s) {own} failed")
        try:
            report = self._hardware_check(self._periodic_config())
        except Exception as exc:
            log.warning("hardware check after the failure could not run: %s", exc)
            return None
        ctx.events.emit(
            "hardware_check",
            "hardware healthy after the worker failure"
            if report.healthy
            else "hardware fault after the worker failure: " + "; ".join(report.faults)[:400],
            severity="info" if report.healthy else "critical",
            evidence=report.to_dict(),
        )
        if not report.healthy:
            self._memory.involve("the hardware check after the failure found a fault")
        return report

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)


def settings(options: argparse.Namespace) -> ChecksSettings:
    return ChecksSettings.from_options(options)


def create(settings: ChecksSettings) -> Monitor | None:
    return ChecksMonitor(settings) if settings.enabled else None
