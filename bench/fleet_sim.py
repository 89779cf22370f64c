"""The fleet simulation's engine (bench/fleet.py prints it): one training job at N ranks over D
simulated days, failures drawn per node from a published mix, and every decision made by the
real ``trainguard.policy`` on synthetic evidence of its real types.

Time is accounted the way bench/soak_accounting.py does for the soak: the wall time is split into
parts that sum to it. Training time makes progress (in seconds of full-world training); the
checkpoint stall and a shrunk world take their share of it; a failure rolls the progress back to
the newest snapshot or checkpoint (the work redone), and the job is down for a sequence of
phases (detection, restart, waiting for a replacement) drawn from the calibration file. A failure
that lands while the job is down for a re-queue or a replacement is absorbed (the nodes are idle,
the new allocation or the replacement covers it); one that lands while it detects or restarts
starts the recovery over. ETTR = the progress kept at the end / the wall time.

Rows, all on the same failures (same times, nodes and random draws):

- ``torchrun``: every failure ends the job (a hang or a lost node only when the NCCL watchdog
  fires); the scheduler re-launches it, which reloads the newest ``torch.save`` checkpoint.
- ``trainguard``: the policy decides (restart in place, exclude the node and re-form, wait for a
  replacement, promote a standby, stop the job); a stopped job is re-launched by the scheduler.
- ``trainguard+standby``: the same with warm standby nodes, refilled by the scheduler.
"""

from __future__ import annotations

import heapq
import json
import math
import random
import statistics
from collections import Counter
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from trainguard import policy as P
from trainguard.cluster.node_history import DEFAULT_FAULTS, NodeFault, refused_hosts
from trainguard.evidence import AttemptRecord, HangEvidence, HardwareReport, NodeLost, PeerLeft, RankFailure
from trainguard.policy import Action, Decision

RANKS_PER_NODE = 8
GROUPS = ("gpu", "hbm", "network", "host", "software", "hang")
# What each class of failure looks like to trainguard: a hardware fault on a node (the worker dies
# with a GPU error and the hardware check after it finds the fault), a node lost (no heartbeat),
# a Python exception of the training code, a stuck collective.
EVIDENCE = {"gpu": "hardware", "hbm": "hardware", "network": "node_lost", "host": "node_lost",
            "software": "exception", "hang": "hang"}  # fmt: skip
STALL, DETECT, RESTART, REDONE, SHRUNK, WAITING = (
    "checkpoint stall", "detection", "restart", "redone work", "shrunk world", "waiting for a replacement")
PARTS = (STALL, DETECT, RESTART, REDONE, SHRUNK, WAITING)
HERE = Path(__file__).resolve().parent
DEFAULT_RATES = HERE / "fleet_rates_llama3.json"
DEFAULT_CALIBRATION = HERE / "fleet_calibration.json"


# ------------------------------------------------------------------------------ inputs


@dataclass(frozen=True)
class Rates:
    per_node_hour: float  # failures per node per hour
    weights: dict[str, float]  # group -> share (sums to 1)
    source: str

    @classmethod
    def from_dict(cls, data: Any) -> Rates:
        """A rates file (the format of fleet_rates_llama3.json); ValueError says what is wrong."""
        if not isinstance(data, dict):
            raise ValueError("a rates file holds one JSON object")
        try:
            n, days, gpus = float(data["interruptions"]), float(data["days"]), float(data["gpus"])
            causes = data["causes"]
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"a rates file needs numbers 'interruptions', 'days', 'gpus' and 'causes' ({exc})") from None
        if not all(math.isfinite(v) for v in (n, days, gpus)) or n < 0 or days <= 0 or gpus < RANKS_PER_NODE:
            raise ValueError("'interruptions' must be >= 0, 'days' > 0, 'gpus' >= 8")
        weights = _weights(causes)
        return cls(n / (days * 24.0 * gpus / RANKS_PER_NODE), weights, str(data.get("source", "")))


