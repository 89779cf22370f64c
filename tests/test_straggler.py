"""The pure straggler detector: per-step accumulation, windows, robust flags, persistence."""

from __future__ import annotations

import random
import time

from trainguard.detect import straggler as S

CFG = S.StragglerConfig(window_steps=5, windows=3, ratio=1.25, min_delta_ms=1.0)


def rw(rank, window=0, compute=50.0, dl=1.0, comm=2.0, node=None):
    return S.RankWindow(rank, node or f"n{rank // 2}", window, 5, compute + dl + comm, compute, dl, comm)


def test_accumulator_sums_spans_per_step_and_drops_late_ones():
    acc = S.StepAccumulator()
    acc.add_span("FP", 1, 10.0)
    acc.add_span("FP", 1, 5.0)
    acc.add_span("DataLoader", 1, 2.0)
    acc.add_span("Communication", 1, 3.0)
    acc.add_span("SaveCheckpoint", 1, 100.0)  # not part of the analysis
    b = acc.close_step(1, 25.0)
    assert b == S.StepBreakdown(1, 25.0, 15.0, 2.0, 3.0)
    acc.add_span("FP", 1, 99.0)  # late for a closed step
    assert acc.close_step(1, 1.0) is None
    assert acc.close_step(2, 9.0) == S.StepBreakdown(2, 9.0, 0.0, 0.0, 0.0)


def test_no_fp_spans_means_unknown_compute():
    acc = S.StepAccumulator()
    acc.add_span("DataLoader", 1, 2.0)
    assert acc.close_step(1, 5.0).compute_ms is None


def test_window_builder_emits_medians_once_complete():
    wb = S.WindowBuilder(rank=3, node="b", window_steps=3)
    outs = [wb.add(S.StepBreakdown(s, 10.0 * s, float(s), 1.0, 0.0)) for s in (1, 2, 3, 4)]
    assert outs[:2] == [None, None] and outs[3] is None
    w = outs[2]
    assert (w.rank, w.node, w.window, w.steps, w.step_ms, w.compute_ms) == (3, "b", 0, 3, 20.0, 2.0)
    assert S.RankWindow.from_dict(w.to_dict()) == w


def test_slow_compute_rank_is_flagged_not_the_ranks_waiting_for_it():
    # Rank 1 computes 1.5x longer; ranks 0, 2, 3 wait for it in the all-reduce (long comm).
    ranks = [rw(0, comm=27), rw(1, compute=75, comm=2), rw(2, comm=26), rw(3, comm=28)]
    flags = S.flag_window(ranks, CFG)
    assert [(f.rank, f.node, f.kind) for f in flags] == [(1, "n0", S.COMPUTE)]
    assert abs(flags[0].ratio - 1.5) < 1e-9


def test_two_ranks_compare_against_the_other():
    flags = S.flag_window([rw(0), rw(1, compute=75)], CFG)
    assert [(f.rank, f.kind) for f in flags] == [(1, S.COMPUTE)]


def test_slow_dataloader_and_slow_communication():
    flags = S.flag_window([rw(0), rw(1), rw(2, dl=30), rw(3)], CFG)
    assert [(f.rank, f.kind) for f in flags] == [(2, S.DATALOADER)]
    # Rank 3's steps are longer, the extra time all in communication: a slow link.
    flags = S.flag_window([rw(0), rw(1), rw(2), rw(3, comm=20)], CFG)
    assert [(f.rank, f.kind) for f in flags] == [(3, S.COMMUNICATION)]


def test_a_rank_that_waits_in_communication_is_not_a_straggler():
    # Synchronous steps of equal length: rank 0 computes 1.2 ms less and waits 1.2 ms more.
    def sync(rank, compute, comm):
        return S.RankWindow(rank, "n0", 0, 5, 21.0, compute, 0.0, comm)

    assert S.flag_window([sync(0, 18.8, 2.2), sync(1, 20.0, 1.0)], CFG) == []
    four = [sync(0, 18.0, 3.0), sync(1, 20.0, 1.0), sync(2, 19.9, 1.1), sync(3, 20.0, 1.0)]
    assert S.flag_window(four, CFG) == []


def test_small_or_noisy_differences_are_not_flagged():
    assert S.flag_window([rw(0, compute=1.0), rw(1, compute=1.8)], CFG) == []  # 1.8x but < 1 ms
    assert S.flag_window([rw(0), rw(1, compute=60)], CFG) == []  # 1.2x < 1.25x
    # Peers spread widely: 70 is within their noise.
    noisy = [rw(0, compute=40), rw(1, compute=62), rw(2, compute=50), rw(3, compute=70), rw(4, compute=45)]
    assert S.flag_window(noisy, CFG) == []
    assert S.flag_window([rw(0)], CFG) == []


