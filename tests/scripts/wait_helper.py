"""The outside world a rank waits on, for tests/scripts/wait_patterns.py: a slow HTTP server, an
HTTP server that stalls (accepts, reads the request, sends nothing for --seconds), a slow raw
stream, a slow upload sink, a file lock holder, a trickling pipe writer, a file that appears late.
Loopback only; every mode ends on its own after --max-s.

Run detached (--detach): the process forks, the parent exits at once, and the child — no longer
a descendant of the rank that started it, as a real remote server is not — prints
``ready pid=<pid> port=<port>`` on stdout and serves. Its process group stays the rank's, so a
harness that kills the rank's group kills it too.

--stop-after BYTES (or seconds for lock/writer): the helper stops itself with SIGSTOP (a server
that died without closing its connections, a holder that froze): the waits made dead.
"""

from __future__ import annotations

import argparse
import fcntl
import os
import signal
import socket
import sys
import time
from http.server import BaseHTTPRequestHandler, HTTPServer


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=["http", "stall", "stream", "sink", "flock", "writer", "touch"])
    p.add_argument("--rate", type=float, default=40_000.0, help="bytes per second")
    p.add_argument("--seconds", type=float, default=40.0, help="how long the served wait lasts")
    p.add_argument("--stop-after", type=float, default=-1.0, help="SIGSTOP self after this many bytes/seconds")
    p.add_argument("--path", default="")
    p.add_argument("--max-s", type=float, default=300.0)
    p.add_argument("--detach", action="store_true")
    return p.parse_args()


def ready(port: int = 0) -> None:
    print(f"ready pid={os.getpid()} port={port}", flush=True)
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)  # the rank's pipe is closed: it reads one line, then EOF


def stop_self() -> None:
    os.kill(os.getpid(), signal.SIGSTOP)


def paced(send, total: float, rate: float, stop_after: float) -> None:
    """Send ``total`` bytes at ``rate`` bytes/s in 1/10 s chunks; freeze after ``stop_after``."""
    chunk = max(1, int(rate / 10))
    sent = 0
    while sent < total:
        send(b"x" * chunk)
        sent += chunk
        if 0 <= stop_after <= sent:
            stop_self()
        time.sleep(0.1)


def serve_http(args: argparse.Namespace) -> None:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *a) -> None:  # quiet
            pass

        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            if args.mode == "stall":  # a remote service that thinks: the connection open, nothing sent
                stalled = args.seconds if args.stop_after < 0 else min(args.seconds, args.stop_after)
                time.sleep(stalled)
                if 0 <= args.stop_after:
                    stop_self()
                self.send_response(200)
                self.send_header("Content-Length", "3")
                self.end_headers()
                self.wfile.write(b"ok\n")
                return
            total = int(args.rate * args.seconds)
            self.send_response(200)
            self.send_header("Content-Length", str(total))
            self.end_headers()
            paced(self.wfile.write, total, args.rate, args.stop_after)

        def do_POST(self) -> None:  # noqa: N802
            left = int(self.headers.get("Content-Length", "0"))
            while left > 0:  # a slow reader: the uploader's sendall blocks on a full window
                left -= len(self.rfile.read(min(left, max(1, int(args.rate / 10)))))
                time.sleep(0.1)
            self.send_response(204)
            self.end_headers()

    srv = HTTPServer(("127.0.0.1", 0), Handler)
    ready(srv.server_address[1])
    srv.timeout = args.max_s
    srv.handle_request()  # one download or upload, then gone


def serve_stream(args: argparse.Namespace) -> None:
    lsock = socket.socket()
    lsock.bind(("127.0.0.1", 0))
    lsock.listen(1)
    lsock.settimeout(args.max_s)
    ready(lsock.getsockname()[1])
    conn, _ = lsock.accept()
    paced(conn.sendall, args.rate * args.seconds, args.rate, args.stop_after)
    conn.close()


def hold_flock(args: argparse.Namespace) -> None:
    with open(args.path, "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        ready()
        if args.stop_after >= 0:
            time.sleep(args.stop_after)
            stop_self()
        time.sleep(args.seconds)


def trickle(args: argparse.Namespace) -> None:
    """Write a line into the FIFO at --path every --seconds/4 seconds, four times."""
    fd = os.open(args.path, os.O_RDWR)  # O_RDWR: no block on open while the reader is not there yet
    ready()
    if args.stop_after >= 0:
        time.sleep(args.stop_after)
        stop_self()  # froze before writing anything: the reader's wait is dead from here
    for i in range(4):
        time.sleep(args.seconds / 4)
        os.write(fd, f"tick {i}\n".encode())
    os.close(fd)


def touch_later(args: argparse.Namespace) -> None:
    ready()
    time.sleep(args.seconds)
    with open(args.path, "w") as f:
        f.write("ok\n")


def main() -> int:
    args = parse()
    if args.detach and os.fork() > 0:
        os._exit(0)  # the rank reaps this parent at once; the child is nobody's descendant
    signal.signal(signal.SIGALRM, lambda *_: os._exit(3))
    signal.alarm(int(args.max_s) + 5)  # bounded whatever happens (a stopped helper is killed by its group)
    {"http": serve_http, "stall": serve_http, "stream": serve_stream, "sink": serve_http, "flock": hold_flock,
     "writer": trickle, "touch": touch_later}[args.mode](args)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