def _weights(causes: Any) -> dict[str, float]:
    if not isinstance(causes, dict) or not causes:
        raise ValueError("'causes' must map a cause to [share, group]")
    totals: Counter[str] = Counter()
    for name, entry in causes.items():
        if not (isinstance(entry, list) and len(entry) == 2 and entry[1] in GROUPS):
            raise ValueError(f"cause {name!r}: [share, group] with group one of {', '.join(GROUPS)}")
        share = entry[0]
        if isinstance(share, bool) or not isinstance(share, int | float) or not math.isfinite(share) or share < 0:
            raise ValueError(f"cause {name!r}: the share must be a number >= 0")
        totals[entry[1]] += float(share)
    whole = sum(totals.values())
    if whole <= 0:
        raise ValueError("'causes' shares sum to 0")
    return {g: totals[g] / whole for g in GROUPS if totals[g] > 0}


def load_json(path: Path) -> Any:
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: cannot be read as JSON ({exc})") from None


class Calibration:
    """The calibration file's values; ``draw`` turns one into a time from a uniform draw ``u``."""

    def __init__(self, data: dict[str, Any]) -> None:
        self.measured: dict[str, dict[str, Any]] = data["measured"]
        self.assumed: dict[str, dict[str, Any]] = data["assumed"]
        self.dates = str(data.get("dates", ""))

    def value(self, name: str) -> float:
        return float(self.assumed[name]["value"] if name in self.assumed else self.measured[name]["value"])

    def draw(self, name: str, u: float) -> float:
        """(min, max): uniform; (median, max): log-normal with that median, its 99th percentile at
        the max, cut at the max (the measured max is the longest seen in ~10 tries)."""
        spec = self.measured[name]
        if "min" in spec:
            return float(spec["min"]) + u * (float(spec["max"]) - float(spec["min"]))
        median, top = float(spec["median"]), float(spec["max"])
        sigma = math.log(top / median) / 2.326
        z = statistics.NormalDist().inv_cdf(min(max(u, 1e-9), 1 - 1e-9))
        return min(top, median * math.exp(sigma * z))


@dataclass(frozen=True)
class Failure:
    t: float  # seconds since the start
    group: str
    slot: float  # which node of the job, as a fraction (the same node slot in every row)
    rank: int  # local rank 0-7
    u: tuple[float, float, float]  # the draws of its detection, restart and re-form times


def draw_failures(rates: Rates, nodes: int, days: float, multiplier: float, seed: str) -> list[Failure]:
    """Poisson failures over the job's nodes (each node fails at ``rates.per_node_hour`` times
    ``multiplier``), their class by the weights; deterministic for ``seed``."""
    rng = random.Random(seed)
    rate = rates.per_node_hour * multiplier * nodes / 3600.0
    groups, weights = list(rates.weights), list(rates.weights.values())
    out: list[Failure] = []
    t, end = 0.0, days * 86400.0
    while rate > 0:
        t += rng.expovariate(rate)
        if t >= end:
            break
        group = rng.choices(groups, weights)[0]
        out.append(Failure(t, group, rng.random(), rng.randrange(RANKS_PER_NODE),
                           (rng.random(), rng.random(), rng.random())))  # fmt: skip
    return out


@dataclass(frozen=True)
class Scenario:
    ranks: int
    days: float = 30.0
    standbys: int = 0
    elastic_slack: float = 0.0  # the share of nodes the job may go on without (--nnodes MIN:MAX)
    restart_on_error: bool = False
    max_restarts: int = 100
    ckpt_minutes: float | None = None  # torchrun's checkpoint interval; None: Young/Daly

    @property
    def nodes(self) -> int:
        return self.ranks // RANKS_PER_NODE

    @property
    def min_nodes(self) -> int:
        return self.nodes - int(self.nodes * self.elastic_slack)


# ------------------------------------------------------------------------------ accounting


