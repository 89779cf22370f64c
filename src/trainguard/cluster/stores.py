"""Where trainguard's TCP stores listen, and how the keys agents act on are signed.

torch's ``TCPStore`` server listens on every interface and trusts whoever connects. trainguard's
own stores (the per-round worker store, the node-check group stores, the rendezvous store of a
``--standalone`` job) are instead bound to one address: loopback for a single-node job, else the
address the other nodes reach this one through (``--local-addr``, or the local end of the route
to the rendezvous endpoint). A store is bound by handing torch a socket we bound ourselves
(``TCPStore(master_listen_fd=...)``).

The keys an agent acts on — stop the job, a node leaves, where the workers' store is — carry an
HMAC under a per-job key (``JobKey``). A value without the right one (a stray client, another
job's agent on the wrong port) is ignored and reported, never obeyed.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import socket
from datetime import timedelta
from typing import Any

SECRET_ENV = "TRAINGUARD_JOB_SECRET"
_MAC_LEN = 32  # hex characters of the HMAC kept in a value


def route_source(host: str | None) -> str | None:
    """The local address on the route to ``host`` (no packet is sent); None when there is none."""
    if not host:
        return None
    try:
        infos = socket.getaddrinfo(host, 9, type=socket.SOCK_DGRAM)
    except OSError:
        return None
    for family, _, _, _, addr in infos:
        try:
            with socket.socket(family, socket.SOCK_DGRAM) as s:
                s.connect(addr)
                return s.getsockname()[0]
        except OSError:
            continue
    return None


def address_toward(host: str | None) -> str:
    """The address other nodes reach this one through, seen from ``host``: the local end of the
    route to it, else what this host's name resolves to, else loopback."""
    addr = route_source(host)
    if addr is not None:
        return addr
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


def is_loopback(addr: str) -> bool:
    return addr in ("localhost", "::1") or addr.startswith("127.")


def reaches_loopback(host: str) -> bool:
    """Whether ``host`` (a name or an address) is this machine's loopback: a node name that
    /etc/hosts maps to 127.0.0.1 (nodes simulated on one machine, as Slurm test beds do) is."""
    if is_loopback(host):
        return True
    try:
        infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except (OSError, UnicodeError):
        return False
    return any(is_loopback(str(info[4][0])) for info in infos)


def bound_store(addr: str, port: int = 0, timeout_s: float = 300, multi_tenant: bool = False) -> Any:
    """A TCPStore server listening on ``addr`` only (port 0: a free one; ``.port`` tells which)."""
    from torch.distributed import TCPStore

    family = socket.AF_INET6 if ":" in addr else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((addr, port))
        sock.listen(512)
        port = sock.getsockname()[1]
        fd = os.dup(sock.fileno())  # the store's server owns (and closes) the descriptor it is given
    try:
        return TCPStore(
            addr,
            port,
            is_master=True,
            wait_for_workers=False,
            timeout=timedelta(seconds=timeout_s),
            multi_tenant=multi_tenant,
            master_listen_fd=fd,
            use_libuv=True,
        )
    except BaseException:
        os.close(fd)
        raise


def can_connect(addr: str, port: int, timeout_s: float) -> str | None:
    """None when a TCP connection to addr:port opens within ``timeout_s``, else why not."""
    try:
        with socket.create_connection((addr, port), timeout=timeout_s):
            return None
    except OSError as exc:
        return exc.strerror or str(exc) or type(exc).__name__


class JobKey:
    """The per-job HMAC key agents sign and check the keys they act on with.

    Every agent of a job derives the same key from the rendezvous id and, when set, the
    ``TRAINGUARD_JOB_SECRET`` environment variable (give every node the same value, e.g. from the
    scheduler's secret store). Without it the key protects against stray and misdirected writers,
    not against someone who knows the rendezvous id. A single-node job draws a random key.
    """

    def __init__(self, key: bytes) -> None:
        self._key = key

    @classmethod
    def for_job(cls, run_id: str, single_node: bool) -> JobKey:
        if single_node:
            return cls(secrets.token_bytes(32))
        material = b"trainguard-job\0" + run_id.encode() + b"\0" + os.environ.get(SECRET_ENV, "").encode()
        return cls(hashlib.sha256(material).digest())

    def _mac(self, key: str, value: str) -> str:
        return hmac.new(self._key, f"{key}\0{value}".encode(), hashlib.sha256).hexdigest()[:_MAC_LEN]

    def sign(self, key: str, value: str) -> str:
        """The value as stored under ``key``: the MAC (bound to the key's name) and the value."""
        return f"{self._mac(key, value)}:{value}"

    def open(self, key: str, raw: bytes | str) -> str | None:
        """The value stored under ``key`` when its MAC is right, else None."""
        text = raw.decode(errors="replace") if isinstance(raw, bytes) else raw
        mac, sep, value = text.partition(":")
        if not sep or not hmac.compare_digest(mac, self._mac(key, value)):
            return None
        return value
