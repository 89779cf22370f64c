"""`trainguard dashboard RUN_DIR`: a web page of the run that updates while the job runs.

Standard library only: a ThreadingHTTPServer serves three static files and a small JSON API the
page polls (``/api/state?after=<event id>``, ``/api/hang?name=<report>``). It binds 127.0.0.1 by
default. Every API call needs a token (``--token``, else a random one printed once in the URL at
start), on loopback too: any local user can reach a loopback port, and the API shows the job's
events, logs' findings and hang reports. The page presents it as ``?token=`` (answered with an
HttpOnly, SameSite=Strict cookie, so later calls need not carry it) or ``Authorization: Bearer``.
``--no-token`` switches it off, on loopback only (a single-user machine). The run directory is
only read; one its user cannot read is refused at start.
"""

from __future__ import annotations

import argparse
import hmac
import ipaddress
import json
import mimetypes
import os
import re
import secrets
import signal
import socket
import sys
import threading
import time
from http import HTTPStatus
from http.cookies import CookieError, SimpleCookie
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, quote, urlparse

from trainguard.options import port_or_zero
from trainguard.rundir.readers import NotARunDir, hang_reports, read_report
from trainguard.view.live import RunView

STATIC = ("index.html", "app.js", "style.css")
LISTEN_BACKLOG = 512
FIRST_EVENTS = 500  # events sent on the first load; later polls send only the new ones
MIN_REFRESH_S = 0.5
MIN_TOKEN = 8  # characters of a token given with --token
_COOKIE_SAFE = re.compile(r"[A-Za-z0-9._~-]+")  # a --token with other characters is never put in a header


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir", help="the job's run directory")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1; any other needs the token)")
    p.add_argument("--port", type=port_or_zero, default=8765, help="port (default 8765; 0 = a free one)")
    tok = p.add_mutually_exclusive_group()
    tok.add_argument("--token", default=None, help=f"token the page must present (default: a random one, printed in "
                     f"the URL at start; at least {MIN_TOKEN} characters)")
    tok.add_argument("--no-token", action="store_true", help="no token: anyone who can reach the port reads the "
                     "run (loopback only, for a single-user machine)")
    p.add_argument("--allow-host", action="append", default=[], metavar="NAME",
                   help="a DNS name the page may be opened by (Host header; repeatable). Loopback names and IP "
                        "addresses are always accepted; other names are refused against DNS rebinding")


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def _static(name: str) -> bytes:
    return resources.files("trainguard.web").joinpath("static", name).read_bytes()


class Dashboard:
    """The state behind the page: one RunView, refreshed at most every MIN_REFRESH_S."""

    def __init__(self, view: RunView, token: str | None, hosts: frozenset[str] = frozenset()) -> None:
        self.view = view
        self.token = token
        self.hosts = hosts  # the Host header names the page may be reached by (empty: loopback names)
        self.cookie = "trainguard_token"  # + the port, once bound (serve)
        self._lock = threading.Lock()
        self._refreshed = 0.0

    def valid(self, given: str) -> bool:
        return self.token is not None and bool(given) and hmac.compare_digest(given.encode(), self.token.encode())

    def state(self, after: int, columns: int) -> dict[str, Any]:
        with self._lock:
            if time.monotonic() - self._refreshed >= MIN_REFRESH_S:
                self.view.refresh()
                self._refreshed = time.monotonic()
            events = [e for e in self.view.events if (e.id or 0) > after]
        if after <= 0:
            events = events[-FIRST_EVENTS:]
        return {
            "run_dir": str(self.view.run_dir),
            "now": time.time(),
            "summary": self.view.snapshot(columns),
            "events": [e.to_dict() for e in events],
            "last_id": max([after] + [e.id or 0 for e in events]),
            "hang_reports": [{"name": p.name, "mtime": mtime} for p, mtime in hang_reports(self.view.run_dir)],
        }


