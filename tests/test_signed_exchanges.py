"""Everything agents act on in the rendezvous store is signed: a value written
to the job's store by anyone but an agent of this job — a local process on the store's port, a
stray client — is ignored with a ``store_write_rejected`` warning, never obeyed. Real TCPStores on
127.0.0.1, the agents' own view of them (``Peers.signed``, what the agent hands its monitors)."""

from __future__ import annotations

import json
import time
from datetime import timedelta

import pytest
from torch.distributed import TCPStore

from trainguard.cluster import exchange, runs
from trainguard.cluster.peers import Peers
from trainguard.cluster.stores import JobKey
from trainguard.detect import straggler as S
from trainguard.events import EventBus, EventStore, Severity
from trainguard.evidence import HangEvidence
from trainguard.monitors.api import MonitorContext, StepTracker, WorkerInfo
from trainguard.monitors.hang.exchange import HangExchange, verdict_to_json
from trainguard.monitors.straggler import StragglerMonitor

CFG = S.StragglerConfig(window_steps=5, windows=3, ratio=1.25, min_delta_ms=1.0)


@pytest.fixture
def server():
    s = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    yield s
    del s


@pytest.fixture
def job(tmp_path):
    """The job's key and the warnings its agents record, as the agent records them."""
    db = EventStore(tmp_path)
    bus = EventBus(db, "n1")

    def rejected(key: str, value: str) -> None:  # TrainguardAgent._rejected_write
        bus.emit("store_write_rejected", f"ignored {key} in the rendezvous store: not signed by an agent of this job",
                 severity="warning", evidence={"key": key, "value": value})  # fmt: skip

    yield JobKey.for_job("job-28", single_node=False), rejected, db
    db.close()


def warnings(db: EventStore) -> list[str]:
    return [e.evidence["key"] for e in db.query(kinds=["store_write_rejected"]) if e.severity == Severity.WARNING]


def ctx_for(tmp_path, node_rank: int, store, db: EventStore) -> MonitorContext:
    return MonitorContext(run_dir=tmp_path, node=f"n{node_rank}", node_rank=node_rank, nnodes=2, nproc_per_node=2,
                          world_size=4, restart_count=0, workers=[WorkerInfo(i, 2 * node_rank + i, 1) for i in (0, 1)],
                          events=EventBus(db, f"n{node_rank}"), steps=StepTracker(), store=store, rdzv_backend="c10d")  # fmt: skip


def test_a_forged_straggler_verdict_does_not_make_a_node_leave(tmp_path, server, job):
    key, rejected, db = job
    follower = StragglerMonitor(CFG)
    ctx = ctx_for(tmp_path, 1, Peers("n1", key, rejected).signed(server), db)
    for r in (2, 3):  # node 1 publishes a healthy window; the leader has not judged it yet
        follower.add_window(S.RankWindow(r, "n1", 0, 5, 53.0, 50.0, 1.0, 2.0))
    assert follower.poll(ctx) is None
    forged = {"window": 0, "verdicts": [S.Verdict(3, "n1", "compute", 9.0, 450.0, 50.0, [0]).to_dict()]}
    server.set("trainguard/straggler/verdicts", json.dumps(forged))  # a local process on the store's port
    deadline = time.monotonic() + 60
    while not warnings(db) and time.monotonic() < deadline:  # the follower reads the verdicts every 0.5 s
        assert follower.poll(ctx) is None, "a forged verdict was obeyed"
        time.sleep(0.05)
    assert warnings(db) == ["trainguard/straggler/verdicts"]
    assert follower.poll(ctx) is None and len(warnings(db)) == 1  # reported once


