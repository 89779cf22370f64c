"""A warm standby node (`trainguard run --standby`): an agent that joins the job's rendezvous as a
waiting node, trains nothing, and takes a lost node's place in the next round, so the world size
stays the same.

It is torch elastic's own mechanism: a c10d dynamic rendezvous puts a node that comes while the
round has --nnodes MAX participants on its redundancy list, where it keeps its heartbeat and waits
without a timeout; once a participant is gone (the survivors drop a lost node at once, see
``TrainguardAgent._reform_without``) it joins the next round. All this module adds is the order:
the standby joins only after the job's round has formed (had it joined first, it could take an
active node's place and leave that node waiting); it leaves torch's redundancy list only for a place
freed for good (``Vacancy``: a survivor said so, or the place stayed free for ``GRACE_S``), never
for a participant that only steps out for a whole-job restart; and what it says (``standby_joined``,
``standby_promoted``, ``standby_released``). It is warm because its agent's worker pool has
already imported torch in its zygote and spare workers (spawn/pool.py) while it waits; once
promoted, its agent pulls the lost ranks' newest steps from the node that keeps their replicas into
its own memory before its workers start (checkpoint/pull.py), where their ``load_latest()`` finds
them, node-local checkpoint dirs or not.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from torch.distributed.elastic.rendezvous import RendezvousGracefulExitError

from trainguard import stopsignal, torch_compat

log = logging.getLogger(__name__)
POLL_S = 0.5  # how often a standby reads whether the job's round has formed
FREED_KEY = "trainguard/freed"  # + /<round>: a survivor's word that a node of that round is gone for good
# A place free this long is taken even unannounced (a node lost before any survivor could say so):
# a participant stepping out for a restart rejoins the wait list within a store round trip or two.
GRACE_S = 5.0


def say_freed(signed_base: Any, round_number: int, nodes: list[str]) -> None:
    """A survivor's word to the standbys: a node of round ``round_number`` is gone for good
    (lost, left, excluded), so its place is theirs at once. Written in the rendezvous' base store,
    which standbys outside the round read too; signed like every key an agent acts on."""
    signed_base.set(f"{FREED_KEY}/{round_number}", ",".join(nodes) or "a node left")


def freed(signed_base: Any, round_number: int) -> bool:
    """Whether a survivor said a node of round ``round_number`` is gone for good (a forged word is
    reported by the signed store and counts as none)."""
    key = f"{FREED_KEY}/{round_number}"
    try:
        if not signed_base.check([key]):  # a bare get() would wait for the key
            return False
        signed_base.get(key)
        return True
    except Exception as exc:  # forged, or the store host is gone: the grace still lets it in
        log.debug("reading %s failed: %s", key, exc)
        return False


class Vacancy:
    """When a standby leaves torch's redundancy list for the next round (see
    ``torch_compat.hold_on_redundancy_list``): only when the round it waits beside has fewer
    than --nnodes MAX members (participants and nodes on the wait list: a participant restarting
    is on one or the other) and either a survivor said a node of that round is gone for good, or
    the place stayed free for ``grace_s``."""

    def __init__(self, said_freed: Callable[[int], bool], grace_s: float = GRACE_S,
                 clock: Callable[[], float] = time.monotonic) -> None:  # fmt: skip
        self.said_freed = said_freed
        self.grace_s = grace_s
        self.clock = clock
        self.round: int | None = None  # the last complete round seen
        self.short_since: float | None = None

    def __call__(self, state: Any, max_nodes: int) -> bool:
        if state.complete:
            self.round = int(state.round)
        if len(set(state.participants) | set(state.wait_list)) >= max_nodes:
            self.short_since = None
            return False
        if self.round is not None and self.said_freed(self.round):
            return True
        now = self.clock()
        if self.short_since is None:
            self.short_since = now
        return now - self.short_since >= self.grace_s


def await_formed_round(handler: Any, emit: Callable[..., Any], node: str, poll_s: float = POLL_S) -> None:
    """Wait until the job's round has formed, then say that this node waits as its standby.
    Raises RendezvousGracefulExitError (torch's agent then ends its run quietly) when the job
    ended first. A rendezvous that cannot say (etcd-v2, static) is joined at once."""
    said_waiting = False
    while True:
        stopsignal.raise_pending()
        got = torch_compat.rendezvous_round(handler)
        if got is None:
            log.warning("the %s rendezvous cannot say whether the job's round has formed: joining now",
                        type(handler).__name__)
            break
        closed, complete, participants, max_nodes = got
        if closed:
            raise RendezvousGracefulExitError("the job ended before this standby joined")
        if complete and participants >= 1:
            break
        if not said_waiting:
            log.info("standby %s: waiting for the job's first round to form before joining", node)
            said_waiting = True
        time.sleep(poll_s)
    emit("standby_joined", f"node {node} waits as a standby: it takes the place of the next node lost "
         f"(the job's round has {participants} of {max_nodes} nodes)",
         evidence={"node": node, "participants": participants, "max_nodes": max_nodes})


def promoted(emit: Callable[..., Any], node: str, group_rank: int, nnodes: int, world_size: int) -> None:
    emit("standby_promoted", f"standby {node} takes a place in the job: node {group_rank}/{nnodes}, "
         f"world size {world_size}",
         evidence={"node": node, "group_rank": group_rank, "nnodes": nnodes, "world_size": world_size})


def released(emit: Callable[..., Any], node: str, how: str = "") -> None:
    emit("standby_released", f"the job ended without needing standby {node}{how}", evidence={"node": node})
