"""The dashboard refuses an open API off loopback, serves only this run's regular
hang reports, survives a dangling one, checks the Host header (DNS rebinding) and queues a burst
of 200 connections. On loopback too the API needs the token printed at start (a cookie, a Bearer
header or ``?token=``) unless ``--no-token``; a run dir its user cannot read is refused. A real
server on a real socket."""

from __future__ import annotations

import http.client
import json
import os
import select
import shutil
import signal
import socket
import subprocess
import threading
import time
import urllib.parse

import pytest
from tgtest import trainguard_cmd

from trainguard.events import EventBus, EventStore
from trainguard.events.store import node_db_path
from trainguard.view.live import RunView
from trainguard.web.server import serve

BURST = 200


def make_run(run) -> None:
    store = EventStore(node_db_path(run, "n0"))
    EventBus(store, node="n0").emit("job_started", "go", evidence={"pids": {"0": 1}, "attempt": 0})
    store.close()


@pytest.fixture
def run(tmp_path):
    run = tmp_path / "run"
    make_run(run)
    return run


@pytest.fixture
def server(run):
    view = RunView(run)
    srv = serve(view, "127.0.0.1", 0, None)
    started = threading.Event()

    def loop() -> None:
        started.wait()
        srv.serve_forever(poll_interval=0.1)

    t = threading.Thread(target=loop, daemon=True)
    t.start()
    srv.start = started.set  # a test may fill the listen queue before the server accepts
    yield srv
    started.set()
    srv.shutdown()
    srv.server_close()
    view.close()
    t.join(timeout=30)


def get(srv, path: str, host: str | None = None) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection(*srv.server_address[:2], timeout=60)
    try:
        conn.putrequest("GET", path, skip_host=True)
        conn.putheader("Host", host or f"127.0.0.1:{srv.server_address[1]}")
        conn.endheaders()
        r = conn.getresponse()
        return r.status, r.read()
    finally:
        conn.close()


@pytest.mark.parametrize("token", ["", "abc"])
def test_off_loopback_an_empty_or_short_token_is_refused(run, token):
    done = subprocess.run(trainguard_cmd("dashboard", run, "--host", "0.0.0.0", "--port", "0", "--token", token),
                          capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
    assert done.returncode == 2, done.stdout
    assert len(done.stderr.strip().splitlines()) == 1 and "--token" in done.stderr


def test_only_regular_hang_reports_of_the_run_are_served(run, server):
    server.start()
    (run / "hang-real.txt").write_text("rank 0 stuck in all_reduce\n")
    (run / "hang-passwd.txt").symlink_to("/etc/passwd")
    (run / "hang-dangling.txt").symlink_to(run / "gone.txt")
    os.mkfifo(run / "hang-fifo.txt")
    (run / "hang-dir.txt").mkdir()
    status, body = get(server, "/api/state")
    assert status == 200
    assert [h["name"] for h in json.loads(body)["hang_reports"]] == ["hang-real.txt"]
    assert get(server, "/api/hang?name=hang-real.txt") == (200, b"rank 0 stuck in all_reduce\n")
    for name in ("hang-passwd.txt", "hang-dangling.txt", "hang-fifo.txt", "hang-dir.txt", "../run/hang-real.txt"):
        assert get(server, f"/api/hang?name={name}")[0] == 404, name


def test_host_header_is_checked_against_dns_rebinding(server):
    server.start()
    port = server.server_address[1]
    assert get(server, "/api/state", host=f"attacker.example:{port}")[0] == 421
    assert get(server, "/", host="attacker.example")[0] == 421
    for ok in (f"127.0.0.1:{port}", f"localhost:{port}", "localhost", f"[::1]:{port}"):
        assert get(server, "/api/state", host=ok)[0] == 200, ok


def test_a_burst_of_200_connections_is_queued_and_answered(server):
    """All 200 connect while the server is busy (not accepting yet), then every request is answered
    (the socketserver default listen backlog of 5 dropped most of them)."""
    addr = server.server_address[:2]
    socks = []
    try:
        for _ in range(BURST):
            s = socket.socket()
            s.setblocking(False)
            s.connect_ex(addr)
            socks.append(s)
        deadline = time.monotonic() + 30
        pending = set(socks)
        while pending and time.monotonic() < deadline:
            _, writable, _ = select.select([], list(pending), [], 0.5)
            pending -= set(writable)
        connected = [s for s in socks if s not in pending and s.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) == 0]
        assert len(connected) == BURST, f"{BURST - len(connected)} of {BURST} connections not queued"
        server.start()
        for s in socks:
            s.setblocking(True)
            s.settimeout(120)
            s.sendall(f"GET /favicon.ico HTTP/1.0\r\nHost: 127.0.0.1:{addr[1]}\r\n\r\n".encode())
        answers = [s.recv(64) for s in socks]
        assert all(a.startswith(b"HTTP/1.0 204") for a in answers), answers[:3]
    finally:
        for s in socks:
            s.close()


