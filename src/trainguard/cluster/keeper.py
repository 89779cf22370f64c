"""Keep the c10d rendezvous store up after this node leaves the job.

With ``--rdzv-backend c10d`` one agent hosts the TCPStore every node rendezvous through. If that
node is excluded (faulty, straggler) and its agent simply exited, the store would go with it and
the nodes that should go on would fail with RendezvousConnectionError. So an excluded agent that
hosts the store stays up — no workers, no rendezvous — until the others have closed the
rendezvous, or until no peer has been connected to the store for a while.
"""

from __future__ import annotations

import logging
import time

import psutil

log = logging.getLogger(__name__)


def listening_port(port: int) -> bool:
    """Whether this process listens on ``port`` (i.e. it hosts the store there)."""
    if port <= 0:
        return False
    try:
        conns = psutil.Process().net_connections(kind="tcp")
    except (psutil.Error, OSError):
        return False
    return any(c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port for c in conns)


def peer_connections(port: int) -> int:
    """Connections to our store from other processes (our own client sockets excluded)."""
    try:
        conns = psutil.Process().net_connections(kind="tcp")
    except (psutil.Error, OSError):
        return 0
    established = [c for c in conns if c.status == psutil.CONN_ESTABLISHED and c.laddr and c.raddr]
    own_clients = {c.laddr.port for c in established if c.raddr.port == port}
    return sum(1 for c in established if c.laddr.port == port and c.raddr.port not in own_clients)


def keep_store(is_closed, port: int, idle_s: float = 30.0, poll_s: float = 1.0) -> str:
    """Serve until the rendezvous is closed or no peer was connected for ``idle_s`` seconds."""
    quiet_since: float | None = None
    while True:
        try:
            if is_closed():
                return "the other nodes closed the rendezvous"
        except Exception:
            pass
        now = time.monotonic()
        if peer_connections(port):
            quiet_since = None
        elif quiet_since is None:
            quiet_since = now
        elif now - quiet_since >= idle_s:
            return f"no node connected to the store for {idle_s:.0f} s"
        time.sleep(poll_s)
