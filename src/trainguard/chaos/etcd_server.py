"""A real etcd server for test beds and failure rehearsals: the rendezvous that outlives any node.

torch's etcd rendezvous (``--rdzv-backend etcd-v2``) speaks etcd's v2 API, which etcd 3.4 serves
only with ``--enable-v2``. The server runs as a child process, on loopback or inside a test bed's
namespace (``prefix``: ``ip netns exec NS``), with its data in a directory of its own; ``close()``
stops it and removes nothing it did not make.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path


class EtcdError(Exception):
    pass


def available() -> str | None:
    """Why an etcd rendezvous cannot be rehearsed here (None: it can)."""
    if shutil.which("etcd") is None:
        return "etcd is not installed (Debian: apt-get install etcd-server)"
    try:
        import etcd  # noqa: F401  (python-etcd, the client torch's backend imports)
    except ImportError:
        return "python-etcd is not installed (pip install 'trainguard[etcd]')"
    return None


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class EtcdServer:
    """One etcd member serving clients at ``self.endpoint`` (``host:port``)."""

    def __init__(self, data_dir: Path, host: str = "127.0.0.1", prefix: list[str] | None = None,
                 client_port: int | None = None, timeout_s: float = 60.0) -> None:  # fmt: skip
        self.host = host
        self._prefix = prefix or []
        self._dir = Path(data_dir)
        self._dir.mkdir(parents=True, exist_ok=True)
        self.proc: subprocess.Popen | None = None
        # Inside a namespace of our own every port is free; on loopback, ask the kernel (and try
        # again with others should another process take one in between).
        for _ in range(3):
            fixed = bool(self._prefix)
            self.port = client_port or (2379 if fixed else _free_port(host))
            peer = 2380 if fixed else _free_port(host)
            if self._start(peer, timeout_s):
                return
            if fixed:
                break
        raise EtcdError(f"etcd did not start: {self._log_tail()}")

    @property
    def endpoint(self) -> str:
        return f"{self.host}:{self.port}"

    def _start(self, peer_port: int, timeout_s: float) -> bool:
        client = f"http://{self.host}:{self.port}"
        peer = f"http://{self.host}:{peer_port}"
        cmd = [
            *self._prefix, "etcd", "--name", "tg", "--data-dir", str(self._dir / "data"), "--enable-v2",
            "--listen-client-urls", client, "--advertise-client-urls", client,
            "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer, "--initial-cluster", f"tg={peer}",
        ]  # fmt: skip
        log = open(self._dir / "etcd.log", "ab")  # noqa: SIM115  (the child keeps writing to it)
        try:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        finally:
            log.close()
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                return False
            if self._answers(f"{client}/v2/keys/"):
                return True
            time.sleep(0.2)
        self._stop()
        return False

    def _answers(self, url: str) -> bool:
        """Whether the v2 API answers at ``url``, asked from where the server's clients are (a
        namespace's address is not reachable from the host's)."""
        if self._prefix:
            code = "import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=2)"
            try:
                return subprocess.run([*self._prefix, sys.executable, "-c", code, url], capture_output=True, timeout=10).returncode == 0
            except subprocess.TimeoutExpired:
                return False
        try:
            with urllib.request.urlopen(url, timeout=2) as r:  # noqa: S310 (our own server)
                return r.status == 200
        except OSError:
            return False

    def _log_tail(self) -> str:
        try:
            return (self._dir / "etcd.log").read_text(errors="replace").strip().splitlines()[-1][:300]
        except (OSError, IndexError):
            return "no log"

    def _stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=20)

    def close(self) -> None:
        self._stop()

    def __enter__(self) -> EtcdServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
