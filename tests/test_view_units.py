"""The summary fold, goodput, heatmap bins, trace format, metrics exposition, run-dir readers, the
stacks request protocol and the dashboard's token — with plain data and real files, no job."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import urllib.error
import urllib.parse
import urllib.request

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from tgtest import REPO

from trainguard.events import EventBus, EventStore
from trainguard.events.metrics import METRICS, AgentView, SummaryCollector, registry_for
from trainguard.events.model import Event, Severity
from trainguard.events.summary import JobSummary, StepHeat
from trainguard.rundir import stack_requests
from trainguard.rundir.readers import Span, SpanTail, read_report
from trainguard.view import goodput, trace

T = 1_800_000_000.0


def ev(kind, t, node="n0", rank=None, i=[0], **evidence):  # noqa: B006 -- a running id
    i[0] += 1
    return Event(kind=kind, message=evidence.pop("message", kind), node=node, rank=rank, time=T + t, evidence=evidence,
                 id=i[0], severity=Severity.ERROR if kind in ("worker_failed", "diagnosis") else Severity.INFO)


def crash_and_resume():
    """Two ranks; rank 1 dies at step 10 of attempt 0 (exits at +6.2 s), resume from step 8."""
    events = [
        ev("precheck_passed", 0),
        ev("job_started", 1, attempt=0, max_restarts=3, pids={"0": 100, "1": 101}),
        ev("checkpoint_persisted", 4, step=8, bytes=10, seconds=0.1, trigger="background"),
        ev("worker_failed", 6.3, rank=1, exit_time=T + 6.2, signal="SIGKILL"),
        ev("diagnosis", 6.4, rank=1, category="host_oom", summary="killed"),
        ev("policy_decision", 6.5, action="restart", source="worker_exit"),
        ev("restart", 6.5, restart_count=1, max_restarts=3, membership_change=False),
        ev("job_started", 7, attempt=1, max_restarts=3, pids={"0": 200, "1": 201}),
        ev("checkpoint_loaded", 7.5, rank=0, step=8, source="memory"),
        ev("job_succeeded", 12),
    ]
    steps = {r: [(T + 2 + 0.4 * k, 0.4) for k in range(1, 11)] + [(T + 8 + 0.4 * k, 0.4) for k in range(1, 11)]
             for r in (0, 1)}
    return events, steps


def test_fold_counts_restarts_failures_and_resume():
    events, steps = crash_and_resume()
    s = JobSummary()
    for e in events + events:  # the same events twice (bus and store): counted once
        s.apply(e)
    for r, samples in steps.items():
        for k, (end, dur) in enumerate(samples):
            s.add_step(r, k % 10 + 1, end, dur)
    assert (s.state, s.max_restarts, s.restarts_used, s.hardware_reschedules) == ("succeeded", 3, 1, 0)
    assert dict(s.failures_by_category()) == {"host_oom": 1}
    assert dict(s.restarts_by_reason()) == {"worker_failure": 1}
    rows = {r["rank"]: r for r in s.rank_rows()}
    assert rows[0]["step"] == 18 and rows[0]["pid"] == 200 and rows[1]["attempt"] == 1  # resumed 8 + 10 steps
    assert s.checkpoint_last_step == 8


def test_fold_membership_hardware_and_straggler_exclusions():
    s = JobSummary()
    s.apply(ev("job_started", 0, node="a", attempt=0, max_restarts=2, pids={"0": 1}))
    s.apply(ev("job_started", 0, node="b", attempt=0, max_restarts=2, pids={"1": 2}))
    s.apply(ev("restart", 1, node="a", membership_change=True, max_restarts=2))
    s.apply(ev("node_excluded", 1, node="b", message="The node is down.", source="hardware_check"))
    s.apply(ev("node_excluded", 2, node="c", message="The node is a straggler and exits.", source="straggler"))
    assert s.restarts_used == 0 and s.hardware_reschedules == 1
    assert dict(s.restarts_by_reason()) == {"membership": 1}
    assert s.state == "restarting"
    s.apply(ev("job_started", 3, node="a", attempt=1, pids={"0": 3}))
    assert s.state == "running"


def test_straggler_score_from_own_work():
    s = JobSummary()
    s.apply(ev("job_started", 0, attempt=0, pids={"0": 1, "1": 2, "2": 3}))
    for step in range(1, 6):
        for rank, fp in ((0, 0.05), (1, 0.05), (2, 0.15)):
            s.add_span(rank, "FP", step, T + step, T + step + fp)
    scores = s.straggler_scores()
    assert scores[2] == pytest.approx(3.0, rel=1e-4) and scores[0] == pytest.approx(1 / 2, rel=1e-4)


def test_goodput_splits_wall_time():
    events, steps = crash_and_resume()
    g = goodput.compute(events, steps)
    assert g.wall == pytest.approx(12.0)
    assert g.lost_steps == 2  # steps 9 and 10 redone after resuming from 8
    assert g.productive == pytest.approx(18 * 0.4)
    assert g.lost == pytest.approx(2 * 0.4 + 0.2)  # the redone steps + the step in flight (6.0 -> 6.2)
    assert g.detection == pytest.approx(0.1)  # exit at 6.2, worker_failed at 6.3
    assert g.restart == pytest.approx(8.0 - 6.3)  # to the start of the first step of attempt 1
    assert g.other == pytest.approx(12.0 - 7.2 - 1.0 - 0.1 - 1.7)
    assert g.line().startswith("goodput 60.0% of 12.0 s: productive 7.2 s, detection 0.1 s, restart 1.7 s")


def test_heat_bins_coarsen_and_render_gaps():
    h = StepHeat(max_bins=8, width=1.0)
    for k in range(40):
        h.add(0, T + k + 1, 1.0)
    assert h.width == 8.0  # 40 s of 1 s bins coarsened to 8 s
    h2 = StepHeat()
    h2.add(0, T + 1, 0.5)
    h2.add(0, T + 10, 0.5)
    out = h2.render(columns=10, start=T, end=T + 10)
    assert len(out["cells"][0]) == 10 and out["cells"][0][0] == 0.5 and out["cells"][0][5] is None


def test_trace_structure():
    events, steps = crash_and_resume()
    spans = [Span(r, "Step", "Step", k % 10 + 1, end - dur, end) for r, s in steps.items() for k, (end, dur) in enumerate(s)]
    doc = trace.build(events, spans, goodput.compute(events, steps))
    assert trace.validate(doc) == []
    json.loads(json.dumps(doc))
    attempts = [e for e in doc["traceEvents"] if e.get("cat") == "attempt"]
    assert [(a["name"], a["args"]["ended_by"]) for a in attempts] == [("attempt 0", "restart"), ("attempt 1", "job_succeeded")]
    x = [e for e in doc["traceEvents"] if e.get("cat") == "Step"]
    assert len(x) == 40 and {e["args"]["attempt"] for e in x} == {0, 1}
    assert trace.validate({"traceEvents": [{"ph": "X", "pid": 1, "tid": 0, "name": "a", "ts": -1}]})


def test_metrics_exposition_parses_with_conventional_names():
    events, steps = crash_and_resume()
    s = JobSummary()
    for e in events[:-1]:
        s.apply(e)
    for r, samples in steps.items():
        for k, (end, dur) in enumerate(samples):
            s.add_step(r, k % 10 + 1, end, dur)
    import threading

    text = generate_latest(registry_for(SummaryCollector(s, threading.Lock(), AgentView(lambda: "n0", lambda: [0, 1])))).decode()
    samples = {(x.name, tuple(sorted(x.labels.items()))): x.value
               for f in text_string_to_metric_families(text) for x in f.samples}
    names = {n for n, _ in samples}
    assert {n for n, _, _ in METRICS} - {"trainguard_checkpoint_stall_seconds", "trainguard_straggler_ratio"} <= names
    assert samples[("trainguard_worker_failures_total", (("category", "host_oom"),))] == 1
    assert samples[("trainguard_step_duration_seconds", (("rank", "1"),))] == 0.4
    assert all(re.fullmatch(r"trainguard_[a-z_]+", n) for n in names)


def test_span_tail_follows_growth_partial_lines_and_aging(tmp_path):
    d = tmp_path / "profiling" / "0"
    d.mkdir(parents=True)
    rec = '{"rank":0,"kind":"Step","name":"Step","step":%d,"start_ns":%d,"end_ns":%d,"dur_us":1.0}\n'
    f1 = d / "1000"
    f1.write_text(rec % (1, 1, 2) + (rec % (2, 2, 3))[:20])  # the second record is half written
    tail = SpanTail(tmp_path)
    assert [s.step for s in tail.read()] == [1]
    with open(f1, "a") as f:
        f.write((rec % (2, 2, 3))[20:])
    (d / "1001").write_text(rec % (3, 3, 4))
    assert [s.step for s in tail.read()] == [2, 3]
    f1.unlink()
    assert tail.read() == [] and len(tail._offsets) == 1
    late = SpanTail(tmp_path, start_bytes=10)  # a live view starts at the newest file's tail
    assert late.read() == []


def test_read_report_refuses_other_files(tmp_path):
    (tmp_path / "hang-20260101-000000-n-attempt0.txt").write_text("report")
    (tmp_path / "events.db").write_text("x")
    assert read_report(tmp_path, "hang-20260101-000000-n-attempt0.txt") == "report"
    assert read_report(tmp_path, "events.db") is None and read_report(tmp_path, "../hang-x.txt") is None


def test_stack_request_protocol(tmp_path):
    d = stack_requests.write_request(tmp_path, ["b"])
    now = json.loads((d / "request.json").read_text())["time"]
    assert stack_requests.pending(tmp_path, "a", set(), now) == []  # not asked
    assert stack_requests.pending(tmp_path, "b", set(), now) == [d]
    assert stack_requests.pending(tmp_path, "b", set(), now + stack_requests.MAX_AGE_S + 1) == []  # too old
    assert stack_requests.write_answer(d, "b", 1, [{"rank": 3, "pid": 9, "threads": []}])
    assert stack_requests.pending(tmp_path, "b", set(), now) == []  # answered
    assert stack_requests.read_answers(d)["b"]["dumps"][0]["rank"] == 3


def test_dashboard_token(tmp_path):
    """A token given with --token: every API call must present it."""
    from trainguard.web.server import is_loopback

    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("10.1.2.3")
    run = tmp_path / "run"

    store = EventStore(run)
    EventBus(store, node="n0").emit("job_started", "attempt 0", evidence={"attempt": 0, "pids": {}})
    store.close()
    dash = subprocess.Popen([sys.executable, "-m", "trainguard", "dashboard", str(run), "--port", "0", "--token", "s3cret-token"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO)
    try:
        url = re.search(r"http://\S+", dash.stdout.readline()).group(0)
        parts = urllib.parse.urlsplit(url)
        token = urllib.parse.parse_qs(parts.query)["token"][0]
        assert token == "s3cret-token"
        base = f"{parts.scheme}://{parts.netloc}"
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(f"{base}/api/state", timeout=10)
        assert err.value.code == 403
        with urllib.request.urlopen(f"{base}/api/state?token={token}", timeout=10) as r:
            assert json.load(r)["summary"]["nodes"][0]["node"] == "n0"
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(f"{base}/api/hang?token={token}&name=../events.db", timeout=10)
        assert err.value.code == 404
    finally:
        dash.send_signal(signal.SIGTERM)
        dash.wait(timeout=30)
        dash.stdout.close()