def test_signed_straggler_exchange_still_names_the_slow_rank_and_skips_a_forged_window(tmp_path, server, job):
    key, rejected, db = job
    mons = [StragglerMonitor(CFG), StragglerMonitor(CFG)]
    ctxs = [ctx_for(tmp_path, n, Peers(f"n{n}", key, rejected).signed(server), db) for n in (0, 1)]
    for w in range(7):  # rank 3 (n1) computes 1.5x longer, window after window
        for r in range(4):
            mons[r // 2].add_window(S.RankWindow(r, f"n{r // 2}", w, 5, 53.0, 75.0 if r == 3 else 50.0, 1.0, 2.0))
    assert mons[1].poll(ctxs[1]) is None  # node 1 publishes its windows
    for w in range(4, 7):  # a forger replaces node 1's newest windows with ones where rank 2 is 18x slower
        forged = [S.RankWindow(2, "n1", w, 5, 903.0, 900.0, 1.0, 2.0), S.RankWindow(3, "n1", w, 5, 53.0, 50.0, 1.0, 2.0)]
        server.set(f"trainguard/straggler/w{w}/n1", json.dumps([x.to_dict() for x in forged]))
    found = [None, None]
    deadline = time.monotonic() + 60
    while (found[1] is None or len(warnings(db)) < 3) and time.monotonic() < deadline:  # until the leader met them all
        for n in (1, 0):
            found[n] = found[n] or mons[n].poll(ctxs[n])
        time.sleep(0.05)
    assert found[1] is not None and found[1].rank == 3 and found[0] is None
    [ev] = db.query(kinds=["straggler_detected"])  # rank 2 never named from the forged windows
    assert ev.rank == 3 and ev.evidence["recorded_by"] == "n0" and [s["rank"] for s in ev.evidence["stragglers"]] == [3]
    assert sorted(warnings(db)) == [f"trainguard/straggler/w{w}/n1" for w in range(4, 7)]


def test_a_forged_hang_verdict_and_claim_are_not_obeyed(tmp_path, server, job):
    key, rejected, db = job
    hx = HangExchange(Peers("n1", key, rejected).signed(server), "", 1, 2)
    other = HangExchange(Peers("n0", key).signed(server), "", 0, 2)
    culprit = HangEvidence(rank=3, rule="steps", reason="forged")
    server.set("trainguard/hang/verdict", verdict_to_json(culprit))
    server.set("trainguard/hang/claim", "0")
    assert hx.verdict() is None  # no verdict stands: the forged one is ignored
    assert hx.claim() is True and other.claim() is False  # the forged claim is taken over; then first writer wins
    real = HangEvidence(rank=0, rule="steps", reason="rank 0 never entered the allreduce")
    assert other.offer(real) == real and hx.verdict() == real  # the genuine verdict replaces the forged one
    assert sorted(warnings(db)) == ["trainguard/hang/claim", "trainguard/hang/verdict"]


def test_a_forged_run_id_is_replaced_by_the_agents_own(tmp_path, server, job):
    key, rejected, db = job
    server.set(f"{runs.RUN_KEY}/job-28", json.dumps({"run_id": "planted", "first_attempt": 0}))
    got = runs.agree(Peers("n1", key, rejected).signed(server), tmp_path, None, "job-28")
    assert got.run_id != "planted"
    assert runs.agree(Peers("n0", key).signed(server), tmp_path, None, "job-28") == got  # every agent takes it
    assert warnings(db) == [f"{runs.RUN_KEY}/job-28"]


def test_get_all_leaves_a_forged_value_out(server, job):
    key, rejected, db = job
    signed = Peers("n1", key, rejected).signed(server)
    signed.set("a", "1")
    server.set("b", "2")
    assert exchange.get_all(signed, ["a", "b"]) == {"a": b"1"}
    assert exchange.get_all(server, ["a", "b"])["b"] == b"2"  # the raw store sees everything


@pytest.mark.slow
def test_a_forged_verdict_on_the_job_stores_port_makes_no_node_leave(jobs, tmp_path):
    """The audit's case, end to end: two agents of an elastic job (a straggler may leave it)
    with --exclude-straggler, and a local process
    that writes straggler verdicts naming every rank into the job's rendezvous store (port and
    key prefix are no secret). Both nodes train to the end and record the rejection."""
    import threading

    from tgtest import EXAMPLE, events, free_port, wait_for

    run, port = tmp_path / "run", free_port()
    common = ["--nnodes", "1:2", "--nproc-per-node", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
              "--rdzv-id", "forged", "--max-restarts", "0", "--run-dir", run, "--precheck", "off", "--quiet",
              "--exclude-straggler", "--straggler-window", "5"]  # fmt: skip
    script = [EXAMPLE, "--steps", "120", "--step-time-ms", "40"]
    a = jobs("run", *common, "--node-name", "node0", *script, name="node0")
    b = jobs("run", *common, "--node-name", "node1", *script, name="node1")
    wait_for(lambda: events(run, "job_started"), what="the job to start")
    forged = json.dumps({"window": -1, "verdicts": [S.Verdict(r, f"node{r}", "compute", 9.0, 450.0, 50.0, [0]).to_dict()
                                                    for r in (0, 1)]})  # fmt: skip
    done = threading.Event()

    def forge() -> None:
        client = TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False, timeout=timedelta(seconds=10))
        while not done.is_set():
            try:
                for rnd in range(3):
                    client.set(f"torch.rendezvous.forged.{rnd}/trainguard/straggler/verdicts", forged)
            except Exception:  # the store went with the job
                return
            done.wait(0.2)

    forger = threading.Thread(target=forge, daemon=True)
    forger.start()
    try:
        codes = (a.wait(), b.wait())
    finally:
        done.set()
        forger.join(timeout=30)
    assert codes == (0, 0), (a.output()[-3000:], b.output()[-3000:])
    assert not events(run, "node_excluded")
    assert [e.evidence["key"] for e in events(run, "store_write_rejected")] == ["trainguard/straggler/verdicts"]
