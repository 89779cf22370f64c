"""What a blocked worker waits on, from the kernel: its system call, wait channel and file
descriptors, the TCP sockets it holds (with the bytes they moved), its children, the file locks it
waits for, and where the other ends of its pipes and loopback connections live.

Read only, never raises: whatever cannot be read (another user's process, a kernel without
sock_diag) is left empty and the classifier (detect.waits) treats it as unknown. Nothing here
judges; it only gathers facts as plain data.

Socket bytes: Python's ``socket.recv``/``recv_into`` do not move ``/proc/<pid>/io`` (rchar counts
read(), not recvfrom()), so a rank that downloads looks idle there. The bytes each socket received
and had acknowledged come from NETLINK_SOCK_DIAG (``tcp_info``, as ``ss -ti`` shows them), matched
to the process through the socket inodes in ``/proc/<pid>/fd``; without sock_diag,
``/proc/net/tcp*`` still gives the states and addresses (no bytes).
"""

from __future__ import annotations

import dataclasses
import os
import platform
import socket
import struct
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

from trainguard.probes.proc import ProcSample, read_state

# --------------------------------------------------------------------------------------------
# system calls (numbers per architecture: only the blocking ones we classify)

_X86_64 = {
    0: "read", 7: "poll", 19: "readv", 23: "select", 34: "pause", 35: "nanosleep", 42: "connect", 43: "accept",
    45: "recvfrom", 47: "recvmsg", 61: "wait4", 72: "fcntl", 73: "flock", 74: "fsync", 75: "fdatasync",
    128: "rt_sigtimedwait", 130: "rt_sigsuspend", 162: "sync", 202: "futex", 230: "clock_nanosleep",
    232: "epoll_wait", 247: "waitid", 257: "openat", 270: "pselect6", 271: "ppoll", 281: "epoll_pwait",
    288: "accept4", 306: "syncfs", 441: "epoll_pwait2", 1: "write", 20: "writev", 44: "sendto", 46: "sendmsg",
}  # fmt: skip
_AARCH64 = {
    63: "read", 65: "readv", 73: "ppoll", 72: "pselect6", 101: "nanosleep", 203: "connect", 202: "accept",
    207: "recvfrom", 212: "recvmsg", 260: "wait4", 25: "fcntl", 32: "flock", 82: "fsync", 83: "fdatasync",
    137: "rt_sigtimedwait", 133: "rt_sigsuspend", 81: "sync", 98: "futex", 115: "clock_nanosleep",
    22: "epoll_pwait", 95: "waitid", 56: "openat", 242: "accept4", 267: "syncfs", 441: "epoll_pwait2",
    64: "write", 66: "writev", 206: "sendto", 211: "sendmsg",
}  # fmt: skip
SYSCALLS = _AARCH64 if platform.machine() in ("aarch64", "arm64") else _X86_64

TCP_STATES = {
    1: "ESTABLISHED", 2: "SYN_SENT", 3: "SYN_RECV", 4: "FIN_WAIT1", 5: "FIN_WAIT2", 6: "TIME_WAIT", 7: "CLOSE",
    8: "CLOSE_WAIT", 9: "LAST_ACK", 10: "LISTEN", 11: "CLOSING",
}  # fmt: skip


@dataclass(frozen=True)
class Syscall:
    name: str  # "read", "futex", ...; "running" (on CPU), "" (unreadable), "syscall <n>" (not classified)
    args: tuple[int, ...] = ()


def read_syscall(pid: int, tid: int | None = None) -> Syscall:
    """The system call a task (default: the main thread) is blocked in, from /proc/<pid>/syscall."""
    path = f"/proc/{pid}/task/{tid}/syscall" if tid else f"/proc/{pid}/syscall"
    try:
        with open(path, encoding="ascii") as f:
            text = f.read().split()
    except (OSError, ValueError):
        return Syscall("")
    if not text:
        return Syscall("")
    if text[0] == "running":
        return Syscall("running")
    try:
        nr = int(text[0])
        args = tuple(int(x, 16) for x in text[1:7])
    except ValueError:
        return Syscall("")
    if nr < 0:
        return Syscall("running")  # blocked outside a system call (a page fault): not a wait we know
    return Syscall(SYSCALLS.get(nr, f"syscall {nr}"), args)