@dataclass
class Timeline:
    """The job's wall time split into parts: training (progress, stall, shrunk world) and the
    down phases a failure schedules."""

    rate: float  # progress per second of full-world training (1 - the checkpoint stall's share)
    now: float = 0.0
    progress: float = 0.0
    restored: float = 0.0  # the last point restored to (a checkpoint exists there)
    world: float = 1.0  # share of the nodes training
    down: list[tuple[str, float]] = field(default_factory=list)  # (part, end time), in order
    parts: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PARTS, 0.0))

    def advance(self, to: float) -> None:
        while self.now < to:
            if self.down:
                part, end = self.down[0]
                stop = min(end, to)
                self.parts[part] += stop - self.now
                self.now = stop
                if end <= to:
                    self.down.pop(0)
                continue
            dt = to - self.now
            self.progress += dt * self.world * self.rate
            self.parts[STALL] += dt * self.world * (1 - self.rate)
            self.parts[SHRUNK] += dt * (1 - self.world)
            self.now = to

    def phase(self) -> str | None:
        return self.down[0][0] if self.down else None

    def go_down(self, phases: list[tuple[str, float]]) -> None:
        """Down from now for these phases (what was left of an earlier recovery is dropped)."""
        self.down, t = [], self.now
        for part, seconds in phases:
            t += max(0.0, seconds)
            self.down.append((part, t))

    def restore(self, point: float) -> None:
        point = max(self.restored, min(point, self.progress))
        self.parts[REDONE] += self.progress - point
        self.progress = self.restored = point

    def ettr(self) -> float:
        return self.progress / self.now if self.now else 1.0


@dataclass(frozen=True)
class TraceEntry:
    t: float
    group: str
    node: str
    action: str  # the policy's Action value (torchrun: "relaunch"; "absorbed": hit a job already down)
    source: str
    reason: str


@dataclass
class RowResult:
    name: str
    ettr: float
    parts: dict[str, float]  # share of the wall time
    trace: list[TraceEntry]
    note: str  # how it checkpoints
    stall_share: float  # the checkpoint stall's share of training time (ETTR without failures: 1 - it)
    history_records: int = 0
    relaunches: dict[str, int] = field(default_factory=dict)  # trainguard: why the scheduler re-launched it
    refused_hosts: int = 0

    def actions(self) -> Counter[str]:
        return Counter(e.action for e in self.trace)


# ------------------------------------------------------------------------------ rows


class Row:
    """One way of running the job over the failures: ``on_failure`` says what a failure costs."""

    name = ""

    def __init__(self, scn: Scenario, cal: Calibration, rate: float, seed: str) -> None:
        self.scn, self.cal = scn, cal
        self.tl = Timeline(rate)
        self.trace: list[TraceEntry] = []
        self.init_s = cal.value("init_s_per_log2_ranks") * math.log2(scn.ranks)
        self.requeue_s = cal.value("requeue_s")
        self.step_s = cal.value("step_s")
        self.arrivals: list[tuple[float, int, str]] = []  # (time, seq, "standby" | "grow")
        self.rng = random.Random(f"{seed}-arrivals")

    def run(self, failures: list[Failure], end: float) -> None:
        for f in failures:
            self._arrivals_until(f.t)
            self.tl.advance(f.t)
            if self.tl.phase() == WAITING:  # down for a re-queue or a replacement: nodes idle
                self.trace.append(TraceEntry(f.t, f.group, "", "absorbed", "", "the job was down, waiting"))
                continue
            self.on_failure(f)
        self._arrivals_until(end)
        self.tl.advance(end)

    def _arrivals_until(self, t: float) -> None:
        while self.arrivals and self.arrivals[0][0] <= t:
            when, _, kind = heapq.heappop(self.arrivals)
            self.tl.advance(when)
            self.arrive(kind)

    def arrive(self, kind: str) -> None:
        raise NotImplementedError

    def on_failure(self, f: Failure) -> None:
        raise NotImplementedError


def young_daly_s(stall_s: float, mtbf_s: float) -> float:
    """Young's interval sqrt(2 C M) between checkpoints of cost C for a mean time between failures M."""
    return math.sqrt(2.0 * stall_s * mtbf_s)