def test_detect_needs_the_same_flag_in_consecutive_windows():
    # 5 steps of ~253 ms: each window covers 1.27 s, so windows (3) is the binding condition.
    slow = [
        [rw(0, w, compute=250), rw(1, w, compute=400), rw(2, w, compute=250), rw(3, w, compute=250)]
        for w in range(3)
    ]
    healthy = [rw(r, 1, compute=250) for r in range(4)]
    assert S.detect(slow[:2], CFG) == []
    assert S.detect([slow[0], healthy, slow[2]], CFG) == []
    (v,) = S.detect(slow, CFG)
    assert (v.rank, v.node, v.kind, v.slower_by, v.windows) == (1, "n0", S.COMPUTE, 1.6, [0, 1, 2])
    assert (v.value_ms, v.peers_ms) == (400.0, 250.0)
    assert S.detect([healthy, *slow], CFG) == [v], "only the newest consecutive flags count"


def test_detect_needs_the_flags_to_last_min_seconds():
    # 5 steps of ~13 ms: a window covers 65 ms; 1 s of slowness takes 16 windows.
    def window(w, slow):
        return [rw(0, w, compute=10), rw(1, w, compute=15 if slow else 10), rw(2, w, compute=10)]

    assert S.window_seconds(window(0, False)) == 0.065
    history = [window(w, True) for w in range(15)]
    assert S.detect(history, CFG) == [], "15 slow windows = 0.98 s: a moment, not a straggler"
    history.append(window(15, True))
    (v,) = S.detect(history, CFG)
    assert (v.rank, v.kind, len(v.windows), v.windows[-1]) == (1, S.COMPUTE, 16, 15)
    assert S.detect([*history, window(16, False)], CFG) == []


def test_healthy_noisy_run_never_flags():
    rnd = random.Random(7)
    history = []
    for w in range(200):  # 1000 steps of 8 ranks with 10 % jitter and rare spikes
        ranks = []
        for r in range(8):
            c = 20 * rnd.gauss(1.0, 0.1) * (3.0 if rnd.random() < 0.01 else 1.0)
            ranks.append(rw(r, w, compute=c, dl=rnd.uniform(0.5, 1.5), comm=rnd.uniform(1, 5)))
        history.append(ranks)
        assert S.detect(history, CFG) == [], f"false straggler at window {w}"


def test_one_verdict_per_incident_across_nodes(tmp_path):
    """Two agents, each with a slow rank: one `straggler_detected` for the job (recorded by the
    leader, which judges every node's windows) naming both, with each node's windows attached; each node's policy gets its own rank."""
    from torch.distributed import TCPStore

    from trainguard.events import EventBus, EventStore
    from trainguard.monitors.api import MonitorContext, StepTracker, WorkerInfo
    from trainguard.monitors.straggler import StragglerMonitor

    server = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    db = EventStore(tmp_path)
    try:
        mons, ctxs = [], []
        for n in range(2):
            ctxs.append(MonitorContext(run_dir=tmp_path, node=f"n{n}", node_rank=n, nnodes=2, nproc_per_node=2, world_size=4,
                                       restart_count=0, workers=[WorkerInfo(i, 2 * n + i, 1) for i in (0, 1)],
                                       events=EventBus(db, f"n{n}"), steps=StepTracker(), store=server, rdzv_backend="c10d"))  # fmt: skip
            mons.append(StragglerMonitor(CFG))
        for w in range(4):  # rank 1 (n0) and rank 3 (n1) compute 1.5x longer, window after window
            for r in range(4):
                win = rw(r, window=w, compute=75 if r in (1, 3) else 50)
                mons[r // 2].add_window(S.RankWindow(**{**win.to_dict(), "steps": 200}))
        found = [None, None]
        deadline = time.monotonic() + 60  # the follower reads the leader's verdicts every FOLLOW_EVERY_S
        while None in found and time.monotonic() < deadline:
            for n in (0, 1):
                found[n] = found[n] or mons[n].poll(ctxs[n])
            time.sleep(0.05)
        assert (found[0].rank, found[1].rank) == (1, 3)
        [ev] = db.query(kinds=["straggler_detected"])
        assert sorted(s["rank"] for s in ev.evidence["stragglers"]) == [1, 3]
        assert set(ev.evidence["nodes"]) == {"n0", "n1"}
        assert ev.node == f"n{ev.rank // 2}" and ev.evidence["recorded_by"] == "n0"
    finally:
        db.close()
        del server