def read_wchan(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/wchan", encoding="ascii") as f:
            text = f.read().strip()
    except OSError:
        return ""
    return "" if text == "0" else text


def fd_links(pid: int) -> dict[int, str]:
    """fd -> what it points at ("socket:[123]", "pipe:[456]", a path)."""
    out: dict[int, str] = {}
    try:
        names = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return out
    for name in names:
        try:
            out[int(name)] = os.readlink(f"/proc/{pid}/fd/{name}")
        except (OSError, ValueError):
            continue
    return out


def fd_mode(pid: int, fd: int) -> int | None:
    """O_ACCMODE of an fd (0 read, 1 write, 2 read-write), from /proc/<pid>/fdinfo."""
    try:
        with open(f"/proc/{pid}/fdinfo/{fd}", encoding="ascii") as f:
            for line in f:
                if line.startswith("flags:"):
                    return int(line.split()[1], 8) & 3
    except (OSError, ValueError, IndexError):
        return None
    return None


def epoll_targets(pid: int, fd: int) -> list[int]:
    """The fds an epoll fd watches ("tfd:" lines of its fdinfo)."""
    out = []
    try:
        with open(f"/proc/{pid}/fdinfo/{fd}", encoding="ascii") as f:
            for line in f:
                if line.startswith("tfd:"):
                    out.append(int(line.split()[1]))
    except (OSError, ValueError, IndexError):
        pass
    return out


def inode_of(link: str) -> int | None:
    """The inode of "socket:[123]" / "pipe:[456]" links."""
    if link.endswith("]") and ":[" in link:
        try:
            return int(link.rpartition(":[")[2][:-1])
        except ValueError:
            return None
    return None


def read_mem(pid: int, addr: int, size: int) -> bytes | None:
    """A few bytes of a process's memory (needs the same rights py-spy uses)."""
    if addr <= 0:
        return None
    try:
        with open(f"/proc/{pid}/mem", "rb", buffering=0) as f:
            f.seek(addr)
            data = f.read(size)
    except (OSError, ValueError, OverflowError):
        return None
    return data if len(data) == size else None


def sleep_left(pid: int, call: Syscall) -> float | None:
    """Seconds until a sleep ends: clock_nanosleep with TIMER_ABSTIME on CLOCK_MONOTONIC (what
    CPython's time.sleep does) carries its deadline; a relative sleep its full length (an upper
    bound of what is left). None when unknown."""
    if call.name == "clock_nanosleep" and len(call.args) >= 3:
        clock, flags, req = call.args[0], call.args[1], call.args[2]
    elif call.name == "nanosleep" and call.args:
        clock, flags, req = 1, 0, call.args[0]
    else:
        return None
    data = read_mem(pid, req, 16)
    if data is None:
        return None
    sec, nsec = struct.unpack("qq", data)
    value = sec + nsec / 1e9
    if flags & 1:  # TIMER_ABSTIME
        now = {0: time.clock_gettime(time.CLOCK_REALTIME), 1: time.monotonic(),
               7: time.clock_gettime(time.CLOCK_BOOTTIME)}.get(clock)  # fmt: skip
        return None if now is None else max(0.0, value - now)
    return value


# --------------------------------------------------------------------------------------------
# TCP sockets


@dataclass(frozen=True)
class TcpSock:
    inode: int
    state: str
    local: tuple[str, int]
    remote: tuple[str, int]
    received: int | None = None  # bytes received (tcp_info.bytes_received); None without sock_diag
    acked: int | None = None  # bytes sent and acknowledged by the peer
    last_recv_ms: int | None = None  # milliseconds since data last arrived


def _sock_diag(family: int) -> list[TcpSock] | None:
    """Every TCP socket of this network namespace with its tcp_info (NETLINK_SOCK_DIAG dump)."""
    try:
        s = socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, 4)  # NETLINK_SOCK_DIAG
    except OSError:
        return None
    try:
        s.settimeout(2.0)
        # inet_diag_req_v2: family, protocol, ext (1 << (INET_DIAG_INFO - 1)), pad, states, id (48 bytes)
        req = struct.pack("=BBBxI", family, socket.IPPROTO_TCP, 1 << 1, 0xFFFFFFFF) + b"\0" * 48
        hdr = struct.pack("=IHHII", 16 + len(req), 20, 0x301, 1, 0)  # SOCK_DIAG_BY_FAMILY, REQUEST|DUMP
        s.send(hdr + req)
        out: list[TcpSock] = []
        while True:
            data = s.recv(1 << 16)
            off = 0
            while off + 16 <= len(data):
                length, kind = struct.unpack_from("=IH", data, off)
                if kind == 3:  # NLMSG_DONE
                    return out
                if kind == 2 or length < 16:  # NLMSG_ERROR
                    return None
                sock = _parse_diag(data[off + 16 : off + length], family)
                if sock is not None:
                    out.append(sock)
                off += (length + 3) & ~3
    except OSError:
        return None
    finally:
        s.close()


