"""Buddy replication: each node's agent sends its ranks' newest in-memory snapshots to K other
nodes' agents, which keep them in their own shared memory, so a lost node's state (its shards,
with sharded state the only copy) survives the node.

Sender (``Replicator``, one thread in the agent, at nice 10 and under an optional rate cap so the
training's own collectives keep priority; never on a training thread): it watches the node's slot
files (kept open across its polls), and for every rank's newest complete snapshot not sent yet
streams it to each buddy over one TCP connection; snapshots saved while it was still sending an
older one are skipped. It does not pin the slot (the persister owns the pin); a seqlock check after
the last byte decides whether the transfer commits or is abandoned. The MAC is computed once per
snapshot, piece by piece as it is sent, and reused for the other buddies (the seqlock check after
each one proves the bytes unchanged).

Frame: ``MAGIC``, the header's length, the header (JSON: source node, rank, world size, step, seq,
manifest and data lengths), the manifest, the data, then one byte: 1 = commit, followed by the
keyed BLAKE3 MAC under the job's key (``cluster.stores.JobKey``) over header, manifest and data;
0 = abandoned (the worker overwrote the slot meanwhile). The receiver answers one byte.

Receiver (``ReplicaServer``, one thread, at the sender's priority: on a job it competes with its
own node's training): writes the stream into a spare slot file under ``<shm dir>/replicas/`` (same
layout as the workers' slots; the file the previous kept transfer displaced, reused so that no
transfer allocates and zeroes fresh tmpfs pages), hashing it as it arrives, checks the MAC, and
only then marks it complete and renames it over that rank's older replica in
``replicas/<source node>/`` (the displaced file becomes the spare): per source node it keeps
the two newest complete snapshots of each of its ranks (as the workers' double-buffered slots:
buddies receive at their own pace, and a step every rank's copy holds must survive one of them
getting a step further), at the newest world size it sent, and drops the rest; one spare file
besides (the peak is what it was with a fresh file per transfer). An unsigned or wrongly signed
transfer is refused with one line (``on_rejected``) and leaves nothing behind: no replica, and no
more memory held than before it.

After a node loss the buddy's persister writes the lost node's replicas to the checkpoint dir at
the breakpoint (``Persister.persist_replicas``), where ``load_latest`` on every survivor finds every
old rank's shard of the newest step and reshards it.

Fetch (``list_held``, ``fetch``: the same server answers them): the agent of a node that is to run
ranks it holds no snapshot of (a standby taking a lost node's place, a survivor whose ranks moved)
asks the other nodes' agents, before its workers start, what they hold of those ranks (their own
ranks' slots and the replicas they keep) and pulls the newest into its own shared memory, so its
workers resume from memory even where the checkpoint dirs are node-local. The request is signed
under the job's key over a nonce the server drew for this connection (a recorded request cannot be
replayed to read a snapshot), the listing is signed the same way, and each snapshot comes as the
replica frame above (its MAC checked, its rank, world size and sequence number those asked for).
"""

from __future__ import annotations

import functools
import hmac
import json
import logging
import os
import re
import shutil
import socket
import statistics
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import blake3

from trainguard.checkpoint import disk
from trainguard.checkpoint.format import FormatError, decode_manifest
from trainguard.checkpoint.persist import _set_background_priority
from trainguard.checkpoint.shm import (
    Slot,
    SlotCache,
    parse_slot_name,
    payload_offsets,
    read_header,
    slot_files,
    slot_path,
)

log = logging.getLogger(__name__)

MAGIC = b"TGREPL02"  # 02: the MAC is keyed BLAKE3 (01 was HMAC-SHA256)
FETCH_MAGIC = b"TGFETCH1"  # a fetch request (list or get) instead of a pushed replica; as long as MAGIC
NONCE_LEN = 32
# Domain separation of the fetch MACs from each other and from replica frames (whose MAC input
# starts with a JSON header): a response cannot be replayed as a request, nor a frame as either.
_FETCH_REQUEST, _FETCH_RESPONSE = b"\x00trainguard fetch request\x00", b"\x00trainguard fetch response\x00"
MAX_LISTING = 16 << 20
_LEN = struct.Struct("<I")
MAX_HEADER = 16 << 10
MAC_LEN = 32
REPLICAS = "replicas"
SPARE = ".spare"  # in the replicas dir: the next transfer is received into it (reused, see _rotate_in)
CHUNK = 1 << 20  # hashed, then sent while still in the CPU's cache
# Sender and receiver threads: nice 10 (False) or the idle class (True); see _set_background_priority.
BACKGROUND_IDLE = False
IO_TIMEOUT_S = 30.0
_NODE_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,127}")
_COMMIT, _ABANDON = b"\x01", b"\x00"
_OK, _NO = b"\x01", b"\x00"


