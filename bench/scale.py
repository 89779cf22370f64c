"""Agent side at scale, simulated: the real straggler monitors exchanging through one real c10d
store, the real detectors, synthetic per-rank data; 64 -> 10,000 ranks (8 ranks per agent).

One round = one straggler window (about once a second while training). Every simulated agent is
a real ``monitors.straggler.StragglerMonitor`` with its own ``MonitorContext``; each round every
agent is handed its ranks' window summaries and polled, as the agent's loop does. One rank is
60 % slower in compute: every round must name it, and only it. Store traffic (operations and
bytes) is counted on the way into one TCPStore (libuv, 127.0.0.1); times are one core (this
process, all agents one after another, so per-agent times are what one agent pays).

The leader design (today: node 0 merges, judges and publishes verdicts) is compared with the
all-to-all design it replaced (every agent merged every node's windows), which is measured for
a sample of agents and multiplied by the number of agents (column "x agents").
The hang side on the same scale: one suspected hang through the real exchange (every node
publishes its views and counts who still progresses; one node reads every view and runs the
culprit finder), against the design it replaced, where every node read every view.

    python bench/scale.py                  # 64, 512, 2048, 10000 ranks
    python bench/scale.py --ranks 64,1000 --rounds 4
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from torch.distributed import PrefixStore, TCPStore  # noqa: E402

from trainguard.detect import straggler as S  # noqa: E402
from trainguard.detect.culprit import find_culprit  # noqa: E402
from trainguard.events import EventBus  # noqa: E402
from trainguard.monitors import straggler as SM  # noqa: E402
from trainguard.monitors.api import MonitorContext, StepTracker, WorkerInfo  # noqa: E402
from trainguard.monitors.hang.exchange import HangExchange, NodeViews, view_from_dict, view_to_dict  # noqa: E402

RANKS_PER_NODE = 8


class CountingStore:
    """The store calls the straggler monitor makes, counted (operations, bytes either way)."""

    def __init__(self, store) -> None:
        self.store = store
        self.ops = 0
        self.bytes = 0

    def set(self, key: str, value) -> None:
        self.ops += 1
        self.bytes += len(key) + len(value)
        self.store.set(key, value)

    def get(self, key: str) -> bytes:
        v = self.store.get(key)
        self.ops += 1
        self.bytes += len(key) + len(v)
        return v

    def multi_get(self, keys: list[str]) -> list[bytes]:
        vs = self.store.multi_get(keys)
        self.ops += 1
        self.bytes += sum(map(len, keys)) + sum(map(len, vs))
        return vs

    def check(self, keys: list[str]) -> bool:
        self.ops += 1
        self.bytes += sum(map(len, keys))
        return self.store.check(keys)

    def add(self, key: str, amount: int) -> int:
        self.ops += 1
        self.bytes += len(key) + 8
        return self.store.add(key, amount)


def window_of(node: int, window: int, slow_rank: int, steps: int) -> list[S.RankWindow]:
    rng = random.Random(node * 7919 + window)
    out = []
    for i in range(RANKS_PER_NODE):
        rank = node * RANKS_PER_NODE + i
        comp = 80.0 * (1.6 if rank == slow_rank else 1.0) * rng.uniform(0.97, 1.03)
        out.append(S.RankWindow(rank, f"node{node}", window, steps, comp + 25.0, comp, rng.uniform(1, 2), rng.uniform(20, 25)))
    return out


def agents(nodes: int, store: CountingStore) -> list[tuple[SM.StragglerMonitor, MonitorContext]]:
    out = []
    for n in range(nodes):
        mon = SM.StragglerMonitor(S.StragglerConfig())
        ctx = MonitorContext(
            run_dir=Path("."), node=f"node{n}", node_rank=n, nnodes=nodes, nproc_per_node=RANKS_PER_NODE,
            world_size=nodes * RANKS_PER_NODE, restart_count=0,
            workers=[WorkerInfo(i, n * RANKS_PER_NODE + i, 0) for i in range(RANKS_PER_NODE)],
            events=EventBus(None, f"node{n}"), steps=StepTracker(), store=store, rdzv_backend="c10d",
        )  # fmt: skip
        mon.on_workers_started(ctx)
        out.append((mon, ctx))
    return out


def leader_design(client, ranks: int, rounds: int) -> dict:
    nodes = ranks // RANKS_PER_NODE
    store = CountingStore(PrefixStore(f"leader{ranks}", client))
    group = agents(nodes, store)
    slow = ranks // 2 + 3
    cfg = S.StragglerConfig()
    found: set[int] = set()
    lead_s, lead_cpu, follow_s, ops, nbytes = [], [], [], [], []
    cpu = 0.0
    for w in range(rounds):
        for n, (mon, _) in enumerate(group):
            for rw in window_of(n, w, slow, cfg.window_steps):
                mon.add_window(rw)
        ops0, bytes0 = store.ops, store.bytes
        times = []
        # followers publish, the leader merges and judges, followers read its verdicts
        for mon, ctx in [*group[1:], group[0], *group[1:]]:
            t0, c0 = time.perf_counter(), time.thread_time()
            got = mon.poll(ctx)
            times.append((ctx.node_rank, time.perf_counter() - t0))
            if ctx.node_rank == 0:
                cpu = time.thread_time() - c0
            if got is not None:
                found.add(got.rank)
        ops.append(store.ops - ops0)
        nbytes.append(store.bytes - bytes0)
        lead_s.append(sum(t for n, t in times if n == 0))
        lead_cpu.append(cpu)
        per_follower: dict[int, float] = {}
        for n, t in times:
            if n:
                per_follower[n] = per_follower.get(n, 0.0) + t
        follow_s.append(statistics.median(per_follower.values()) if per_follower else 0.0)
    # the first rounds fill the detector's history: report the last round
    return {"ops": ops[-1], "bytes": nbytes[-1], "leader_s": lead_s[-1], "leader_cpu": lead_cpu[-1], "follower_s": follow_s[-1],
            "found": sorted(found), "slow": slow}  # fmt: skip


def all_to_all(client, ranks: int, sample: int) -> dict:
    """What each agent did before: check and read every node's key, merge, detect."""
    nodes = ranks // RANKS_PER_NODE
    store = CountingStore(PrefixStore(f"a2a{ranks}", client))
    cfg = S.StragglerConfig()
    slow = ranks // 2 + 3
    history = []
    for w in range(cfg.windows):
        for n in range(nodes):
            store.set(f"w{w}/n{n}", json.dumps([x.to_dict() for x in window_of(n, w, slow, cfg.window_steps)]))
        history.append([x for n in range(nodes) for x in window_of(n, w, slow, cfg.window_steps)])
    keys = [f"w{cfg.windows - 1}/n{n}" for n in range(nodes)]
    times, ops, nbytes = [], 0, 0
    for _ in range(min(sample, nodes)):
        ops0, bytes0 = store.ops, store.bytes
        t0 = time.perf_counter()
        store.check(keys)
        merged = [S.RankWindow.from_dict(d) for k in keys for d in json.loads(store.get(k))]
        S.detect([*history[:-1], merged], cfg)
        times.append(time.perf_counter() - t0)
        ops, nbytes = store.ops - ops0, store.bytes - bytes0
    return {"agent_s": statistics.median(times), "ops": (ops + 1) * nodes, "bytes": nbytes * nodes}