def make_handler(dash: Dashboard) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        server_version = "trainguard-dashboard"
        _cookie = ""  # a valid ``?token=`` of this request: set as the cookie in its answer

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 -- quiet by default
            pass

        def _send(self, status: int, body: bytes, ctype: str) -> None:
            self.send_response(status)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Cache-Control", "no-store")
            self.send_header("X-Content-Type-Options", "nosniff")
            self.send_header("Content-Security-Policy", "default-src 'self'; style-src 'self'; img-src 'self' data:")
            self.end_headers()
            self.wfile.write(body)

        def _json(self, data: Any, status: int = 200) -> None:
            self._send(status, json.dumps(data, default=str).encode(), "application/json")

        def end_headers(self) -> None:
            if self._cookie and _COOKIE_SAFE.fullmatch(self._cookie):  # kept by the browser for this port's calls
                self.send_header("Set-Cookie", f"{dash.cookie}={self._cookie}; HttpOnly; SameSite=Strict; Path=/")
            super().end_headers()

        def _authorized(self, query: dict[str, list[str]]) -> bool:
            """The token as a Bearer header, the page's header, this port's cookie or ``?token=``."""
            if dash.token is None:
                return True
            in_url = (query.get("token") or [""])[0]
            if dash.valid(in_url):
                self._cookie = in_url
                return True
            auth = self.headers.get("Authorization") or ""
            bearer = auth[len("Bearer "):].strip() if auth.startswith("Bearer ") else ""
            return any(dash.valid(given) for given in
                       (bearer, self.headers.get("X-Trainguard-Token") or "", cookie_value(self.headers, dash.cookie)))

        def do_GET(self) -> None:  # noqa: N802 -- http.server's name
            self._cookie = ""
            if not host_allowed(self.headers.get("Host"), dash.hosts):
                # DNS rebinding: a page of another site whose name now resolves to this address
                # would otherwise read the API as a same-origin page.
                return self._json({"error": "unexpected Host header"}, HTTPStatus.MISDIRECTED_REQUEST)
            url = urlparse(self.path)
            query = parse_qs(url.query)
            path = url.path
            if path == "/favicon.ico":
                return self._send(204, b"", "image/x-icon")
            if path in ("/", "/index.html"):
                self._authorized(query)  # the page opened from the printed URL: its token becomes the cookie
                return self._send(200, _static("index.html"), "text/html; charset=utf-8")
            if path.startswith("/static/") and path[len("/static/"):] in STATIC:
                name = path[len("/static/"):]
                ctype = mimetypes.guess_type(name)[0] or "application/octet-stream"
                return self._send(200, _static(name), f"{ctype}; charset=utf-8")
            if not path.startswith("/api/"):
                return self._json({"error": "not found"}, HTTPStatus.NOT_FOUND)
            if not self._authorized(query):
                return self._json({"error": "token required"}, HTTPStatus.FORBIDDEN)
            return self._send(*api_answer(dash, path, query))

    return Handler


def cookie_value(headers: Any, name: str) -> str:
    """The value of cookie ``name`` in a request's Cookie header ("" when none or unreadable)."""
    jar = SimpleCookie()
    try:
        jar.load(headers.get("Cookie") or "")
    except CookieError:
        return ""
    morsel = jar.get(name)
    return morsel.value if morsel is not None else ""


def _as_json(data: Any, status: int = 200) -> tuple[int, bytes, str]:
    return status, json.dumps(data, default=str).encode(), "application/json"


def api_answer(dash: Dashboard, path: str, query: dict[str, list[str]]) -> tuple[int, bytes, str]:
    """(status, body, content type) of an authorised /api/ request."""
    try:
        if path == "/api/state":
            after = int((query.get("after") or ["0"])[0])
            columns = max(10, min(400, int((query.get("columns") or ["80"])[0])))
            return _as_json(dash.state(after, columns))
        if path == "/api/hang":
            text = read_report(dash.view.run_dir, (query.get("name") or [""])[0])
            if text is None:
                return _as_json({"error": "no such report"}, HTTPStatus.NOT_FOUND)
            return 200, text.encode(), "text/plain; charset=utf-8"
    except ValueError as exc:
        return _as_json({"error": str(exc)}, HTTPStatus.BAD_REQUEST)
    except Exception as exc:  # a damaged run-dir file: this refresh fails, the server serves on
        return _as_json({"error": f"cannot read the run: {exc}"}, HTTPStatus.INTERNAL_SERVER_ERROR)
    return _as_json({"error": "not found"}, HTTPStatus.NOT_FOUND)