class Refused(Exception):
    """A transfer the receiver does not keep (malformed, unsigned, bad MAC): one line says why."""


def new_mac(key: bytes) -> Any:
    """The replica MAC, fed as the bytes go by: keyed BLAKE3, a PRF like HMAC-SHA256 but about five
    times less CPU per byte (5.8 against 1.2 GB/s on one core here), which both the sending and the
    receiving agent spend on every snapshot while the training wants the cores. Its key is derived
    from ``key`` in BLAKE3's key-derivation mode, domain-separated from the job key's other uses."""
    return blake3.blake3(key=_mac_key(key))


@functools.lru_cache(maxsize=8)
def _mac_key(key: bytes) -> bytes:
    return blake3.blake3(key, derive_key_context="trainguard 2026-11 checkpoint replica MAC").digest()


@dataclass(frozen=True)
class Buddy:
    node: str
    addr: str
    port: int


@dataclass(frozen=True)
class Held:
    """A complete snapshot a node holds: of its own ranks (``node`` is its own name) or a replica
    (``node``: the node it came from)."""

    node: str
    rank: int
    world: int
    step: int
    seq: int
    time: float
    nbytes: int

    def to_json(self) -> dict[str, Any]:
        return {"node": self.node, "rank": self.rank, "world": self.world, "step": self.step, "seq": self.seq,
                "time": self.time, "nbytes": self.nbytes}

    @classmethod
    def from_json(cls, d: Any) -> Held:
        if not isinstance(d, dict) or not isinstance(d.get("node"), str) or not _NODE_NAME.fullmatch(d["node"]):
            raise ValueError("not a held snapshot")
        ints = [d.get(k) for k in ("rank", "world", "step", "seq", "nbytes")]
        if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in ints):
            raise ValueError("not a held snapshot")
        when = d.get("time")
        if isinstance(when, bool) or not isinstance(when, int | float):
            raise ValueError("not a held snapshot")
        return cls(d["node"], *ints[:4], float(when), ints[4])


