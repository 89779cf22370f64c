"""The shared-memory ring: layout round trip, overrun, step history, switch word, names."""

from __future__ import annotations

import os

import pytest

from trainguard.probes.ring_reader import RingNotReady, RingReader
from trainguard.worker import ring as R
from trainguard.worker import spans


@pytest.fixture
def path():
    p = os.path.join(R.shm_dir(), f"trainguard-test-ring-{os.getpid()}")
    yield p
    if os.path.exists(p):
        os.unlink(p)


def test_records_round_trip_in_unix_time(path):
    w = R.RingWriter(path, rank=7, capacity=8, flags=R.FLAG_BASIC)
    r = RingReader(path, unlink=True)
    try:
        assert not os.path.exists(path), "the agent unlinks the name once mapped"
        assert (r.rank, r.pid, r.flags) == (7, os.getpid(), R.FLAG_BASIC)
        w.write(R.FP, 0, 3, 1_000, 2_500)
        w.write(R.COMMUNICATION, 0, 3, 3_000, 4_000, aux=1)
        got = r.read_new()
        off = w.clock_offset_ns
        assert got == [
            R.Record(R.FP, 0, 0, 3, 1_000 + off, 2_500 + off),
            R.Record(R.COMMUNICATION, 1, 0, 3, 3_000 + off, 4_000 + off),
        ]
        assert r.read_new() == []
        assert r.lost == 0
    finally:
        r.close()
        w.close()


def test_reader_lapped_by_writer_keeps_the_newest_and_counts_lost(path):
    w = R.RingWriter(path, rank=0, capacity=8)
    r = RingReader(path)
    try:
        w.write(R.FP, 0, 1, 0, 1)
        assert len(r.read_new()) == 1
        for i in range(20):  # 20 more into 8 slots
            w.write(R.FP, 0, 2 + i, i, i + 1)
        got = r.read_new()
        assert [g.step for g in got] == list(range(14, 22))  # the last 8
        assert r.lost == 12
        assert len(r.read_new(limit=3)) == 0
        w.write(R.STEP, 0, 22, 0, 1)
        assert [g.step for g in r.read_new()] == [22]
    finally:
        r.close()
        w.close()


def test_read_limit_resumes_where_it_stopped(path):
    w = R.RingWriter(path, rank=0, capacity=16)
    r = RingReader(path)
    try:
        for i in range(10):
            w.write(R.DATALOADER, 0, i + 1, 0, 1)
        assert [g.step for g in r.read_new(limit=4)] == [1, 2, 3, 4]
        assert [g.step for g in r.read_new()] == list(range(5, 11))
    finally:
        r.close()
        w.close()


def test_step_history_is_written_with_profiling_off(path):
    w = R.RingWriter(path, rank=0, capacity=8, flags=0)
    rec = spans.Recorder(w)
    r = RingReader(path)
    try:
        for _ in range(300):  # more than the history holds
            rec.step()
        assert r.step_count == 300
        assert r.read_new() == [], "no Step records while the switch is off"
        hist = r.steps_since(0)
        assert [e.step for e in hist] == list(range(300 - R.STEP_HISTORY + 2, 301))
        assert all(e.duration_ns >= 0 for e in hist)
        assert hist[-1] == r.last_step
        assert r.steps_since(299) == [hist[-1]]
        ends = [e.end_unix_ns for e in hist]
        assert ends == sorted(ends)
    finally:
        r.close()
        w.close()


def test_switch_word_is_read_live_by_the_recorder(path):
    w = R.RingWriter(path, rank=0, capacity=64, flags=0)
    rec = spans.Recorder(w)
    r = RingReader(path)
    spans.set_recorder(rec)
    try:
        with spans.span("off"):
            pass
        rec.step()
        assert r.read_new() == []
        r.set_flags(R.FLAG_BASIC)
        with spans.span("load"):
            pass
        rec.step()
        got = r.read_new()
        assert [(g.kind, g.step) for g in got] == [(R.USER, 2), (R.STEP, 2)]
        assert r.name(got[0].name_id) == "load"
        assert got[0].start_ns <= got[0].end_ns <= got[1].end_ns
    finally:
        spans.set_recorder(None)
        r.close()
        w.close()


def test_records_from_other_threads_are_written_by_the_owner(path):
    import threading

    w = R.RingWriter(path, rank=0, capacity=64, flags=R.FLAG_BASIC | R.FLAG_COMM)
    rec = spans.Recorder(w)
    r = RingReader(path)
    try:
        rec.step()  # the stepping thread owns the ring
        t = threading.Thread(target=rec.record, args=(R.COMMUNICATION, 10, 20))
        t.start()
        t.join()
        assert [g.kind for g in r.read_new()] == [R.STEP], "queued, not written by the other thread"
        rec.step()
        assert [(g.kind, g.step) for g in r.read_new()] == [(R.COMMUNICATION, 2), (R.STEP, 2)]
    finally:
        r.close()
        w.close()


def test_unready_and_missing_rings(path):
    with pytest.raises(RingNotReady):
        RingReader(path)
    with open(path, "wb") as f:
        f.write(b"\0" * (R.RECORDS_OFF + 64))
    with pytest.raises(RingNotReady):
        RingReader(path)
    with pytest.raises(ValueError):
        R.RingWriter(path, rank=0, capacity=6)


class _FakeEvent:
    """Stands in for torch.cuda.Event where no GPU is present: query() and elapsed_time() only."""

    def __init__(self, done: list[bool], ms: float) -> None:
        self.done, self.ms = done, ms

    def record(self) -> None:
        pass

    def query(self) -> bool:
        return self.done[0]

    def elapsed_time(self, end: _FakeEvent) -> float:
        return end.ms - self.ms


def test_device_timed_spans_resolve_only_when_complete(path):
    w = R.RingWriter(path, rank=0, capacity=64, flags=R.FLAG_BASIC)
    rec = spans.Recorder(w)
    r = RingReader(path)
    try:
        done = [False]
        rec._event_pool = [_FakeEvent(done, 7.5), _FakeEvent(done, 2.5)]  # popped: start 2.5 ms, end 7.5 ms
        begun = rec.cuda_begin()
        rec.cuda_end(R.FP, begun)
        rec.resolve_cuda()
        assert r.read_new() == [], "not complete: nothing written, nothing waited for"
        done[0] = True
        rec.step()
        got = r.read_new()
        assert [(g.kind, g.aux) for g in got] == [(R.FP, 1), (R.STEP, 0)]
        assert got[0].end_ns - got[0].start_ns == 5_000_000
        assert len(rec._event_pool) == 2, "events go back to the pool"
    finally:
        r.close()
        w.close()


def test_explicit_step_takes_over_from_the_optimizer_hook_without_double_counting(path):
    w = R.RingWriter(path, rank=0, capacity=64, flags=R.FLAG_BASIC)
    rec = spans.Recorder(w)
    spans.set_recorder(rec)
    try:
        rec.step()  # the optimizer hook ended step 1 ...
        spans.step()  # ... and the script's own trainguard.step() marks the same boundary
        assert rec.steps == 1 and rec.explicit_steps
        spans.step()
        assert rec.steps == 2
    finally:
        spans.set_recorder(None)
        w.close()