class Dash:
    """`trainguard dashboard` as a process: the URL it printed, stopped at the end."""

    def __init__(self, run, *flags: str) -> None:
        self.proc = subprocess.Popen(trainguard_cmd("dashboard", run, "--port", "0", *flags), stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL, start_new_session=True)
        self.lines = [self.proc.stdout.readline()]  # the one line it prints at start (EOF if it failed)
        assert " on http://" in self.lines[0], self.lines[0] + self.proc.stderr.read()
        url = urllib.parse.urlsplit(self.lines[0].split(" on ", 1)[1].split()[0])
        self.address = url.hostname, url.port
        self.token = (urllib.parse.parse_qs(url.query).get("token") or [None])[0]

    def get(self, path: str, headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], bytes]:
        conn = http.client.HTTPConnection(*self.address, timeout=60)
        try:
            conn.request("GET", path, headers=headers or {})
            r = conn.getresponse()
            return r.status, {k.lower(): v for k, v in r.getheaders()}, r.read()
        finally:
            conn.close()

    def stop(self) -> list[str]:
        self.proc.send_signal(signal.SIGTERM)
        out, _ = self.proc.communicate(timeout=60)
        return self.lines + out.splitlines()


def test_on_loopback_the_api_needs_the_random_token_printed_once_at_start(run):
    dash = Dash(run)
    try:
        token = dash.token
        assert token and len(token) >= 16
        assert dash.get("/api/state")[0] == 403
        assert dash.get("/api/state?token=wrong-token")[0] == 403
        assert dash.get("/api/state", {"Authorization": "Bearer wrong-token"})[0] == 403
        assert dash.get("/api/state", {"Authorization": f"Bearer {token}"})[0] == 200
        status, headers, _ = dash.get(f"/?token={token}")  # the page opened from the printed URL
        assert status == 200
        name, _, rest = headers["set-cookie"].partition("=")
        value, *attrs = [a.strip() for a in rest.split(";")]
        assert value == token and {"HttpOnly", "SameSite=Strict"} <= set(attrs), headers["set-cookie"]
        assert dash.get("/api/state", {"Cookie": f"{name}={token}"})[0] == 200  # later calls: the cookie alone
        assert dash.get("/api/state", {"Cookie": f"{name}=wrong-token"})[0] == 403
        assert "set-cookie" not in dash.get("/?token=wrong-token")[1]
    finally:
        lines = dash.stop()
    assert sum(token in ln for ln in lines) == 1  # printed once


def test_no_token_turns_the_token_off_on_loopback_only(run):
    dash = Dash(run, "--no-token")
    try:
        assert dash.token is None
        assert dash.get("/api/state")[0] == 200
    finally:
        dash.stop()
    done = subprocess.run(trainguard_cmd("dashboard", run, "--host", "0.0.0.0", "--port", "0", "--no-token"),
                          capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1 and "--no-token" in done.stderr


def test_a_run_dir_its_user_cannot_read_is_refused_in_one_line(run):
    cmd = trainguard_cmd("dashboard", run, "--port", "0")
    if os.geteuid() == 0:  # root reads anything: drop the capabilities that let it
        if shutil.which("setpriv") is None:
            if os.environ.get("CI"):
                pytest.fail("needs setpriv to run the dashboard as root without CAP_DAC_OVERRIDE")
            pytest.skip("needs setpriv to run the dashboard as root without CAP_DAC_OVERRIDE")
        cmd = ["setpriv", "--bounding-set", "-dac_override,-dac_read_search", "--", *cmd]
    run.chmod(0)
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
    finally:
        run.chmod(0o700)
    assert done.returncode == 2, done.stdout + done.stderr
    assert len(done.stderr.strip().splitlines()) == 1 and "cannot read the run dir" in done.stderr, done.stderr