class TorchrunRow(Row):
    """torchrun as users run it today: every failure ends the job (hangs and lost peers when the
    NCCL watchdog fires), the scheduler re-launches it from the newest torch.save checkpoint."""

    name = "torchrun"

    def __init__(self, scn: Scenario, cal: Calibration, mtbf_s: float, seed: str) -> None:
        stall = cal.value("torch_save_stall_ms_per_126mb") / 1000.0 * cal.value("state_mb_per_rank") / 126.0
        horizon = scn.days * 86400.0
        if scn.ckpt_minutes is not None:
            every, how = scn.ckpt_minutes * 60.0, f"every {scn.ckpt_minutes:g} min (given)"
        else:
            every = min(horizon, young_daly_s(stall, mtbf_s))
            how = (f"every {every / 60:.1f} min (Young/Daly: sqrt(2 x {stall:.3f} s stall x {mtbf_s / 3600:.2f} h "
                   "job MTBF))")  # fmt: skip
        super().__init__(scn, cal, every / (every + stall), seed)
        self.every = every
        self.note = f"torch.save {how}, stall {stall:.3f} s per save"

    def on_failure(self, f: Failure) -> None:
        stuck = EVIDENCE[f.group] in ("hang", "node_lost")  # the others wait in a collective
        self.tl.restore(math.floor(self.tl.progress / self.every) * self.every)
        self.tl.go_down([
            (DETECT, self.cal.value("nccl_watchdog_s") if stuck else self.cal.value("crash_detect_s")),
            (RESTART, self.cal.draw("torchrun_restart_s", f.u[1])),
            (WAITING, self.requeue_s),
            (RESTART, self.cal.draw("torchrun_launch_s", f.u[2]) + self.init_s + self.cal.value("ckpt_load_s")),
        ])  # fmt: skip
        why = "NCCL watchdog timeout" if stuck else "a worker exited"
        self.trace.append(TraceEntry(f.t, f.group, "", "relaunch", "torchrun", f"{why}: the scheduler re-launches the job"))

    def arrive(self, kind: str) -> None:  # never scheduled: the re-launch replaces the node
        return None


def _error_file(message: str) -> dict[str, Any]:
    """The shape torch elastic's @record writes (the agent passes it on as error_file_data)."""
    return {"message": {"message": message, "extraInfo": {"py_callstack": "", "timestamp": "0"}}}


HARDWARE_TEXT = {  # group -> (the worker's error, the hardware check's fault)
    "gpu": ("RuntimeError: CUDA error: unspecified launch failure", "GPU {r}: Xid 79 (GPU has fallen off the bus)"),
    "hbm": ("RuntimeError: CUDA error: uncorrectable ECC error encountered",
            "GPU {r}: 2 uncorrectable ECC error(s) since driver load"),
}  # fmt: skip
USER_ERROR = "IndexError: index 4096 is out of bounds for dimension 0 with size 4096"