class _Server(ThreadingHTTPServer):
    request_queue_size = LISTEN_BACKLOG  # socketserver's 5 dropped bursts of page loads
    daemon_threads = True


def host_allowed(header: str | None, hosts: frozenset[str]) -> bool:
    """Whether a request's Host header names this dashboard: a loopback name or address, an IP
    address (a rebinding attack needs a DNS name), or one of ``hosts`` (``--allow-host``)."""
    if not header:
        return False
    try:
        name = urlparse(f"//{header}").hostname or ""
    except ValueError:
        return False
    if name in hosts or name == "localhost" or name.endswith(".localhost"):
        return True
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


def _own_names() -> frozenset[str]:
    """This host's own names: a rebinding attacker cannot make them resolve to this machine."""
    host = socket.gethostname()
    return frozenset({host, host.split(".")[0], socket.getfqdn()})


def serve(view: RunView, host: str, port: int, token: str | None,
          hosts: frozenset[str] = frozenset()) -> ThreadingHTTPServer:
    """The dashboard's server (not serving yet); ``token`` None: an open API."""
    dash = Dashboard(view, token, hosts)
    server = _Server((host, port), make_handler(dash))
    # Cookies are not kept per port: a name per port, so two dashboards on one host do not
    # overwrite each other's token.
    dash.cookie = f"trainguard_token_{server.server_address[1]}"
    return server


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def main(args: argparse.Namespace) -> int:
    problem = _unreadable(Path(args.run_dir)) or _token_problem(args)
    if problem:
        print(f"trainguard dashboard: error: {problem}", file=sys.stderr)
        return 2
    try:
        view = RunView(args.run_dir)
    except NotARunDir as exc:
        print(f"trainguard dashboard: error: {exc}", file=sys.stderr)
        return 2
    token = None if args.no_token else args.token or secrets.token_urlsafe(16)
    try:
        server = serve(view, args.host, args.port, token, frozenset(args.allow_host) | _own_names())
    except OSError as exc:
        view.close()
        print(f"trainguard dashboard: error: cannot listen on {args.host}:{args.port}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    host, port = server.server_address[:2]
    shown = f"[{host}]" if ":" in str(host) else host
    url = f"http://{shown}:{port}/" + (f"?token={quote(token, safe='')}" if token else "")
    print(f"trainguard dashboard of {view.run_dir} on {url}  (Ctrl-C to stop)", flush=True)
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        server.serve_forever(poll_interval=0.5)
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
        view.close()
    return 0


def _token_problem(args: argparse.Namespace) -> str | None:
    if args.no_token:
        if not is_loopback(args.host):
            return f"--no-token is for loopback only: on --host {args.host} anyone who reaches the port would read the run"
        return None
    if args.token is not None and len(args.token) < MIN_TOKEN:
        return (f"the API needs a --token of at least {MIN_TOKEN} characters (or none: a random one is made; "
                "--no-token turns it off on loopback)")
    if args.token is not None and not args.token.isprintable():  # a line break or an escape: a pasting mistake
        return "--token must be printable characters (no line breaks, tabs or control characters)"
    bad = [h for h in args.allow_host if not h.strip() or not h.isprintable() or " " in h]
    if bad:
        return f"--allow-host {bad[0]!r}: expected a DNS name"
    return None


def _unreadable(run_dir: Path) -> str | None:
    """Why this user cannot read the run dir (None: it can, or it is missing: RunView says so)."""
    events = run_dir / "events"
    for d in (run_dir, events):
        try:
            names = os.listdir(d)
        except FileNotFoundError:
            continue
        except NotADirectoryError:  # RunView says what it is
            return None
        except PermissionError:
            return f"cannot read the run dir {d}: permission denied (run the dashboard as a user who can read it)"
        except OSError as exc:
            return f"cannot read the run dir {d}: {exc.strerror or exc}"
        for name in names:
            db = d / name
            if name.endswith(".db") and db.is_file() and not os.access(db, os.R_OK):
                return f"cannot read {db}: permission denied (run the dashboard as a user who can read it)"
    return None
