"""Where trainguard's TCP stores listen, and how the keys agents act on are signed.

torch's ``TCPStore`` server listens on every interface and trusts whoever connects. trainguard's
own stores (the per-round worker store, the node-check group stores, the rendezvous store of a
``--standalone`` job) are instead bound to one address: loopback for a single-node job, else the
address the other nodes reach this one through (``--local-addr``, or the local end of the route
to the rendezvous endpoint). A store is bound by handing torch a socket we bound ourselves
(``TCPStore(master_listen_fd=...)``).

Every value an agent acts on carries an HMAC under a per-job key (``JobKey``): stop the job, a
node leaves, where the workers' store is, the run id, and everything the monitors exchange
(straggler windows and verdicts, the hang views, claims and verdict, the pre-check and node-check
outcomes, the liveness records). They all go through one helper, ``SignedStore``, which wraps
the rendezvous store: ``set``/``compare_set`` sign, ``get`` opens and checks. A value without the
right MAC (a stray client, a local process writing to the store's port, another job's agent on
the wrong port) is never returned: it is reported once (``on_rejected``: the agent records a
``store_write_rejected`` warning) and read as absent (``ForgedValue``). Counters (``add``) cannot
carry a MAC: what agents count through them (heartbeats, how many nodes published) only delays
a decision, it never makes one.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import socket
import threading
from collections.abc import Callable, Iterable
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

    def derive(self, purpose: str) -> bytes:
        """A key of its own for one purpose (e.g. signing snapshot replicas), from the job's key."""
        return hmac.new(self._key, b"trainguard-derive\0" + purpose.encode(), hashlib.sha256).digest()

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


class ForgedValue(ValueError):
    """A value in the store that no agent of this job wrote (its MAC is missing or wrong)."""

    def __init__(self, key: str) -> None:
        super().__init__(f"{key}: not signed by an agent of this job")
        self.key = key


Rejected = Callable[[str, str], None]  # (key, the value as found, shortened)
_FORGED_RETRIES = 3  # compare_set: how often a forged value in the way is replaced


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class Rejections:
    """Reports each forged (key, value) once, shared by a store and its clones (several threads)."""

    def __init__(self, on_rejected: Rejected | None) -> None:
        self.on_rejected = on_rejected
        self._seen: set[tuple[str, bytes]] = set()
        self._lock = threading.Lock()

    def __call__(self, key: str, raw: bytes) -> None:
        with self._lock:
            if (key, raw) in self._seen or len(self._seen) > 10_000:
                return
            self._seen.add((key, raw))
        if self.on_rejected is not None:
            self.on_rejected(key, raw.decode(errors="replace")[:200])


class SignedStore:
    """The rendezvous store as the agents' own keys see it: every value signed with the job's key
    (see the module's doc). Method names and results are the c10d ``Store``'s, so the monitors
    use it as they would the store; ``get`` raises ``ForgedValue`` for a value no agent of this
    job wrote, ``get_many`` leaves such values out."""

    def __init__(self, store: Any, key: JobKey, on_rejected: Rejected | Rejections | None = None) -> None:
        self.store = store
        self.job_key = key
        self._report = on_rejected if isinstance(on_rejected, Rejections) else Rejections(on_rejected)

    def _open(self, key: str, raw: bytes) -> bytes:
        value = self.job_key.open(key, raw)
        if value is None:
            self._report(key, bytes(raw))
            raise ForgedValue(key)
        return value.encode()

    def set(self, key: str, value: str | bytes) -> None:
        self.store.set(key, self.job_key.sign(key, _text(value)))

    def get(self, key: str) -> bytes:
        return self._open(key, self.store.get(key))

    def get_many(self, keys: list[str]) -> dict[str, bytes]:
        """The genuine values of ``keys`` (which must exist): one round trip where the store can."""
        if not keys:
            return {}
        try:
            raws = list(self.store.multi_get(keys))
        except (AttributeError, NotImplementedError, RuntimeError):
            raws = [self.store.get(k) for k in keys]
        out = {}
        for k, raw in zip(keys, raws, strict=True):
            try:
                out[k] = self._open(k, raw)
            except ForgedValue:
                continue
        return out

    def multi_get(self, keys: list[str]) -> list[bytes]:
        found = self.get_many(keys)
        missing = [k for k in keys if k not in found]
        if missing:
            raise ForgedValue(missing[0])
        return [found[k] for k in keys]

    def compare_set(self, key: str, expected: str | bytes, desired: str | bytes) -> bytes:
        """Like the store's; a forged value in the way counts as no value (it is replaced)."""
        signed = self.job_key.sign(key, _text(desired))
        exp: str | bytes = self.job_key.sign(key, _text(expected)) if expected else ""
        for _ in range(_FORGED_RETRIES):
            stood = self.store.compare_set(key, exp, signed)
            try:
                return self._open(key, stood)
            except ForgedValue:
                if expected:  # the value asked for is not there: the caller's compare failed
                    raise
                exp = stood  # take the forged value's place (atomic: only if it is still there)
        raise ForgedValue(key)

    def check(self, keys: Iterable[str]) -> bool:
        return self.store.check(list(keys))

    def add(self, key: str, amount: int) -> int:
        return self.store.add(key, amount)

    def wait(self, keys: list[str], *args: Any) -> None:
        self.store.wait(keys, *args)

    def clone(self) -> SignedStore:
        return SignedStore(self.store.clone(), self.job_key, self._report)

    def __getattr__(self, name: str) -> Any:  # num_keys, delete_key, timeout, ...: the store's own
        if name in ("multi_set", "append", "queue_push"):  # would store unsigned values
            raise AttributeError(f"SignedStore has no {name}")
        return getattr(self.store, name)
