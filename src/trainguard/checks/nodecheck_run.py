"""Runs the node health check across nodes, coordinated through a shared store.

Every node runs ``NodeChecker(store, node_rank, nnodes, cfg).run()`` at the same time with the same
store (the rendezvous store of a ``trainguard run`` round, or the TCPStore of ``trainguard
nodecheck``). The pairing (pure, ``trainguard.detect.nodecheck``) is computed identically on every
node. For each group one member hosts a small TCPStore for the group's process group; every member
starts one benchmark process (``trainguard.checks.bench``) per GPU (``local_procs``: one on the
CPU, or ``procs`` gloo processes) and publishes the node's result (its slowest process) under a
wave-scoped key. Node 0 closes each wave by writing the full result list (missing ones marked
failed), so all nodes continue from the same data and reach the same verdict.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from trainguard.checks.bench import READY_LINE, RESULT_PREFIX
from trainguard.checks.burn import node_burn
from trainguard.checks.sweep import largest_times, node_sweep
from trainguard.cluster.stores import ForgedValue, address_toward, bound_store
from trainguard.detect.nodecheck import (
    Group,
    TestResult,
    Verdict,
    first_round_waves,
    missing_results,
    round_one_suspects,
    second_round_waves,
    tested_pairs,
    verdict,
)

log = logging.getLogger(__name__)
POLL_S = 0.05
READY_GRACE_S = 20.0  # start measuring at most this long after this node was ready


@dataclass
class NodeCheckConfig:
    backend: str = "auto"  # gloo / nccl / auto (nccl with CUDA)
    device: str = "auto"
    gemm_n: int = 0  # 0: the benchmark's default for the device
    coll_mb: float = 0.0
    iters: int = 10
    warmup: int = 2
    timeout_s: float = 120.0  # one group test: process start, group setup and benchmark
    straggler_k: float = 3.0
    straggler_ratio: float = 2.0
    advertise_addr: str | None = None  # address peers use to reach this node's group store
    peer_host: str | None = None  # a host to route to when guessing advertise_addr (rendezvous)
    env: dict[str, str] = field(default_factory=dict)  # extra env for the benchmark process
    hold_file: str | None = None  # the benchmark waits while this file exists (a drill's hold)
    procs: int = 0  # benchmark processes per node (0: one per visible GPU with CUDA, else one)
    burn_s: float = 0.0  # seconds of sustained GEMM load after the check (`nodecheck --burn`)
    sweep: bool = False  # message-size sweep of the collectives (`nodecheck --sweep`)
    sweep_max_mb: float = 0.0  # largest sweep size in MiB (0: 64 on GPU, 8 on CPU)

    @property
    def group_timeout_s(self) -> float:
        """The limit of one group test: the burn runs on top of the usual check."""
        return self.timeout_s + self.burn_s


def local_procs(cfg: NodeCheckConfig) -> int:
    """How many benchmark processes this node runs: ``cfg.procs`` when given, else one per GPU the
    benchmark will see (its CUDA_VISIBLE_DEVICES, else this process's), else one (the CPU)."""
    if cfg.procs:
        return cfg.procs
    if cfg.device == "cpu":
        return 1
    try:
        import torch

        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:  # no usable CUDA: the CPU check
        gpus = 0
    visible = cfg.env.get("CUDA_VISIBLE_DEVICES")
    if gpus and visible is not None:
        gpus = min(gpus, len([d for d in visible.split(",") if d.strip()]))
    return max(1, gpus)


def guess_advertise_addr(peer_host: str | None) -> str:
    """The local address on the route to ``peer_host`` (no packet is sent), else this host's name."""
    return address_toward(peer_host)


class NodeChecker:
    def __init__(
        self,
        store: Any,
        node_rank: int,
        nnodes: int,
        cfg: NodeCheckConfig | None = None,
        prefix: str = "trainguard/nodecheck",
        say: Callable[[str], None] | None = None,
        name: str | None = None,
        nodes: list[int] | None = None,
        on_start: Callable[[int], None] | None = None,
    ) -> None:
        """``nodes``: the node ranks that take part (default all ``nnodes``; a partial recheck
        passes a subset, see ``recheck_nodes``). ``on_start`` is told the pid of each benchmark
        process this node starts (the agent records it, so a drill can find the process)."""
        self.store = store
        self.me = node_rank
        self.nodes = sorted(nodes) if nodes is not None else list(range(nnodes))
        self.cfg = cfg or NodeCheckConfig()
        self.prefix = prefix
        self.say = say or (lambda msg: log.info("%s", msg))
        self.name = name or f"node{node_rank}"
        self.addr = self.cfg.advertise_addr or guess_advertise_addr(self.cfg.peer_host)
        self.metrics: list[dict[str, Any]] = []  # this node's full benchmark outputs
        self.on_start = on_start
        self._procs = local_procs(self.cfg)
        self._servers: list[Any] = []
        self._wave_base = ""
        self._wave_members: list[int] = []

    # ------------------------------------------------------------------------------ rounds

    def run(self) -> Verdict:
        cfg = self.cfg
        self.store.set(f"{self.prefix}/name/{self.me}", self.name)
        results: list[TestResult] = []
        for w, groups in enumerate(first_round_waves(self.nodes)):
            results += self._run_wave(1, w, groups)
        suspects = round_one_suspects(self.nodes, results, cfg.straggler_k, cfg.straggler_ratio)
        healthy = [n for n in self.nodes if n not in suspects]
        if suspects:
            self.say(f"node check round 1: suspects {suspects}, healthy {healthy}")
        for w, groups in enumerate(second_round_waves(suspects, healthy, tested_pairs(results))):
            results += self._run_wave(2, w, groups)
        v = verdict(self.nodes, results, cfg.straggler_k, cfg.straggler_ratio)
        v.names = self._names()
        return v

    def _names(self) -> dict[int, str]:
        """Node rank -> node name, for the nodes that published one (ranks change between rounds)."""
        out = {}
        for n in self.nodes:
            key = f"{self.prefix}/name/{n}"
            if self.store.check([key]):
                out[n] = self.store.get(key).decode(errors="replace")
        return out

    def _run_wave(self, round_no: int, wave: int, groups: list[Group]) -> list[TestResult]:
        base = f"{self.prefix}/r{round_no}/w{wave}"
        deadline = time.monotonic() + self.cfg.group_timeout_s + 15.0
        self._wave_base, self._wave_members = base, sorted({n for g in groups for n in g})
        try:
            for gid, group in enumerate(groups):
                if self.me in group:
                    res = self._run_group(f"{base}/g{gid}", group, deadline)
                    self.store.set(f"{base}/res/{self.me}", json.dumps(res.to_dict()))
            return self._collect(base, groups, deadline)
        finally:
            self._servers.clear()  # the group stores live until the wave is closed

    def _collect(self, base: str, groups: list[Group], deadline: float) -> list[TestResult]:
        members = sorted({n for g in groups for n in g})
        if self.me == self.nodes[0]:
            results = self._read_results(base, members, deadline)
            results += missing_results(groups, results)
            self.store.set(f"{base}/final", json.dumps([r.to_dict() for r in results]))
            return results
        final = self._get(f"{base}/final", deadline + 15.0)
        if final is not None:
            return [TestResult.from_dict(d) for d in json.loads(final)]
        # Node 0 is gone: go on with what this node can see.
        results = self._read_results(base, members, time.monotonic())
        return results + missing_results(groups, results)

    def _read_results(self, base: str, members: list[int], deadline: float) -> list[TestResult]:
        out = []
        for n in members:
            raw = self._get(f"{base}/res/{n}", deadline)
            if raw is not None:
                out.append(TestResult.from_dict(json.loads(raw)))
        return out

    def _get(self, key: str, deadline: float) -> bytes | None:
        """The key's value once it exists, or None at the deadline."""
        return get_when_set(self.store, key, deadline)

    # ------------------------------------------------------------------------------- group

    def _run_group(self, gbase: str, group: Group, deadline: float) -> TestResult:
        host = group[-1]
        if self.me == host:
            # Listening on the address this node is reached through only (never every interface).
            server = bound_store(self.addr, timeout_s=self.cfg.timeout_s)
            self._servers.append(server)
            self.store.set(f"{gbase}/addr", f"{self.addr}:{server.port}")
        self.store.set(f"{gbase}/procs/{self.me}", str(self._procs))
        raw = self._get(f"{gbase}/addr", deadline)
        if raw is None:
            return self._fail(gbase, group, f"node {host} never published its group store")
        counts = {}
        for n in group:  # every member's process count: the ranks are numbered across the group
            got = self._get(f"{gbase}/procs/{n}", deadline)
            if got is None:
                return self._fail(gbase, group, f"node {n} never said how many check processes it runs")
            counts[n] = int(got)
        h, _, p = raw.decode().rpartition(":")
        first = sum(counts[n] for n in group[: group.index(self.me)])
        return self._run_bench(gbase, group, (h, int(p)), (first, sum(counts.values())), deadline)

    def _fail(self, gbase: str, group: Group, error: str) -> TestResult:
        try:
            self.store.set(f"{gbase}/abort/{self.me}", error)
            self._set_ready("failed")  # nobody in the wave waits for a node that failed
        except Exception as exc:
            log.warning("could not publish node-check abort: %s", exc)
        return TestResult(node=self.me, group=group, ok=False, error=error)

    def _set_ready(self, value: str) -> None:
        self.store.set(f"{self._wave_base}/ready/{self.me}", value)

    def _wave_ready(self) -> bool:
        return all(self.store.check([f"{self._wave_base}/ready/{n}"]) for n in self._wave_members)

    def _command(self, host: str, port: int, rank: int, world: int, local_rank: int) -> list[str]:
        c = self.cfg
        return [
            sys.executable, "-m", "trainguard.checks.bench",
            "--store-host", host, "--store-port", str(port),
            "--rank", str(rank), "--world-size", str(world), "--local-rank", str(local_rank),
            "--backend", c.backend, "--device", c.device,
            "--gemm-n", str(c.gemm_n), "--coll-mb", str(c.coll_mb),
            "--iters", str(c.iters), "--warmup", str(c.warmup), "--timeout", str(c.group_timeout_s), "--sync",
            *(["--hold-file", c.hold_file] if c.hold_file else []),
            *(["--burn", str(c.burn_s)] if c.burn_s > 0 else []),
            *(["--sweep", "--sweep-max-mb", str(c.sweep_max_mb)] if c.sweep else []),
        ]  # fmt: skip

    def _run_bench(self, gbase: str, group: Group, store: tuple[str, int], ranks: tuple[int, int],
                   deadline: float) -> TestResult:  # fmt: skip
        """This node's benchmark processes (ranks ``first .. first+procs-1`` of ``world``), watched
        until they all finish, one fails, the deadline passes or a partner aborts."""
        (host, port), (first, world) = store, ranks
        procs = _BenchProcs([self._command(host, port, first + i, world, i) for i in range(self._procs)],
                            {**os.environ, **self.cfg.env})  # fmt: skip
        try:
            for pid in procs.pids():
                if self.on_start is not None:
                    self.on_start(pid)
            why = self._watch(procs, gbase, group, deadline)
        finally:
            procs.close()
        if why:
            return self._fail(gbase, group, why)
        failed = procs.failure()
        if failed:
            return self._fail(gbase, group, failed[:400])
        data = procs.node_result()
        self.metrics.append({"group": list(group), **data})
        fault = data.get("burn", {}).get("fault", "")
        if fault:  # a wrong result is this node's own fault: no abort for the partner, its test passed
            return TestResult(node=self.me, group=group, ok=False, error=fault[:400])
        return TestResult(node=self.me, group=group, ok=True, **_judged_times(data))

    def _watch(self, procs: _BenchProcs, gbase: str, group: Group, deadline: float) -> str:
        """Wait for the processes; why they were stopped ("" when they all ended by themselves)."""
        abort_keys = [f"{gbase}/abort/{n}" for n in group if n != self.me]
        ready_at: float | None = None
        started = False
        while procs.running() and not procs.any_failed():
            if not started:
                if ready_at is None and procs.all_ready():
                    ready_at = time.monotonic()
                    self._set_ready("ok")
                if ready_at is not None and (self._wave_ready() or time.monotonic() - ready_at > READY_GRACE_S):
                    procs.go()
                    started = True
            if time.monotonic() > deadline:
                return f"timed out after {self.cfg.group_timeout_s:.0f} s"
            gone = [k for k in abort_keys if self.store.check([k])]
            if gone:
                return f"aborted: partner node {', '.join(k.rsplit('/', 1)[1] for k in gone)} failed"
            time.sleep(POLL_S)
        return ""


class _BenchProcs:
    """A node's benchmark processes, each in its own session (killed as a whole), with its output
    in temporary files."""

    def __init__(self, commands: list[list[str]], env: dict[str, str]) -> None:
        self._files: list[tuple[Any, Any]] = []
        self.procs: list[subprocess.Popen[str]] = []
        for cmd in commands:
            out, err = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")
            self._files.append((out, err))
            self.procs.append(subprocess.Popen(cmd, stdout=out, stderr=err, stdin=subprocess.PIPE, text=True, env=env,
                                               start_new_session=True))  # fmt: skip
        self.results: list[tuple[int | None, dict[str, Any], str]] = []
        self.killed: set[int] = set()

    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def running(self) -> bool:
        return any(p.poll() is None for p in self.procs)

    def any_failed(self) -> bool:
        """One process ended with an error: its partners would wait for it in a collective."""
        return any(p.poll() not in (None, 0) for p in self.procs)

    def all_ready(self) -> bool:
        return all(READY_LINE in _read_all(out) for out, _err in self._files)

    def go(self) -> None:
        for p in self.procs:
            _send_go(p)

    def close(self) -> None:
        """Kill what still runs, keep every process's exit code and output."""
        for i, p in enumerate(self.procs):
            if p.poll() is None:
                self.killed.add(i)  # stopped by us: not the process that failed
                _kill_group(p)
            if p.stdin is not None and not p.stdin.closed:
                with contextlib.suppress(OSError):
                    p.stdin.close()
        for p, (out, err) in zip(self.procs, self._files, strict=True):
            out.seek(0)
            err.seek(0)
            self.results.append((p.returncode, _parse_result(out.read()), err.read()))
            out.close()
            err.close()

    def failure(self) -> str:
        """Why the first failed process failed ("" when all succeeded)."""
        order = sorted(range(len(self.results)), key=lambda i: i in self.killed)  # the cause first
        for i in order:
            code, data, stderr = self.results[i]
            if code != 0 or not data.get("ok"):
                tail = data.get("error") or stderr.strip().splitlines()[-1:] or [""]
                msg = tail if isinstance(tail, str) else tail[0]
                if not msg and code is not None and code < 0:
                    msg = f"killed by {signal.Signals(-code).name}"
                who = f" (GPU/process {i})" if len(self.results) > 1 else ""
                return f"check process exit {code}{who}: {msg}"
        return ""

    def node_result(self) -> dict[str, Any]:
        """The node's measurements: a node is as slow as its slowest GPU (each time is the max over
        its processes; the bandwidths are those of that time), every process's own below."""
        per = [data for _c, data, _e in self.results]
        slowest = {k: max(per, key=lambda d, k=k: d[k]) for k in ("gemm_s", "allreduce_s", "allgather_s")}
        out = dict(per[0])
        out.update({k: slowest["gemm_s"][k] for k in ("gemm_s", "gemm_tflops")})
        for op in ("allreduce", "allgather"):
            out.update({k: slowest[f"{op}_s"][k] for k in (f"{op}_s", f"{op}_algbw_gbps", f"{op}_busbw_gbps")})
        out["procs"] = len(per)
        if any("burn_iters" in d for d in per):
            out["burn"] = node_burn(per)
            for k in ("burn_step_s", "burn_gflop_per_step", "burn_checksum", "burn_wrong", "burn_iters", "burn_seconds",
                      "burn_sustained_gflops"):  # fmt: skip
                out.pop(k, None)  # per process, in out["burn"]["processes"]
        if "sweep" in per[0]:
            out["sweep"] = node_sweep(per, out["world_size"])
        out["gemm_s_per_device"] = [d["gemm_s"] for d in per]
        out["per_process"] = [{k: d.get(k) for k in ("device", "rank", "gemm_s", "allreduce_s", "allgather_s")}
                              for d in per]  # fmt: skip
        return out


def _judged_times(data: dict[str, Any]) -> dict[str, float]:
    """The times the verdict judges: the short check's, or with ``--burn`` the sustained GEMM time
    (seconds per matmul at the slowest process's sustained rate), with ``--sweep`` the collectives
    at the sweep's largest size."""
    out = {k: data[k] for k in ("gemm_s", "allreduce_s", "allgather_s")}
    burn = data.get("burn")
    if burn and burn["sustained_gflops"] > 0:
        out["gemm_s"] = 2 * data["burn_n"] ** 3 / (burn["sustained_gflops"] * 1e9)
    if "sweep" in data:
        out["allreduce_s"], out["allgather_s"] = largest_times(data["sweep"])
    return out


def get_when_set(store: Any, key: str, deadline: float) -> bytes | None:
    """Poll ``key`` until it exists (then return its value) or the monotonic ``deadline`` passes.
    Polling with check(): store.wait() logs a c10d warning every time it times out. A forged
    value (through the agents' ``SignedStore``: reported) counts as not set yet."""
    while True:
        if store.check([key]):
            try:
                return store.get(key)
            except ForgedValue:
                pass
        if time.monotonic() >= deadline:
            return None
        time.sleep(POLL_S)


def _read_all(f: Any) -> str:
    f.seek(0)
    return f.read()


def _send_go(proc: subprocess.Popen[Any]) -> None:
    try:
        assert proc.stdin is not None
        proc.stdin.write("go\n")
        proc.stdin.close()
    except (OSError, ValueError):
        pass  # it died meanwhile: the loop sees its exit code


def _parse_result(stdout: str) -> dict[str, Any]:
    for line in reversed(stdout.splitlines()):
        if line.startswith(RESULT_PREFIX):
            try:
                return json.loads(line[len(RESULT_PREFIX) :])
            except ValueError:
                break
    return {}


def _kill_group(proc: subprocess.Popen[Any]) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        log.error("node-check process %d did not die after SIGKILL", proc.pid)