class TrainguardRow(Row):
    """trainguard: the real policy decides on each failure; the decision drives the job."""

    def __init__(self, scn: Scenario, cal: Calibration, mtbf_s: float, seed: str) -> None:
        stall = cal.value("tg_snapshot_stall_ms_per_126mb") / 1000.0 * cal.value("state_mb_per_rank") / 126.0
        step = cal.value("step_s")
        k = max(1, round(min(scn.days * 86400.0, young_daly_s(stall, mtbf_s)) / step))
        super().__init__(scn, cal, k * step / (k * step + stall), seed)
        self.name = f"trainguard+standby({scn.standbys})" if scn.standbys else "trainguard"
        self.snapshot = k * step
        self.note = (f"in-memory snapshot every {k} step(s) of {step:g} s (Young/Daly), stall {stall * 1000:.1f} ms "
                     "per snapshot")  # fmt: skip
        self.settings = P.PolicySettings(nnodes=f"{scn.min_nodes}:{scn.nodes}", restart_on_error=scn.restart_on_error)
        self.slots = [f"node{i}" for i in range(scn.nodes)]
        self.minted = scn.nodes + scn.standbys
        self.active, self.standbys, self.used = scn.nodes, scn.standbys, 0
        self.attempt = 0
        self.attempts: list[tuple[int, str, str, int]] = []  # (attempt, failing node, kind, step)
        self.history: list[NodeFault] = []
        self.relaunches = {"stopped": 0, "budget spent": 0}  # times the scheduler launched the job again

    # ---- deciding: synthetic evidence of the real types, the real policy
    def decide(self, kind: str, f: Failure, node: str, rank: int) -> Decision:
        remaining = self.scn.max_restarts - self.used
        if kind == "node_lost":
            lost = NodeLost({node: "no heartbeat for 4.1 s; unreachable (timed out)"}, [f"{node}-rdzv"], 4.1)
            return P.decide_while_running(lost, self.settings, self.active, self.standbys)
        if kind == "hardware":
            error, fault = HARDWARE_TEXT[f.group]
            failures = {rank: RankFailure(f.rank, None, 1, error_file_data=_error_file(error))}
            report = HardwareReport(False, [fault.format(r=f.rank)], [])
            d = P.decide_on_failure(failures, remaining, None, report, restart_on_error=self.scn.restart_on_error)
        elif kind == "hang":  # the agents stop their workers under the job's hang verdict
            failures = {rank: RankFailure(f.rank, None, -9, signal="SIGKILL")}
            hang = HangEvidence(rank, "steps", f"rank {rank} is stuck in a collective (process state D)",
                                progress="stopped", recorded_by=node)  # fmt: skip
            d = P.decide_on_failure(failures, remaining, None, None, hang)
        else:
            failures = {rank: RankFailure(f.rank, None, 1, error_file_data=_error_file(USER_ERROR))}
            d = P.decide_on_failure(failures, remaining, None, HardwareReport(True, [], []),
                                    restart_on_error=self.scn.restart_on_error)  # fmt: skip
        return self.guard(d, failures, node)

    def guard(self, d: Decision, failures: dict[int, RankFailure], node: str) -> Decision:
        """The restart-loop guard on the failing node's own records: every attempt of the job is
        one of its attempts, its own where its rank failed (else it only lost a peer)."""
        self.attempts.append((self.attempt, node, P.failure_kind(failures), int(self.tl.progress / self.step_s)))
        k = self.settings.restart_loop_attempts
        records = [AttemptRecord(a, node, kind, step, "spans", n == node, self.active)
                   for a, n, kind, step in self.attempts[-k:]]  # fmt: skip
        return P.guard_restart_loop(d, records, self.settings, self.active)

    # ---- carrying out
    def on_failure(self, f: Failure) -> None:
        slot = min(int(f.slot * len(self.slots)), len(self.slots) - 1)
        node, kind = self.slots[slot], EVIDENCE[f.group]
        self.attempt += 1
        d = self.decide(kind, f, node, slot * RANKS_PER_NODE + f.rank)
        self.trace.append(TraceEntry(f.t, f.group, node, d.action.value, d.source, d.reason[:240]))
        if (hk := P.history_kind(d)) is not None:
            self.history.append(NodeFault(node, hk, d.reason[:200], f.t, "fleet"))
        if d.action == Action.STOP_JOB or (d.action == Action.RESTART and self.used >= self.scn.max_restarts):
            self.relaunches["stopped" if d.action == Action.STOP_JOB else "budget spent"] += 1
            self.relaunch(kind, f)  # torch elastic ends the run when a restart finds the budget spent
        elif d.action == Action.EXCLUDE_NODE:
            peers = P.decide_on_peer_news(PeerLeft(node))  # what the other nodes do on its leaving
            assert peers.action == Action.RERENDEZVOUS, peers
            self.replace(slot, f, 0.0, self.cal.draw("tg_node_fault_s", f.u[1]))
        elif d.action == Action.RERENDEZVOUS:
            hb = self.cal.draw("tg_heartbeat_s", f.u[0])
            total = self.cal.draw("tg_standby_s" if self.standbys else "tg_node_fault_s", f.u[1])
            self.replace(slot, f, hb, total - hb)
        elif d.action == Action.RESTART:
            self.restart(kind, slot, f)

    def restart(self, kind: str, slot: int, f: Failure) -> None:
        self.used += 1
        again = self.cal.draw("tg_restart_s", f.u[1]) + self.init_s
        if kind == "node_lost":  # too few nodes left: the rendezvous waits for a replacement
            self.slots[slot] = self._mint()
            self.restore_node_loss(f)
            self.tl.go_down([(DETECT, self.cal.draw("tg_heartbeat_s", f.u[0])), (WAITING, self.requeue_s),
                             (RESTART, again)])  # fmt: skip
            return
        self.tl.restore(math.floor(self.tl.progress / self.snapshot) * self.snapshot)
        detect = self.cal.draw("tg_hang_detect_s", f.u[0]) if kind == "hang" else self.cal.value("crash_detect_s")
        self.tl.go_down([(DETECT, detect), (RESTART, again)])

    def replace(self, slot: int, f: Failure, detect: float, reform: float) -> None:
        """The node leaves: a standby takes its place, or the job goes on smaller (elastic), or
        the new round waits for the scheduler's replacement."""
        self.slots[slot] = self._mint()
        self.restore_node_loss(f)
        if self.standbys > 0:
            self.standbys -= 1
            self._schedule(self.requeue_s, "standby")
            self.tl.go_down([(DETECT, detect), (RESTART, reform + self.init_s)])
        elif self.active - 1 >= self.scn.min_nodes:
            self.active -= 1
            self.tl.world = self.active / self.scn.nodes
            self._schedule(self.requeue_s, "grow")
            self.tl.go_down([(DETECT, detect), (RESTART, reform + self.init_s)])
        else:
            self.tl.go_down([(DETECT, detect), (WAITING, self.requeue_s), (RESTART, reform + self.init_s)])

    def restore_node_loss(self, f: Failure) -> None:
        """A lost node's state comes from its buddy's replica, which lags the snapshot by a step or two."""
        lag = self.cal.draw("tg_replica_lag_steps", f.u[2]) * self.step_s
        self.tl.restore(math.floor((self.tl.progress - lag) / self.snapshot) * self.snapshot)

    def relaunch(self, kind: str, f: Failure) -> None:
        """The policy stopped the job: the agents persist their snapshots on the way out and the
        scheduler launches it again, whole (a fresh restart budget, standbys and all nodes)."""
        if kind in ("node_lost", "hardware"):
            self.restore_node_loss(f)
        else:
            self.tl.restore(math.floor(self.tl.progress / self.snapshot) * self.snapshot)
        detect = {"hang": self.cal.draw("tg_hang_detect_s", f.u[0]),
                  "node_lost": self.cal.draw("tg_heartbeat_s", f.u[0])}.get(kind, self.cal.value("crash_detect_s"))
        launch = self.cal.draw("tg_launch_s", f.u[2]) + self.init_s + self.cal.value("ckpt_load_s")
        self.tl.go_down([(DETECT, detect), (WAITING, self.requeue_s), (RESTART, launch)])
        self.used, self.attempts, self.arrivals = 0, [], []
        self.active, self.standbys, self.tl.world = self.scn.nodes, self.scn.standbys, 1.0

    def arrive(self, kind: str) -> None:
        if kind == "standby":  # waits in the rendezvous, takes only a free place: no round
            self.standbys += 1
            return
        self.active += 1
        self.tl.world = self.active / self.scn.nodes
        if self.tl.phase() is None:  # a node joining a running elastic job: a new round
            self.tl.go_down([(RESTART, self.cal.draw("tg_restart_s", self.rng.random()) + self.init_s)])

    def _mint(self) -> str:
        self.minted += 1
        return f"node{self.minted}"

    def _schedule(self, after: float, kind: str) -> None:
        heapq.heappush(self.arrivals, (self.tl.now + after, len(self.trace), kind))


