"""Several "nodes" on one machine, each in its own network namespace with its own address.

The namespaces hang off one bridge through veth pairs (``notes/multinode-netns.md``): node i is
namespace ``tg<id>n<i>`` with address ``10.<a>.<b>.<i>/24`` on interface ``tg<id>p<i>``. Names carry
a random id so parallel test sessions and reruns never collide; ``close()`` removes every
namespace, link and bridge it made (also when setting up failed half-way). Needs root and
``ip`` (iproute2). Processes are started inside a node with ``ip netns exec``.
"""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
from dataclasses import dataclass


class TestbedError(Exception):
    pass


def available() -> str | None:
    """Why network-namespace test beds cannot be made here (None: they can)."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "iproute2's `ip` is not installed"
    return None


def netem_missing() -> str | None:
    """Why the kernel cannot add a netem qdisc (None: it can), tried for real on the loopback of a
    throw-away namespace: the module may be built in, loadable or absent."""
    ns = f"tgprobe{secrets.token_hex(3)}"
    try:
        _ip("netns", "add", ns)
    except TestbedError as exc:
        return str(exc)
    try:
        done = subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", "lo", "root", "netem", "delay", "1ms"],
                              capture_output=True, text=True, timeout=30)  # fmt: skip
        return None if done.returncode == 0 else f"tc qdisc add ... netem: {done.stderr.strip() or done.returncode}"
    except (OSError, subprocess.SubprocessError) as exc:  # no tc
        return f"tc: {exc}"
    finally:
        _ip("netns", "delete", ns, check=False)


def _ip(*args: str, netns: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
    cmd = ["ip", *(["netns", "exec", netns, "ip"] if netns else []), *args]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    if check and done.returncode != 0:
        raise TestbedError(f"{' '.join(cmd)}: {done.stderr.strip() or done.returncode}")
    return done


@dataclass(frozen=True)
class Node:
    index: int  # 1-based
    netns: str
    ifname: str  # the namespace side of its veth pair (GLOO_SOCKET_IFNAME)
    host_if: str  # the bridge side
    addr: str

    def exec_prefix(self) -> list[str]:
        return ["ip", "netns", "exec", self.netns]


class Testbed:
    """``n`` nodes (plus ``extra`` namespaces for services such as etcd) on one private bridge."""

    def __init__(self, n: int, extra: int = 0) -> None:
        self.id = secrets.token_hex(3)  # interface names are limited to 15 characters
        self.bridge = f"tg{self.id}b"
        self.subnet = f"10.{200 + secrets.randbelow(50)}.{secrets.randbelow(250)}"
        self.nodes: list[Node] = []
        self._made: list[tuple[str, str]] = []
        try:
            _ip("link", "add", self.bridge, "type", "bridge")
            self._made.append(("link", self.bridge))
            _ip("link", "set", self.bridge, "up")
            for i in range(1, n + extra + 1):
                self.nodes.append(self._add_node(i))
        except BaseException:
            self.close()
            raise

    def _add_node(self, i: int) -> Node:
        node = Node(i, f"tg{self.id}n{i}", f"tg{self.id}p{i}", f"tg{self.id}v{i}", f"{self.subnet}.{i}")
        _ip("netns", "add", node.netns)
        self._made.append(("netns", node.netns))
        _ip("link", "add", node.host_if, "type", "veth", "peer", "name", node.ifname)
        self._made.append(("link", node.host_if))
        _ip("link", "set", node.host_if, "master", self.bridge)
        _ip("link", "set", node.host_if, "up")
        _ip("link", "set", node.ifname, "netns", node.netns)
        _ip("addr", "add", f"{node.addr}/24", "dev", node.ifname, netns=node.netns)
        _ip("link", "set", node.ifname, "up", netns=node.netns)
        _ip("link", "set", "lo", "up", netns=node.netns)
        return node

    def close(self) -> None:
        for kind, name in reversed(self._made):
            if kind == "netns":
                _ip("netns", "delete", name, check=False)
            else:
                _ip("link", "delete", name, check=False)
        self._made.clear()

    def __enter__(self) -> Testbed:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
