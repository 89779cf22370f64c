"""Event model, SQLite store, `trainguard events`, and notifications over real HTTP on loopback."""

from __future__ import annotations

import json
import subprocess
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer

import pytest
from tgtest import trainguard_cmd, wait_for

from trainguard.events import Event, EventBus, EventStore, Severity
from trainguard.events.notify import Notifier


def test_store_roundtrip_and_filters(tmp_path):
    store = EventStore(tmp_path)
    bus = EventBus(store, node="n0")
    bus.emit("job_started", "go", evidence={"pids": {"0": 11}})
    bus.emit("worker_failed", "boom", severity="error", rank=1, evidence={"exitcode": -9})
    other = EventStore(tmp_path, readonly=True)  # a second connection sees committed rows
    got = other.query()
    assert [(e.kind, e.severity, e.rank, e.node) for e in got] == [
        ("job_started", Severity.INFO, None, "n0"),
        ("worker_failed", Severity.ERROR, 1, "n0"),
    ]
    assert got[1].evidence == {"exitcode": -9}
    assert [e.kind for e in other.query(min_severity=Severity.WARNING)] == ["worker_failed"]
    assert [e.kind for e in other.query(after_id=got[0].id)] == ["worker_failed"]
    assert store.path.name == "events.db"
    assert store._conn.execute("PRAGMA journal_mode").fetchone()[0] == "persist"  # rollback journal: safe on NFS


def test_node_databases_with_any_node_name_are_read_back(tmp_path):
    """Node names are quoted into file names (``a@b`` -> ``a%40b.db``); the reader opened them
    through an SQLite URI that decoded the quoting again and found nothing."""
    from trainguard.events.store import node_db_path, read_all

    for node in ("n1", "chaos@host", "a b/c", "50%"):
        store = EventStore(node_db_path(tmp_path, node))
        EventBus(store, node=node).emit("job_started", f"on {node}")
        store.close()
    assert sorted(e.node for e in read_all(tmp_path)) == sorted(["n1", "chaos@host", "a b/c", "50%"])


def test_severity_parse_rejects_unknown():
    assert Severity.parse("Warning") is Severity.WARNING
    with pytest.raises(ValueError, match="unknown severity"):
        Severity.parse("loud")


def test_events_cli_table_json_and_kind(tmp_path):
    bus = EventBus(EventStore(tmp_path), node="n0")
    bus.emit("job_started", "go")
    bus.emit("restart", "again", severity="warning", evidence={"restart_count": 1})
    res = subprocess.run(trainguard_cmd("events", tmp_path, "--json"), capture_output=True, text=True, timeout=60)
    rows = [json.loads(line) for line in res.stdout.splitlines()]
    assert [r["kind"] for r in rows] == ["job_started", "restart"]
    assert set(rows[0]) >= {"time", "kind", "severity", "node", "rank", "message", "evidence"}
    assert rows[1]["severity"] == "warning" and rows[1]["evidence"] == {"restart_count": 1}
    res = subprocess.run(trainguard_cmd("events", tmp_path, "--kind", "restart"), capture_output=True, text=True, timeout=60)
    lines = res.stdout.splitlines()
    assert lines[0].startswith("time") and len(lines) == 2 and "again" in lines[1]
    res = subprocess.run(trainguard_cmd("events", tmp_path / "nope"), capture_output=True, text=True, timeout=60)
    assert res.returncode == 2 and "no events" in res.stderr


def test_events_follow_prints_new_events(tmp_path):
    bus = EventBus(EventStore(tmp_path), node="n0")
    bus.emit("job_started", "first")
    proc = subprocess.Popen(trainguard_cmd("events", tmp_path, "--follow", "--json"), stdout=subprocess.PIPE, text=True)
    try:
        assert json.loads(proc.stdout.readline())["message"] == "first"
        bus.emit("job_succeeded", "second")
        assert json.loads(proc.stdout.readline())["message"] == "second"
    finally:
        proc.kill()
        proc.wait(timeout=30)


class _Hook(BaseHTTPRequestHandler):
    received: list[dict] = []

    def do_POST(self):  # noqa: N802
        body = self.rfile.read(int(self.headers["Content-Length"]))
        _Hook.received.append(json.loads(body))
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args):
        pass