def _parse_diag(msg: bytes, family: int) -> TcpSock | None:
    if len(msg) < 72:
        return None
    fam, state = msg[0], msg[1]
    sport, dport = struct.unpack_from("!HH", msg, 4)
    n = 4 if fam == socket.AF_INET else 16
    src = socket.inet_ntop(fam, msg[8 : 8 + n])
    dst = socket.inet_ntop(fam, msg[24 : 24 + n])
    inode = struct.unpack_from("=I", msg, 68)[0]
    received = acked = last = None
    off = 72
    while off + 4 <= len(msg):
        alen, atype = struct.unpack_from("=HH", msg, off)
        if alen < 4:
            break
        if atype == 2 and alen - 4 >= 136:  # INET_DIAG_INFO: struct tcp_info
            info = msg[off + 4 : off + alen]
            last = struct.unpack_from("=I", info, 52)[0]  # tcpi_last_data_recv
            acked, received = struct.unpack_from("=QQ", info, 120)  # tcpi_bytes_acked, tcpi_bytes_received
        off += (alen + 3) & ~3
    return TcpSock(inode, TCP_STATES.get(state, str(state)), (src, sport), (dst, dport), received, acked, last)


def _proc_net_tcp() -> list[TcpSock]:
    """States and addresses without sock_diag (no bytes)."""
    out = []
    for name, fam in (("tcp", socket.AF_INET), ("tcp6", socket.AF_INET6)):
        try:
            with open(f"/proc/net/{name}", encoding="ascii") as f:
                lines = f.readlines()[1:]
        except OSError:
            continue
        for line in lines:
            parts = line.split()
            try:
                local, remote = _hexaddr(parts[1], fam), _hexaddr(parts[2], fam)
                out.append(TcpSock(int(parts[9]), TCP_STATES.get(int(parts[3], 16), parts[3]), local, remote))
            except (ValueError, IndexError, OSError):
                continue
    return out


def _hexaddr(text: str, fam: int) -> tuple[str, int]:
    addr, port = text.split(":")
    raw = bytes.fromhex(addr)
    # /proc/net/tcp prints each 32-bit word in host (little-endian) order
    raw = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    return socket.inet_ntop(fam, raw), int(port, 16)


def tcp_sockets() -> dict[int, TcpSock]:
    """inode -> socket, every TCP socket of the namespace (sock_diag, else /proc/net/tcp*)."""
    socks: list[TcpSock] = []
    diag = [_sock_diag(socket.AF_INET), _sock_diag(socket.AF_INET6)]
    if all(d is None for d in diag):
        socks = _proc_net_tcp()
    else:
        socks = [s for d in diag if d for s in d]
    return {s.inode: s for s in socks if s.inode}


def peer_inodes(socks: dict[int, TcpSock]) -> dict[int, int]:
    """inode -> the inode of the other end, for connections whose both ends are on this machine."""
    by_ends = {(s.local, s.remote): s.inode for s in socks.values() if s.state != "LISTEN"}
    return {i: by_ends[(s.remote, s.local)] for i, s in socks.items() if (s.remote, s.local) in by_ends}


# --------------------------------------------------------------------------------------------
# processes, owners, locks


@dataclass(frozen=True)
class ProcInfo:
    pid: int
    state: str  # /proc state letter, "" when gone
    cmd: str
    stuck: str = ""  # why none of its threads can ever run again (stuck_reason); "" when not proven

    def describe(self) -> str:
        return f"pid {self.pid} ({self.cmd or '?'}, state {self.state or 'gone'})"