def hang_side(client, ranks: int) -> dict:
    """One suspected multi-node hang through the real exchange (monitors.hang.exchange) on the
    counted store: every node publishes its ranks' views and asks whether a rank elsewhere still
    progresses (two counters); the one node that judges for the job reads every view and names
    the culprit. The design it replaced had every node read every view (bytes computed)."""
    nodes = ranks // RANKS_PER_NODE
    frames = [["allreduce", "/usr/lib/python3/site-packages/torch/distributed/distributed_c10d.py", 2800],
              ["forward", "/job/model.py", 120], ["train_step", "/job/train.py", 88], ["main", "/job/train.py", 140]]  # fmt: skip
    stuck = [["_load_batch", "/job/data.py", 51], ["train_step", "/job/train.py", 80], ["main", "/job/train.py", 140]]
    d = {"state": "S", "frames": frames, "busy": False, "error": None, "last_step": 1000}
    culprit = ranks // 3
    views = {r: view_from_dict(r, d) for r in range(ranks)}
    views[culprit] = view_from_dict(culprit, {**d, "state": "R", "frames": stuck, "busy": True, "last_step": 999})
    store = CountingStore(client)
    exchanges = [HangExchange(store, f"hang{ranks}/", n, nodes) for n in range(nodes)]
    t0 = time.perf_counter()
    for n, ex in enumerate(exchanges):
        mine = {r: views[r] for r in range(n * RANKS_PER_NODE, (n + 1) * RANKS_PER_NODE)}
        ex.publish(NodeViews(f"node{n}", n, mine, {r: "idle" for r in mine}))
    moving = [ex.others_moving(0.0)[0] for ex in exchanges]
    gathered = exchanges[0].gather(0.0, declared=False)
    seen = {**{r: v for nv in gathered.values() for r, v in nv.views.items()}, **{r: views[r] for r in range(RANKS_PER_NODE)}}
    t1 = time.perf_counter()
    verdict = find_culprit(seen, nnodes=nodes)
    took = time.perf_counter() - t1
    size = len(json.dumps({str(r): view_to_dict(v) for r, v in views.items()}))
    return {"culprit_s": took, "exchange_s": t1 - t0, "ok": verdict.rank == culprit and not any(moving),
            "ops": store.ops, "bytes": store.bytes, "views_bytes_all_agents": size * nodes}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", default="64,512,2048,10000")
    ap.add_argument("--rounds", type=int, default=4, help="windows per size (>= the detector's 3)")
    ap.add_argument("--sample", type=int, default=3, help="agents whose all-to-all gather runs for real")
    args = ap.parse_args()
    SM.FOLLOW_EVERY_S = 0.0  # every poll of the simulation is a new round
    logging.getLogger("trainguard").setLevel(logging.ERROR)  # the straggler events themselves
    server = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=300), use_libuv=True)
    client = TCPStore("127.0.0.1", server.port, is_master=False, timeout=timedelta(seconds=300), use_libuv=True)
    rows = []
    for r in (int(x) for x in args.ranks.split(",")):
        r = max(RANKS_PER_NODE, r // RANKS_PER_NODE * RANKS_PER_NODE)
        rows.append((r, leader_design(client, r, args.rounds), all_to_all(client, r, args.sample), hang_side(client, r)))
    mb = 1e6
    print(f"one round = one straggler window; {RANKS_PER_NODE} ranks per simulated agent; one TCPStore; one core")
    print(f"{'ranks':>6} {'agents':>6} | {'leader: ops':>11} {'MB':>6} {'leader s':>8} {'cpu s':>6} {'agent s':>8} {'named':>6} | "
          f"{'all-to-all: ops':>15} {'MB':>8} {'agent s':>8} {'x agents':>9} | {'hang: ops':>9} {'MB':>6} {'culprit s':>9} "
          f"{'every-node views MB':>19}")  # fmt: skip
    for r, lead, a2a, hang in rows:
        named = "ok" if lead["found"] == [lead["slow"]] else f"got {lead['found']}"
        print(
            f"{r:>6} {r // RANKS_PER_NODE:>6} | {lead['ops']:>11,} {lead['bytes'] / mb:>6.2f} {lead['leader_s']:>8.3f} {lead['leader_cpu']:>6.3f} "
            f"{lead['follower_s']:>8.4f} {named:>6} | {a2a['ops']:>15,} {a2a['bytes'] / mb:>8.1f} {a2a['agent_s']:>8.3f} "
            f"{a2a['agent_s'] * r / RANKS_PER_NODE:>9.1f} | {hang['ops']:>9,} {hang['bytes'] / mb:>6.2f} {hang['culprit_s']:>9.3f} "
            f"{hang['views_bytes_all_agents'] / mb:>19.1f}"
            + ("" if hang["ok"] else " culprit MISSED")
        )  # fmt: skip
    (r0, l0, a0, h0), (r1, l1, a1, h1) = rows[0], rows[-1]
    print(f"\nranks x{r1 / r0:.0f}: leader-design store bytes x{l1['bytes'] / l0['bytes']:.0f}, ops x{l1['ops'] / l0['ops']:.0f}; "
          f"all-to-all bytes x{a1['bytes'] / a0['bytes']:.0f}; leader's time per round x{l1['leader_s'] / l0['leader_s']:.0f}; "
          f"hang exchange bytes x{h1['bytes'] / h0['bytes']:.0f}, ops x{h1['ops'] / h0['ops']:.0f} "
          f"(every node reading every view: bytes x{h1['views_bytes_all_agents'] / h0['views_bytes_all_agents']:.0f})")  # fmt: skip
    print("leader s: the leader agent's poll (merge + detect + publish), wall; cpu s: its thread's CPU time;")
    print("agent s: one other agent's polls (wall);")
    print("x agents: one all-to-all agent's time x agents = the store's and CPUs' work per round in that design;")
    print("hang: one suspected hang through the real exchange (every node publishes, counts who still progresses;")
    print("      one node reads every view and names the culprit); every-node views MB: the design it replaced.")
    del client, server


if __name__ == "__main__":
    main()