def test_notifier_delivers_over_http_and_survives_a_dead_endpoint():
    server = HTTPServer(("127.0.0.1", 0), _Hook)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    _Hook.received.clear()
    dead = HTTPServer(("127.0.0.1", 0), _Hook)
    dead_port = dead.server_address[1]
    dead.server_close()  # nothing listens there any more
    try:
        good = Notifier([f"json://127.0.0.1:{server.server_address[1]}/hook"], Severity.ERROR, job="j1")
        bad = Notifier([f"json://127.0.0.1:{dead_port}/hook"], Severity.ERROR)
        bus = EventBus(None, node="n0")
        bus.subscribe(good)
        bus.subscribe(bad)
        bus.emit("restart", "below threshold", severity="warning")
        bus.emit("job_failed", "it broke", severity="critical", rank=2)
        wait_for(lambda: _Hook.received, 60, "webhook delivery")
        bad.flush(60)
        assert len(_Hook.received) == 1
        msg = _Hook.received[0]
        assert "job_failed" in msg["title"] and "it broke" in msg["message"] and "rank=2" in msg["message"]
        assert bad.failures == 1 and bad.sent == 0
        good.close()
        bad.close()
    finally:
        server.shutdown()
        server.server_close()


def test_event_json_shape():
    e = Event(kind="k", message="m", severity=Severity.CRITICAL, node="n", rank=3, evidence={"a": 1}, time=1.5)
    assert json.loads(e.to_json()) == {
        "kind": "k", "message": "m", "severity": "critical", "node": "n", "rank": 3, "evidence": {"a": 1}, "time": 1.5, "id": None
    }
    assert Event.from_dict(e.to_dict()) == e


def _excluded(bus: EventBus, d) -> None:
    """A node_excluded event as the agent records one when it carries out an exclusion (agent/launch.py)."""
    bus.emit("node_excluded", d.exit_message or d.reason, severity="error", rank=d.rank,
             evidence={"reason": d.reason, "source": d.source, **d.evidence})


def test_hardware_reschedules_count_hardware_faults_only(tmp_path):
    """seed 003's "reschedules caused by hardware problems": a GPU fault, a failed node check, a
    hardware item of the pre-check and a lost node count; a full disk, a dns failure and a straggler
    do not. Every node writes its own event database; `trainguard status` folds them."""
    from trainguard import policy
    from trainguard.events.store import node_db_path
    from trainguard.evidence import CheckOutcome, HardwareFault, NodeLost

    run = tmp_path / "run"
    buses = {}

    def bus(node: str) -> EventBus:
        if node not in buses:
            buses[node] = EventBus(EventStore(node_db_path(run, node)), node=node)
        return buses[node]

    def before_start(node: str, outcome: CheckOutcome, **kw) -> None:
        _excluded(bus(node), policy.decide_before_start(outcome, 0, 8, 1, **kw))

    before_start("disk", CheckOutcome("precheck", {0: "pre-check failed: item disk-size root ... failed (0.6 MB free at /)"}))
    before_start("dns", CheckOutcome("precheck", {0: "pre-check failed: item dns ... failed (1 of 1 name(s) do not resolve: x)"}))
    before_start("slow", CheckOutcome("node_check", stragglers={0: "3.0x the median"}), exclude_stragglers=True)
    before_start("gpu", CheckOutcome("precheck", {0: "pre-check failed: item gpu-check ... failed (Xid 79)"},
                                     hardware_faulty=frozenset({0})))
    before_start("nic", CheckOutcome("node_check", {0: "all-reduce timed out"}))
    _excluded(bus("ecc"), policy.decide_on_hardware_fault(HardwareFault(["uncorrectable ECC error on GPU 3"], "ecc", 0), 8, 1))
    lost = NodeLost({"gone": "no heartbeat for 30.0 s"}, [], 30.0)
    for survivor in ("a", "b"):  # every survivor reports the same lost node: one reschedule
        bus(survivor).emit("node_lost", lost.message, severity="error", evidence=lost.to_dict())
    for b in buses.values():
        b.store.close()
    out = subprocess.run(trainguard_cmd("status", run, "--once"), capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "reschedules for hardware faults 4," in out.stdout, out.stdout
    snap = json.loads(subprocess.run(trainguard_cmd("status", run, "--json"), capture_output=True, text=True,
                                     timeout=120, check=True).stdout)
    assert snap["hardware_reschedules"] == 4