def proc_info(pid: int, waiter: int | None = None) -> ProcInfo:
    """A process, named; ``waiter``: the blocked rank that waits on it (then ``stuck`` says
    whether it can never act either)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmd = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        cmd = ""
    return ProcInfo(pid, read_state(pid), cmd[:120], stuck_reason(pid, waiter) if waiter else "")


# --------------------------------------------------------------------------------------------
# threads that can never run again

FUTEX_PRIVATE = 128  # FUTEX_PRIVATE_FLAG: only a thread of the same process can wake it
_FUTEX_WAITS = (0, 9)  # FUTEX_WAIT, FUTEX_WAIT_BITSET
_WRITE_CALLS = ("write", "writev")


def forever_futex(call: Syscall) -> bool:
    """A wait on a process-private futex with no timeout (what a ``threading.Lock.acquire()``
    without timeout is): only another thread of the same process can end it."""
    a = call.args
    return (call.name == "futex" and len(a) >= 4 and (a[1] & 0x7F) in _FUTEX_WAITS
            and bool(a[1] & FUTEX_PRIVATE) and a[3] == 0)  # fmt: skip


def task_calls(pid: int) -> dict[int, Syscall]:
    """tid -> the system call each thread of ``pid`` is blocked in."""
    try:
        tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except (OSError, ValueError):
        return {}
    return {tid: read_syscall(pid, tid) for tid in tids}


def pipe_readers(target: str, exclude: int) -> set[int]:
    """The processes other than ``exclude`` holding a read end of a pipe ("pipe:[N]")."""
    return {p for p, fd in owners([target]).get(target, []) if p != exclude and fd_mode(p, fd) in (0, 2)}


def stuck_reason(pid: int, waiter: int) -> str:
    """Why no thread of ``pid`` can ever act again while ``waiter`` stays blocked ("" when that is
    not proven): every thread is blocked either on a private futex with no timeout (nothing outside
    the process can wake it, and no thread inside is left to), or writing to a full pipe whose
    only reader is ``waiter`` (a wait-for cycle back to the blocked rank)."""
    calls = task_calls(pid)
    if not calls or read_state(pid) in ("", "R", "D"):
        return ""
    locks = cycle = 0
    links = fd_links(pid) if any(c.name in _WRITE_CALLS for c in calls.values()) else {}
    for call in calls.values():
        if forever_futex(call):
            locks += 1
            continue
        if call.name in _WRITE_CALLS and call.args:
            target = links.get(call.args[0], "")
            if target.startswith("pipe:") and pipe_readers(target, pid) == {waiter}:
                cycle += 1
                continue
        return ""
    if cycle:
        return f"blocked writing to a full pipe that only pid {waiter} reads, which waits on it: a wait-for cycle"
    return f"all {locks} of its threads wait on process-private locks with no timeout: none is left to release them"


def owners(targets: Iterable[str]) -> dict[str, list[tuple[int, int]]]:
    """fd target ("socket:[123]", "pipe:[456]", a FIFO's path) -> [(pid, fd)] of every readable
    process holding it."""
    wanted = {t for t in targets if t}
    out: dict[str, list[tuple[int, int]]] = {}
    if not wanted:
        return out
    try:
        pids = [int(p) for p in os.listdir("/proc") if p.isdigit()]
    except OSError:
        return out
    for pid in pids:
        for fd, link in fd_links(pid).items():
            if link in wanted:
                out.setdefault(link, []).append((pid, fd))
    return out


@dataclass(frozen=True)
class FileLock:
    kind: str  # FLOCK, POSIX, OFDLCK
    mode: str  # READ, WRITE
    pid: int
    dev_inode: str  # "maj:min:inode"
    waiting: bool  # a "->" line: blocked waiting for it


def file_locks() -> list[FileLock]:
    try:
        with open("/proc/locks", encoding="ascii") as f:
            lines = f.readlines()
    except OSError:
        return []
    out = []
    for line in lines:
        parts = line.split()
        waiting = len(parts) > 1 and parts[1] == "->"
        if waiting:
            parts = parts[:1] + parts[2:]
        try:
            out.append(FileLock(parts[1], parts[3], int(parts[4]), parts[5], waiting))
        except (IndexError, ValueError):
            continue
    return out


def file_id(pid: int, fd: int) -> str | None:
    """"maj:min:inode" of the file behind an fd, as /proc/locks writes it (hex major/minor)."""
    try:
        st = os.stat(f"/proc/{pid}/fd/{fd}")
    except OSError:
        return None
    return f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"


def tree(pid: int) -> list[int]:
    """The process and its descendants (pids)."""
    import psutil

    try:
        return [pid, *(c.pid for c in psutil.Process(pid).children(recursive=True))]
    except psutil.Error:
        return [pid]


# --------------------------------------------------------------------------------------------
# per-rank socket bytes (a progress signal) and one blocked rank's wait


def socket_inodes(pids: Iterable[int]) -> dict[int, int]:
    """socket inode -> the pid holding it, over the given processes."""
    out: dict[int, int] = {}
    for pid in pids:
        for link in fd_links(pid).values():
            if link.startswith("socket:"):
                ino = inode_of(link)
                if ino:
                    out[ino] = pid
    return out


def net_bytes(trees: dict[int, list[int]], socks: dict[int, TcpSock] | None = None) -> dict[int, int | None]:
    """rank -> bytes its process tree's TCP sockets received plus had acknowledged, leaving out
    connections between the job's own processes (gloo, the store: they move in collectives).
    None when no byte counts are available (no sock_diag)."""
    socks = tcp_sockets() if socks is None else socks
    held = {r: socket_inodes(pids) for r, pids in trees.items()}
    job = {ino for inodes in held.values() for ino in inodes}
    peers = peer_inodes(socks)
    out: dict[int, int | None] = {}
    for r, inodes in held.items():
        mine = [socks[i] for i in inodes if i in socks and peers.get(i) not in job]
        if any(s.received is None for s in mine):
            out[r] = None
            continue
        out[r] = sum((s.received or 0) + (s.acked or 0) for s in mine)
    return out


def with_net(samples: dict[int, ProcSample]) -> dict[int, ProcSample]:
    """The samples with the bytes each rank's process tree moved through its sockets (``net``)."""
    moved = net_bytes({r: list(s.tree) for r, s in samples.items() if s.alive and s.tree})
    return {r: dataclasses.replace(s, net=moved.get(r)) for r, s in samples.items()}


@dataclass(frozen=True)
class FdFact:
    """One fd a blocked call waits on, and what is known of its other end."""

    fd: int
    kind: str  # "socket", "pipe", "file", "epoll", "other", "" (unreadable)
    target: str
    sock: TcpSock | None = None
    others: tuple[ProcInfo, ...] = ()  # socket: the local peer's owners; pipe: the other processes holding a write end
    self_writer: bool = False  # pipe: this process holds a write end itself


@dataclass(frozen=True)
class WaitFacts:
    """Everything the kernel says about one rank's main thread (probes only gather)."""

    pid: int
    syscall: Syscall
    wchan: str = ""
    fds: tuple[FdFact, ...] = ()
    sleep_left: float | None = None
    children: tuple[ProcInfo, ...] = ()  # the rank's descendants
    lock_holders: tuple[ProcInfo, ...] = ()  # flock/fcntl: who holds the lock waited for
    lock_self: bool = False  # the lock waited for is held by this very process
    threads: int = 0  # kernel tasks of the process
    # its threads blocked on a process-private futex with no timeout (forever_futex): tid set
    locked: frozenset[int] = frozenset()
    notes: tuple[str, ...] = field(default_factory=tuple)


_FD_ARG = {"read": 0, "readv": 0, "recvfrom": 0, "recvmsg": 0, "accept": 0, "accept4": 0, "connect": 0,
           "write": 0, "writev": 0, "sendto": 0, "sendmsg": 0, "flock": 0, "fcntl": 0, "fsync": 0,
           "fdatasync": 0, "syncfs": 0}  # fmt: skip


def _polled_fds(pid: int, call: Syscall, links: dict[int, str]) -> list[int]:
    a = call.args
    if call.name in ("poll", "ppoll") and len(a) >= 2 and 0 < a[1] <= 64:
        data = read_mem(pid, a[0], 8 * a[1])
        return [struct.unpack_from("=i", data, 8 * i)[0] for i in range(a[1])] if data else []
    if call.name in ("select", "pselect6") and a and 0 < a[0] <= 1024:
        data = read_mem(pid, a[1], (a[0] + 7) // 8) if len(a) > 1 else None
        if not data:
            return []
        return [i for i in range(a[0]) if data[i // 8] >> (i % 8) & 1]
    if call.name in ("epoll_wait", "epoll_pwait", "epoll_pwait2") and a:
        return epoll_targets(pid, a[0])
    return []


def wait_facts(pid: int, socks: dict[int, TcpSock] | None = None) -> WaitFacts:
    """What the main thread of ``pid`` is blocked on, with the other ends that decide whether the
    wait can end. A few dozen small /proc reads; scans /proc for owners only when a socket or a
    pipe is involved."""
    call = read_syscall(pid)
    links = fd_links(pid)
    fds: list[int] = []
    if call.name in _FD_ARG and call.args:
        fds = [call.args[_FD_ARG[call.name]]]
    else:
        fds = _polled_fds(pid, call, links)
    kids = tuple(proc_info(c, waiter=pid) for c in tree(pid)[1:])
    tasks = task_calls(pid)
    facts = [_fd_fact(pid, fd, links.get(fd, ""), socks) for fd in fds[:16]]
    holders: tuple[ProcInfo, ...] = ()
    lock_self = False
    if call.name in ("flock", "fcntl") and fds:
        fid = file_id(pid, fds[0])
        held = [lk for lk in file_locks() if lk.dev_inode == fid and not lk.waiting]
        lock_self = any(lk.pid == pid for lk in held)
        holders = tuple(proc_info(lk.pid) for lk in held if lk.pid != pid)
    return WaitFacts(pid, call, read_wchan(pid), tuple(_resolve(pid, facts, links)), sleep_left(pid, call),
                     kids, holders, lock_self, len(tasks),
                     frozenset(t for t, c in tasks.items() if forever_futex(c)))  # fmt: skip


def _fd_fact(pid: int, fd: int, link: str, socks: dict[int, TcpSock] | None) -> FdFact:
    ino = inode_of(link)
    if link.startswith("socket:"):
        if socks is None:
            socks = tcp_sockets()
        return FdFact(fd, "socket", link, socks.get(ino) if ino else None)
    if link.startswith("pipe:") or _is_fifo(pid, fd):
        return FdFact(fd, "pipe", link)
    if link.startswith("anon_inode:[eventpoll]"):
        return FdFact(fd, "epoll", link)
    if link.startswith("/"):
        return FdFact(fd, "file", link)
    return FdFact(fd, "other" if link else "", link)


def _is_fifo(pid: int, fd: int) -> bool:
    import stat

    try:
        return stat.S_ISFIFO(os.stat(f"/proc/{pid}/fd/{fd}").st_mode)
    except OSError:
        return False


def _resolve(pid: int, facts: list[FdFact], links: dict[int, str]) -> list[FdFact]:
    """Fill in the other ends: a local socket peer's owners; a pipe's writers."""
    sockets = [f for f in facts if f.kind == "socket" and f.sock is not None]
    pipes = [f for f in facts if f.kind == "pipe"]
    if not sockets and not pipes:
        return facts
    all_socks = tcp_sockets() if sockets else {}
    peers = peer_inodes(all_socks)
    wanted = [f"socket:[{peers[f.sock.inode]}]" for f in sockets if f.sock and f.sock.inode in peers]
    wanted += [f.target for f in pipes]
    held = owners(wanted)
    out = []
    for f in facts:
        if f.kind == "socket" and f.sock is not None:
            peer = peers.get(f.sock.inode)
            others = tuple(proc_info(p) for p, _ in held.get(f"socket:[{peer}]", []) if p != pid) if peer else ()
            out.append(FdFact(f.fd, f.kind, f.target, f.sock, others))
        elif f.kind == "pipe":
            writers = [(p, fd) for p, fd in held.get(f.target, []) if fd_mode(p, fd) in (1, 2)]
            self_writer = any(p == pid for p, _ in writers)
            others = tuple(proc_info(p, waiter=pid) for p in sorted({p for p, _ in writers if p != pid}))
            out.append(FdFact(f.fd, f.kind, f.target, None, others, self_writer))
        else:
            out.append(f)
    return out
