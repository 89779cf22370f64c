"""Runs the node health check across nodes, coordinated through a shared store.

Every node runs ``NodeChecker(store, node_rank, nnodes, cfg).run()`` at the same time with the same
store (the rendezvous store of a ``trainguard run`` round, or the TCPStore of ``trainguard
nodecheck``). The pairing (pure, ``trainguard.detect.nodecheck``) is computed identically on every
node. For each group one member hosts a small TCPStore for the group's process group; every member
starts one benchmark process (``trainguard.checks.bench``) and publishes its result under a
wave-scoped key. Node 0 closes each wave by writing the full result list (missing ones marked
failed), so all nodes continue from the same data and reach the same verdict.
"""

from __future__ import annotations

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
    ) -> None:
        """``nodes``: the node ranks that take part (default all ``nnodes``; a partial recheck
        passes a subset, see ``recheck_nodes``)."""
        self.store = store
        self.me = node_rank
        self.nodes = sorted(nodes) if nodes is not None else list(range(nnodes))
        self.cfg = cfg or NodeCheckConfig()
        self.prefix = prefix
        self.say = say or (lambda msg: log.info("%s", msg))
        self.name = name or f"node{node_rank}"
        self.addr = self.cfg.advertise_addr or guess_advertise_addr(self.cfg.peer_host)
        self.metrics: list[dict[str, Any]] = []  # this node's full benchmark outputs
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
        deadline = time.monotonic() + self.cfg.timeout_s + 15.0
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
        raw = self._get(f"{gbase}/addr", deadline)
        if raw is None:
            return self._fail(gbase, group, f"node {host} never published its group store")
        h, _, p = raw.decode().rpartition(":")
        return self._run_bench(gbase, group, h, int(p), deadline)

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

    def _command(self, host: str, port: int, group: Group) -> list[str]:
        c = self.cfg
        return [
            sys.executable, "-m", "trainguard.checks.bench",
            "--store-host", host, "--store-port", str(port),
            "--rank", str(group.index(self.me)), "--world-size", str(len(group)),
            "--backend", c.backend, "--device", c.device,
            "--gemm-n", str(c.gemm_n), "--coll-mb", str(c.coll_mb),
            "--iters", str(c.iters), "--warmup", str(c.warmup), "--timeout", str(c.timeout_s), "--sync",
        ]  # fmt: skip

    def _run_bench(self, gbase: str, group: Group, host: str, port: int, deadline: float) -> TestResult:
        partners = [n for n in group if n != self.me]
        abort_keys = [f"{gbase}/abort/{n}" for n in partners]
        with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
            proc = subprocess.Popen(
                self._command(host, port, group),
                stdout=out,
                stderr=err,
                stdin=subprocess.PIPE,
                text=True,
                env={**os.environ, **self.cfg.env},
                start_new_session=True,  # its own process group: killed as a whole below
            )
            why = ""
            ready_at: float | None = None
            started = False
            try:
                while proc.poll() is None:
                    if not started:
                        if ready_at is None and READY_LINE in _read_all(out):
                            ready_at = time.monotonic()
                            self._set_ready("ok")
                        if ready_at is not None and (
                            self._wave_ready() or time.monotonic() - ready_at > READY_GRACE_S
                        ):
                            _send_go(proc)
                            started = True
                    if time.monotonic() > deadline:
                        why = f"timed out after {self.cfg.timeout_s:.0f} s"
                        break
                    gone = [k for k in abort_keys if self.store.check([k])]
                    if gone:
                        who = ", ".join(k.rsplit("/", 1)[1] for k in gone)
                        why = f"aborted: partner node {who} failed"
                        break
                    time.sleep(POLL_S)
            finally:
                if proc.poll() is None:
                    _kill_group(proc)
                if proc.stdin is not None and not proc.stdin.closed:
                    proc.stdin.close()
            out.seek(0)
            err.seek(0)
            stdout, stderr = out.read(), err.read()
        if why:
            return self._fail(gbase, group, why)
        data = _parse_result(stdout)
        if proc.returncode != 0 or not data.get("ok"):
            tail = data.get("error") or stderr.strip().splitlines()[-1:] or [""]
            msg = tail if isinstance(tail, str) else tail[0]
            return self._fail(gbase, group, f"check process exit {proc.returncode}: {msg}"[:400])
        self.metrics.append({"group": list(group), **data})
        return TestResult(
            node=self.me,
            group=group,
            ok=True,
            gemm_s=data["gemm_s"],
            allreduce_s=data["allreduce_s"],
            allgather_s=data["allgather_s"],
        )


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