# --- receiving ---------------------------------------------------------------------------------
class ReplicaServer:
    """Listens on ``addr`` (the address the other nodes reach this one through) and keeps what
    verified buddies send in ``replicas_root``. With ``own_dir`` (the node's own slot files) and
    ``node`` it also answers fetches: what it holds of given ranks, its own ranks' snapshots and
    the replicas it keeps."""

    def __init__(self, replicas_root: Path, addr: str, key: bytes,
                 on_rejected: Callable[[str], None] | None = None, own_dir: Path | None = None,
                 node: str = "") -> None:
        self.root = Path(replicas_root)
        self.root.mkdir(mode=0o700, exist_ok=True)
        self._spare = self.root / SPARE
        self._key = key
        self._own = (node, Path(own_dir)) if own_dir is not None and node else None
        self._on_rejected = on_rejected or (lambda msg: log.warning("checkpoint replica: %s", msg))
        family = socket.AF_INET6 if ":" in addr else socket.AF_INET
        self._sock = socket.socket(family, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((addr, 0))
        self._sock.listen(16)
        self.addr, self.port = addr, self._sock.getsockname()[1]
        self.received = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="trainguard-ckpt-replica-in", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        # Receiving (copy + HMAC of every byte) competes with this node's own training for its
        # cores: the same background priority as the sender.
        _set_background_priority(threading.get_native_id(), idle=BACKGROUND_IDLE)
        while not self._stop.is_set():
            try:
                conn, peer = self._sock.accept()
            except OSError:
                return  # closed
            with conn:
                conn.settimeout(IO_TIMEOUT_S)
                try:
                    magic = _recv_exact(conn, len(MAGIC))
                    if magic == FETCH_MAGIC:
                        self.answer_fetch(conn)
                        continue
                    self.receive(conn, magic)
                    conn.sendall(_OK)
                except Refused as exc:
                    self._on_rejected(f"refused a snapshot {'fetch' if magic == FETCH_MAGIC else 'replica'} "
                                      f"from {peer[0]}: {exc}")
                    _send_quietly(conn, _NO)
                except (OSError, ValueError) as exc:  # a peer that died mid-transfer: nothing kept
                    log.info("checkpoint replica connection from %s ended: %s", peer[0], exc)

    def receive(self, conn: socket.socket, magic: bytes | None = None) -> bool:
        """One transfer. True when kept, False when the sender abandoned it; raises Refused."""
        raw, h = _read_frame_head(conn, magic)
        # Before the MAC can be checked: a claimed size beyond the tmpfs's free space (the spare
        # file's included: it is reused) is refused rather than allocated (fallocate would fail
        # anyway; this says why in one line).
        _check_fits(self.root, h, _size_of(self._spare))
        node_dir = self.root / h["node"]
        node_dir.mkdir(mode=0o700, exist_ok=True)
        had = _size_of(self._spare)
        slot = _spare_slot(self._spare, payload_offsets(h["manifest_len"])[1] + h["data_len"])
        kept = False
        try:
            if not _receive_payload(conn, self._key, raw, h, slot, h["seq"]):
                return False
            _rotate_in(self._spare, _older_slot(node_dir, h["rank"]))
            kept = True
            self._drop_older(node_dir, h["world"])
            self.received += 1
            return True
        finally:
            slot.close()
            # A transfer not kept never leaves more memory held than before it: an unsigned sender
            # cannot make this node keep what it claimed.
            if not kept and _size_of(self._spare) > had:
                self._spare.unlink(missing_ok=True)

    # --- answering fetches -----------------------------------------------------------------------
    def answer_fetch(self, conn: socket.socket) -> None:
        """A fetch, after its FETCH_MAGIC: a nonce out, a request signed over it in; then the
        listing (signed over the same nonce) or the snapshots asked for, each as a replica frame
        (a byte before each: 1 = it follows, 0 = not held any more). Raises Refused."""
        nonce = os.urandom(NONCE_LEN)
        conn.sendall(nonce)
        (n,) = _LEN.unpack(_recv_exact(conn, _LEN.size))
        if n > MAX_HEADER:
            raise Refused(f"fetch request of {n} bytes")
        raw = _recv_exact(conn, n)
        if not hmac.compare_digest(_recv_exact(conn, MAC_LEN), _fetch_mac(self._key, _FETCH_REQUEST, nonce, raw)):
            raise Refused("fetch request not signed by an agent of this job")
        req = _parse_fetch(raw)
        if req["op"] == "list":
            body = json.dumps([h.to_json() for h in self.held(set(req["ranks"]), req["world"])]).encode()
            conn.sendall(_LEN.pack(len(body)) + body + _fetch_mac(self._key, _FETCH_RESPONSE, nonce, body))
            return
        for item in req["items"]:
            found = self._find(item.node, item.rank, item.seq)
            if found is None:
                conn.sendall(_NO)
                continue
            slot, hdr = found
            try:
                conn.sendall(_OK)
                _stream(conn, slot, hdr, item.node, self._key)
            finally:
                slot.close()

    def _sources(self) -> list[tuple[str, Path]]:
        """(source node, directory) of everything this node holds: its own ranks' slots first."""
        out = [self._own] if self._own is not None else []
        try:
            names = sorted(n for n in os.listdir(self.root) if not n.startswith("."))
        except OSError:
            names = []
        return out + [(n, self.root / n) for n in names if self._own is None or n != self._own[0]]

    def held(self, ranks: set[int], world: int) -> list[Held]:
        """Every complete snapshot this node holds of ``ranks`` at world size ``world``."""
        out = []
        for node, d in self._sources():
            for path, rank in slot_files(d):
                hdr = read_header(path) if rank in ranks else None
                if hdr is not None and hdr.complete and hdr.rank == rank and hdr.world == world:
                    out.append(Held(node, rank, world, hdr.step, hdr.seq, hdr.time, hdr.manifest_len + hdr.data_len))
        return out

    def _find(self, node: str, rank: int, seq: int) -> tuple[Slot, Any] | None:
        for src, d in self._sources():
            if src != node:
                continue
            for path, r in slot_files(d):
                slot = _open(path) if r == rank else None
                hdr = slot.header() if slot is not None else None
                if hdr is not None and hdr.complete and hdr.rank == rank and hdr.seq == seq:
                    return slot, hdr
                if slot is not None:
                    slot.close()
        return None

    @staticmethod
    def _drop_older(node_dir: Path, world: int) -> None:
        """Bounded memory: a source node's replicas from an earlier world size go."""
        for path, _ in slot_files(node_dir):
            hdr = read_header(path)
            if hdr is not None and hdr.world != world:
                path.unlink(missing_ok=True)

    def close(self) -> None:
        self._stop.set()
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()
        self._thread.join(timeout=5)


def _size_of(path: Path) -> int:
    try:
        return os.stat(path).st_size
    except OSError:
        return 0


def _spare_slot(spare: Path, size: int) -> Slot:
    """The file a transfer is received into: the spare (the replica the last kept transfer
    displaced, its tmpfs pages already allocated and mapped in), grown if needed; a new one when
    there is none. Allocating and zeroing a fresh file per transfer cost more CPU than the copy."""
    if spare.exists():
        try:
            slot = Slot.open(spare, populate=True)
        except (OSError, ValueError):
            spare.unlink(missing_ok=True)
        else:
            try:
                slot.grow(size)
                return slot
            except BaseException:
                slot.close()
                raise
    return Slot.create(spare, size)


def _rotate_in(spare: Path, dest: Path) -> None:
    """The received file (``spare``) takes ``dest``'s name atomically; the file it displaces
    becomes the next spare. Per source node and rank the two newest complete replicas stay under
    their names throughout; at rest the server holds one spare beyond them (the file a transfer
    used to be received into meanwhile: the peak is unchanged)."""
    nxt = spare.with_name(spare.name + ".next")
    nxt.unlink(missing_ok=True)
    try:
        os.link(dest, nxt)
        recycled = True
    except FileNotFoundError:
        recycled = False
    os.replace(spare, dest)
    if recycled:
        os.rename(nxt, spare)


def _older_slot(node_dir: Path, rank: int) -> Path:
    """Where a new replica of ``rank`` goes: over the older of its two (or a free place). Two per
    rank, as the workers' own slots: buddies receive at their own pace, and the newest step that
    every rank's copy holds must still be there when one of them got a step further."""
    paths = [slot_path(node_dir, rank, i) for i in (0, 1)]
    seqs = []
    for path in paths:
        hdr = read_header(path) if path.exists() else None
        seqs.append(hdr.seq if hdr is not None and hdr.complete else -1)
    return paths[0] if seqs[0] <= seqs[1] else paths[1]


def replica_files(root: Path, node: str | None = None) -> list[tuple[Path, int]]:
    """(slot file, rank) of every replica kept under ``root`` (of one source node when given)."""
    out = []
    try:
        nodes = [node] if node is not None else sorted(n for n in os.listdir(root) if not n.startswith("."))
    except OSError:
        return out
    for n in nodes:
        out += slot_files(Path(root) / n)
    return out


def _parse_header(raw: bytes) -> dict[str, Any]:
    try:
        h = json.loads(raw)
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise Refused("header is not JSON") from None
    if not isinstance(h, dict) or not isinstance(h.get("node"), str) or not _NODE_NAME.fullmatch(h["node"]):
        raise Refused("header lacks a valid source node name")
    for k in ("rank", "world", "step", "seq", "manifest_len", "data_len"):
        v = h.get(k)
        if isinstance(v, bool) or not isinstance(v, int) or not -1 <= v < 1 << 62:
            raise Refused(f"header field {k!r} is not an integer")
    if h["rank"] < 0 or h["world"] < 1 or h["rank"] >= h["world"] or h["manifest_len"] > 64 << 20 or h["seq"] < 1:
        raise Refused("header fields out of range")
    return h


def _read_frame_head(conn: socket.socket, magic: bytes | None = None) -> tuple[bytes, dict[str, Any]]:
    """A replica frame's magic (unless already read), header length and header: (raw, parsed)."""
    if magic is None:
        magic = _recv_exact(conn, len(MAGIC))
    if magic != MAGIC:
        raise Refused("not a trainguard snapshot replica")
    (n,) = _LEN.unpack(_recv_exact(conn, _LEN.size))
    if n > MAX_HEADER:
        raise Refused(f"header of {n} bytes")
    raw = _recv_exact(conn, n)
    return raw, _parse_header(raw)


def _check_fits(where: Path, h: dict[str, Any], reusable: int = 0) -> None:
    free = shutil.disk_usage(where).free + reusable
    if h["manifest_len"] + h["data_len"] > free:
        raise Refused(f"node {h['node']} rank {h['rank']}: {h['data_len']} bytes do not fit in the "
                      f"{free} bytes free in {where}")


def _receive_payload(conn: socket.socket, key: bytes, raw: bytes, h: dict[str, Any], slot: Slot, seq: int) -> bool:
    """Manifest and data of a frame into ``slot``, hashed as they arrive; published as complete
    under ``seq`` only when the sender committed and the MAC verifies. False: abandoned by the
    sender; raises Refused on a wrong MAC (the slot then stays marked as being written)."""
    manifest_off, data_off = payload_offsets(h["manifest_len"])
    slot.begin_write(seq)
    mac = new_mac(key)
    mac.update(raw)
    with memoryview(slot.mm) as mv:
        _recv_into(conn, mv[manifest_off : manifest_off + h["manifest_len"]], mac)
        _recv_into(conn, mv[data_off : data_off + h["data_len"]], mac)
    if _recv_exact(conn, 1) != _COMMIT:
        return False
    if not hmac.compare_digest(_recv_exact(conn, MAC_LEN), mac.digest()):
        raise Refused(f"node {h['node']} rank {h['rank']} step {h['step']}: MAC does not match "
                      "(not sent by an agent of this job, or damaged)")
    slot.publish(seq, h["step"], h["manifest_len"], h["data_len"], h["rank"], h["world"])
    return True


def _fetch_mac(key: bytes, label: bytes, nonce: bytes, body: bytes) -> bytes:
    mac = new_mac(key)
    mac.update(label + nonce)
    mac.update(body)
    return mac.digest()


def _parse_fetch(raw: bytes) -> dict[str, Any]:
    try:
        req = json.loads(raw)
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise Refused("fetch request is not JSON") from None
    if not isinstance(req, dict) or req.get("op") not in ("list", "get"):
        raise Refused("fetch request names no operation")
    if req["op"] == "list":
        ranks, world = req.get("ranks"), req.get("world")
        if (not isinstance(ranks, list) or not all(isinstance(r, int) and not isinstance(r, bool) for r in ranks)
                or isinstance(world, bool) or not isinstance(world, int)):
            raise Refused("fetch list request lacks ranks and world size")
        return req
    items = req.get("items")
    if not isinstance(items, list) or len(items) > 4096:
        raise Refused("fetch get request lacks items")
    try:
        req["items"] = [Held.from_json(i) for i in items]
    except ValueError:
        raise Refused("fetch get request: an item is malformed") from None
    return req


def _recv_exact(conn: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    _recv_into(conn, memoryview(buf))
    return bytes(buf)


def _recv_into(conn: socket.socket, mv: memoryview, mac: Any = None) -> None:
    """Fill ``mv`` from the connection; ``mac`` is fed each CHUNK as it arrives (still in the CPU's
    cache, rather than the whole snapshot read back from memory afterwards)."""
    got = hashed = 0
    while got < len(mv):
        k = conn.recv_into(mv[got:], min(len(mv) - got, CHUNK))
        if k == 0:
            raise ValueError("connection closed mid-transfer")
        got += k
        if mac is not None and (got - hashed >= CHUNK or got == len(mv)):
            mac.update(mv[hashed:got])
            hashed = got


def _send_quietly(conn: socket.socket, b: bytes) -> None:
    try:
        conn.sendall(b)
    except OSError:
        pass


# --- sending -----------------------------------------------------------------------------------
@dataclass
class ReplicationStats:
    snapshots: int = 0  # snapshots sent and kept by a buddy (one per buddy)
    bytes: int = 0  # bytes sent for them
    abandoned: int = 0  # overwritten by the worker while being sent
    failed: int = 0  # a buddy unreachable or refusing
    seconds: float = 0.0  # time spent sending
    lag_s: list[float] = field(default_factory=list)  # from a snapshot's completion until a buddy kept it (newest 1000)

    def kept(self, nbytes: int, lag_s: float | None) -> None:
        self.snapshots += 1
        self.bytes += nbytes
        if lag_s is not None:
            self.lag_s.append(lag_s)
            del self.lag_s[:-1000]

    def to_json(self) -> dict[str, Any]:
        per = self.bytes / self.snapshots if self.snapshots else 0
        lag = statistics.median(self.lag_s) if self.lag_s else None
        return {"snapshots": self.snapshots, "bytes": self.bytes, "bytes_per_snapshot": round(per),
                "abandoned": self.abandoned, "failed": self.failed, "seconds": round(self.seconds, 3),
                "median_lag_s": None if lag is None else round(lag, 4)}


class Replicator:
    """Sends this node's ranks' newest snapshots (slot files in ``shm_dir``) to its buddies."""

    def __init__(self, shm_dir: Path, node: str, key: bytes, emit: Callable[..., Any],
                 max_bytes_per_s: float = 0, interval_s: float = 0.02) -> None:
        self.shm_dir = Path(shm_dir)
        self.node = node
        self._key = key
        self.emit = emit
        self.rate = max_bytes_per_s
        self.interval_s = interval_s
        self.stats = ReplicationStats()
        self._since = time.time()
        self._buddies: list[Buddy] = []
        self._sent: dict[tuple[str, int], int] = {}  # (buddy node, rank) -> seq sent
        self._down: dict[str, str] = {}  # buddy node -> why the last transfer failed (reported once)
        self._slots = SlotCache(self.shm_dir)  # the sender thread's own: open across passes
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def set_buddies(self, buddies: list[Buddy]) -> None:
        with self._lock:
            self._buddies = list(buddies)

    def start(self) -> None:
        """Start sending (again, after ``stop``)."""
        if self._thread is None:
            self._stop.clear()
            self._since = time.time()
            self._thread = threading.Thread(target=self._loop, name="trainguard-ckpt-replica-out", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=IO_TIMEOUT_S)
            if self._thread.is_alive():
                return  # still sending: it closes its slots when it ends
            self._thread = None
        self._slots.close()

    def _loop(self) -> None:
        _set_background_priority(threading.get_native_id(), idle=BACKGROUND_IDLE)  # training first
        try:
            while not self._stop.wait(self.interval_s):
                try:
                    self.run_pass()
                except Exception as exc:  # never let the thread die: the next pass may succeed
                    log.exception("checkpoint replication pass failed: %s", exc)
        finally:
            self._slots.close()

    def run_pass(self) -> int:
        """Send every rank's newest complete snapshot to every buddy that lacks it (only the newest:
        when sending falls behind the saves, the snapshots in between are skipped). Returns how
        many transfers were kept."""
        with self._lock:
            buddies = list(self._buddies)
        sent = 0
        for slot, hdr in self._newest() if buddies else []:
            digest = None  # hashed once, while sent to the first buddy; the seqlock covers the rest
            for buddy in buddies:
                if self._sent.get((buddy.node, hdr.rank), 0) >= hdr.seq:
                    continue
                now = slot.header()
                if now is None or not now.complete or now.seq != hdr.seq:
                    break  # overwritten meanwhile: the next pass sends the newer one
                got = self._send_one(buddy, slot, hdr, digest)
                if got is not None:
                    digest = got
                    sent += 1
        return sent

    def _newest(self) -> list[tuple[Slot, Any]]:
        """(slot, header) of each own rank's newest complete snapshot, from slot files kept open."""
        try:
            names = sorted(os.listdir(self.shm_dir))
        except OSError:
            return []
        newest: dict[int, tuple[Slot, Any]] = {}
        for name in names:
            parsed = parse_slot_name(name)
            slot = self._slots.get(name) if parsed is not None else None
            hdr = slot.header() if slot is not None else None
            if hdr is None or not hdr.complete or hdr.rank != parsed[0]:
                continue
            if parsed[0] not in newest or newest[parsed[0]][1].seq < hdr.seq:
                newest[parsed[0]] = (slot, hdr)
        return [newest[r] for r in sorted(newest)]

    def _send_one(self, buddy: Buddy, slot: Slot, hdr: Any, digest: bytes | None) -> bytes | None:
        """One transfer; the snapshot's MAC when the buddy kept it, else None."""
        start = time.monotonic()
        try:
            done = send_snapshot(buddy, slot, hdr, self.node, self._key, self.rate, digest)
        except OSError as exc:
            self.stats.failed += 1
            if self._down.get(buddy.node) is None:
                self._down[buddy.node] = str(exc)
                self.emit("checkpoint_replica_failed",
                          f"could not send rank {hdr.rank}'s snapshot of step {hdr.step} to buddy {buddy.node} "
                          f"({buddy.addr}:{buddy.port}): {exc}; training continues",
                          severity="warning", rank=hdr.rank,
                          evidence={"buddy": buddy.node, "step": hdr.step, "error": str(exc)})
            return None
        self.stats.seconds += time.monotonic() - start
        if done is None:
            self.stats.abandoned += 1
            return None
        kept, digest = done
        self._down.pop(buddy.node, None)
        self._sent[(buddy.node, hdr.rank)] = hdr.seq
        # The lag only of snapshots taken while sending: an older one found at the start is no measure.
        self.stats.kept(kept, time.time() - hdr.time if hdr.time >= self._since else None)
        if self.stats.snapshots == 1:
            self.emit("checkpoint_replicated",
                      f"first snapshot replica sent to buddy {buddy.node}: rank {hdr.rank} step {hdr.step}, {kept} bytes",
                      rank=hdr.rank, evidence={"buddy": buddy.node, "step": hdr.step, "bytes": kept})
        return digest


def send_snapshot(buddy: Buddy, slot: Slot, hdr: Any, node: str, key: bytes, rate: float = 0,
                  digest: bytes | None = None) -> tuple[int, bytes] | None:
    """Stream one slot to a buddy: (bytes sent, the MAC) when the buddy kept it; None when the
    worker overwrote the slot meanwhile (abandoned). Raises OSError when the buddy cannot be
    reached or refused it. ``digest``: the MAC of this very snapshot (same seq) computed while it
    was sent to another buddy; the seqlock check after the last byte proves the bytes unchanged
    since, so they are not hashed again."""
    with socket.create_connection((buddy.addr, buddy.port), timeout=IO_TIMEOUT_S) as conn:
        digest = _stream(conn, slot, hdr, node, key, rate, digest)
        if digest is None:
            return None
        if _recv_exact(conn, 1) != _OK:
            raise OSError(f"buddy {buddy.node} refused the replica")
    return _frame_len(node, hdr), digest


def _frame_head(node: str, hdr: Any) -> bytes:
    return json.dumps({"node": node, "rank": hdr.rank, "world": hdr.world, "step": hdr.step, "seq": hdr.seq,
                       "manifest_len": hdr.manifest_len, "data_len": hdr.data_len}).encode()


def _frame_len(node: str, hdr: Any) -> int:
    return len(_frame_head(node, hdr)) + hdr.manifest_len + hdr.data_len


def _stream(conn: socket.socket, slot: Slot, hdr: Any, node: str, key: bytes, rate: float = 0,
            digest: bytes | None = None) -> bytes | None:
    """One replica frame of ``slot`` (snapshot ``hdr``, from ``node``) onto ``conn``: its MAC when
    committed, None when abandoned (the slot was overwritten while it was sent)."""
    if hdr.data_off + hdr.data_len > slot.size:
        slot.refresh()
    head = _frame_head(node, hdr)
    throttle = disk._Throttle(rate)  # the persister's rate cap, reused
    mac = new_mac(key) if digest is None else None
    with memoryview(slot.mm) as mv:
        manifest = mv[hdr.manifest_off : hdr.manifest_off + hdr.manifest_len]
        data = mv[hdr.data_off : hdr.data_off + hdr.data_len]
        conn.sendall(MAGIC + _LEN.pack(len(head)) + head)
        if mac is not None:
            mac.update(head)
        for part in (manifest, data):
            for off in range(0, len(part), CHUNK):
                piece = part[off : off + CHUNK]
                if mac is not None:
                    mac.update(piece)  # hashed as sent: the slot is not pinned, so never read it again later
                conn.sendall(piece)
                throttle.account(len(piece))
        del manifest, data
    # Seqlock: the worker marks the slot WRITING before touching a byte, so an unchanged header
    # now means every byte sent and hashed above was the snapshot's.
    now = slot.header()
    if now is None or not now.complete or now.seq != hdr.seq:
        conn.sendall(_ABANDON)
        return None
    digest = mac.digest() if mac is not None else digest
    assert digest is not None
    conn.sendall(_COMMIT + digest)
    return digest


# --- fetching (the agent of a node about to run ranks it holds nothing of) ---------------------
def _fetch_request(peer: Buddy, key: bytes, request: dict[str, Any], timeout_s: float) -> tuple[socket.socket, bytes]:
    """Connect, take the server's nonce, send the signed request: (connection, nonce)."""
    conn = socket.create_connection((peer.addr, peer.port), timeout=timeout_s)
    try:
        conn.sendall(FETCH_MAGIC)
        nonce = _recv_exact(conn, NONCE_LEN)
        body = json.dumps(request).encode()
        conn.sendall(_LEN.pack(len(body)) + body + _fetch_mac(key, _FETCH_REQUEST, nonce, body))
        return conn, nonce
    except BaseException:
        conn.close()
        raise


def list_held(peer: Buddy, key: bytes, ranks: list[int], world: int, timeout_s: float = IO_TIMEOUT_S) -> list[Held]:
    """What ``peer``'s agent holds of ``ranks`` at world size ``world``. Raises OSError (not
    reachable, refused) or ValueError (a listing not signed by an agent of this job)."""
    conn, nonce = _fetch_request(peer, key, {"op": "list", "ranks": sorted(ranks), "world": world}, timeout_s)
    with conn:
        head = _recv_exact(conn, _LEN.size)
        (n,) = _LEN.unpack(head)
        if n > MAX_LISTING:
            raise ValueError(f"{peer.node}: a listing of {n} bytes")
        body = _recv_exact(conn, n)
        if not hmac.compare_digest(_recv_exact(conn, MAC_LEN), _fetch_mac(key, _FETCH_RESPONSE, nonce, body)):
            raise ValueError(f"{peer.node}: listing not signed by an agent of this job")
    try:
        items = [Held.from_json(d) for d in json.loads(body)]
    except (TypeError, ValueError, RecursionError) as exc:
        raise ValueError(f"{peer.node}: malformed listing ({exc})") from None
    return [h for h in items if h.rank in ranks and h.world == world]


def fetch(peer: Buddy, key: bytes, items: list[Held], into: Path, seqs: list[int],
          timeout_s: float = IO_TIMEOUT_S) -> tuple[list[tuple[Held, Path]], str | None]:
    """Pull ``items`` (from ``list_held(peer)``) into new slot files in ``into``, the i-th published
    under sequence number ``seqs[i]`` (the receiving node's numbering), each kept only when its MAC
    verifies and it is the snapshot asked for. Returns (item, temp path) of those received (the
    caller gives each its slot name), and why the rest were not (None: all were, or the peer no
    longer held them)."""
    got: list[tuple[Held, Path]] = []
    try:
        conn, _ = _fetch_request(peer, key, {"op": "get", "items": [h.to_json() for h in items]}, timeout_s)
        with conn:
            for item, seq in zip(items, seqs, strict=True):
                if _recv_exact(conn, 1) != _OK:
                    continue  # not held any more (overwritten since the listing)
                path = _fetch_one(conn, key, peer, item, into, seq)
                if path is not None:
                    got.append((item, path))
    except (OSError, ValueError, Refused) as exc:
        return got, f"{type(exc).__name__}: {exc}" if isinstance(exc, OSError) else str(exc)
    return got, None


def _fetch_one(conn: socket.socket, key: bytes, peer: Buddy, item: Held, into: Path, seq: int) -> Path | None:
    raw, h = _read_frame_head(conn)
    if (h["node"], h["rank"], h["world"], h["seq"], h["step"]) != (item.node, item.rank, item.world, item.seq, item.step):
        raise Refused(f"{peer.node} sent node {h['node']} rank {h['rank']} seq {h['seq']}, not the snapshot asked for")
    _check_fits(into, h)
    path = into / f".fetch-{item.rank}-{seq}"
    slot = Slot.create(path, payload_offsets(h["manifest_len"])[1] + h["data_len"])
    ok = False
    try:
        ok = _receive_payload(conn, key, raw, h, slot, seq)
    finally:
        slot.close()
        if not ok:
            path.unlink(missing_ok=True)
    return path if ok else None


def _open(path: Path) -> Slot | None:
    try:
        return Slot.open(path)
    except (OSError, ValueError):
        return None


def remove_replicas(shm_dir: Path) -> None:
    shutil.rmtree(Path(shm_dir) / REPLICAS, ignore_errors=True)


# --- after a node loss -------------------------------------------------------------------------
def persist_replicas(replicas_root: Path, ckpt_dir: Path, emit: Callable[..., Any],
                     trigger: str = "breakpoint") -> list[tuple[str, disk.Persisted]]:
    """Write every kept replica that is not on disk yet (this exact snapshot: same rank, step and
    save time) and is not older than a step of its rank on disk (disk.newer_on_disk) to the
    checkpoint dir: at a breakpoint, so that after a node loss the survivors'
    ``load_latest`` finds the lost ranks' shards of the newest step beside their own."""
    done: list[tuple[str, disk.Persisted]] = []  # (source node, what was written)
    held: dict[str, dict[str, set[int]]] = {}  # source node -> the ranks and steps its replicas hold here
    for path, rank in replica_files(replicas_root):
        slot = _open(path)
        if slot is None:
            continue
        hdr = None
        try:
            hdr = slot.header()
            if hdr is None or not hdr.complete:
                continue
            # Seqlock: the server may reuse a displaced replica's file for its next transfer while
            # this reads it; a whole unchanged header (its save time included) proves it was not.
            unchanged = functools.partial(_same_header, slot, hdr)
            with memoryview(slot.mm) as mv:
                meta = decode_manifest(bytes(mv[hdr.manifest_off : hdr.manifest_off + hdr.manifest_len]))
                if meta.get("rank") != rank or meta.get("step") != hdr.step:
                    continue
                mine = held.setdefault(path.parent.name, {"ranks": set(), "steps": set()})
                mine["ranks"].add(rank)
                mine["steps"].add(hdr.step)
                if _on_disk(ckpt_dir, meta) or disk.newer_on_disk(ckpt_dir, rank, hdr.step):
                    continue  # there already, or stale (a replica from the source's earlier role)
                with mv[hdr.data_off : hdr.data_off + hdr.data_len] as data:
                    done.append((path.parent.name, disk.write_checkpoint(ckpt_dir, meta, data, unchanged)))
        except disk.SnapshotChanged:
            continue  # displaced by a newer replica meanwhile
        except (FormatError, OSError, ValueError) as exc:
            if hdr is not None and slot.header() != hdr:
                continue  # displaced mid-read: what was read is no replica's
            emit("checkpoint_failed", f"could not persist the replica {path.parent.name}/{path.name}: {exc}",
                 severity="error", evidence={"replica": str(path), "error": f"{type(exc).__name__}: {exc}"})
        finally:
            slot.close()
    if held:  # what this node could give each source node back, on disk now either way
        emit("checkpoint_replicas_held", "snapshot replicas held here: " + "; ".join(
             f"node {n} rank(s) {sorted(h['ranks'])} step(s) {sorted(h['steps'])}" for n, h in sorted(held.items())),
             evidence={"trigger": trigger, "nodes": {n: {k: sorted(v) for k, v in h.items()} for n, h in held.items()}})
    by_node: dict[str, list[disk.Persisted]] = {}
    for node, p in done:
        by_node.setdefault(node, []).append(p)
    for node, items in sorted(by_node.items()):
        steps = sorted({p.step for p in items})
        ranks = sorted({p.rank for p in items})
        emit("checkpoint_persisted",
             f"replicas of node {node}'s rank(s) {ranks} (step(s) {steps}) kept for it as its buddy persisted to {ckpt_dir}",
             evidence={"steps": steps, "ranks": ranks, "bytes": sum(p.nbytes for p in items), "dir": str(ckpt_dir),
                       "trigger": trigger, "source": "replica", "from_node": node})
    return done


def _same_header(slot: Slot, hdr: Any) -> bool:
    return slot.header() == hdr


def _on_disk(ckpt_dir: Path, meta: dict[str, Any]) -> bool:
    try:
        theirs = disk.read_manifest(ckpt_dir, int(meta["rank"]), int(meta["step"]))
    except (FormatError, disk.CorruptCheckpoint):
        return False
    return theirs.get("time") == meta.get("time")