# ------------------------------------------------------------------------------ one run


def simulate(scn: Scenario, rates: Rates, cal: Calibration, multiplier: float = 1.0,
             seed: int = 1) -> tuple[list[RowResult], int]:
    """Every row over the same failures; (results, number of failures)."""
    key = f"{seed}-{scn.ranks}-{multiplier:g}"
    failures = draw_failures(rates, scn.nodes, scn.days, multiplier, key)
    per_s = rates.per_node_hour * multiplier * scn.nodes / 3600.0
    mtbf = 1.0 / per_s if per_s > 0 else math.inf
    rows: list[Row] = [TorchrunRow(scn, cal, mtbf, key), TrainguardRow(replace(scn, standbys=0), cal, mtbf, key)]
    if scn.standbys:
        rows.append(TrainguardRow(scn, cal, mtbf, key))
    end = scn.days * 86400.0
    out = []
    for row in rows:
        row.run(failures, end)
        out.append(_result(row))
    return out, len(failures)


def _result(row: Row) -> RowResult:
    wall = row.tl.now
    parts = {p: v / wall for p, v in row.tl.parts.items()}
    res = RowResult(row.name, row.tl.ettr(), parts, row.trace, getattr(row, "note", ""), 1.0 - row.tl.rate)
    if isinstance(row, TrainguardRow):
        res.history_records = len(row.history)
        res.refused_hosts = len(refused_hosts(row.history, DEFAULT_FAULTS))
        res.relaunches = dict(row.relaunches)
    return res
