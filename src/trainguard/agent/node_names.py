"""Node names in a round: every agent of a multi-node round says the name it goes by, and the
agents agree on distinct ones before any worker starts.

torchrun runs several agents of one job on one host (torch's own test_launch_elastic_multiple_agents),
and trainguard names a node after its host unless told otherwise: two such agents, each with its own
run dir (so the run-dir lock could not tell them apart), were both the host. Now a name is given
(``--node-name``, or the scheduler's) or a default, and a default is decided at the agent's first
multi-node round and kept for its life (its events, locks and history stay under one name):

- given names and names decided in an earlier round are fixed; one fixed name on two agents is
  refused on every agent (``Collision``): their events, locks, exclusions and Slurm drains would be
  mixed up, and neither can be renamed;
- an agent still without a decided name keeps the one it has (its run-dir lock's) when no fixed name
  and no agent of lower group rank has it, else takes the first free of ``<host>``, ``<host>-2``,
  ``<host>-3``..., in group-rank order (the rendezvous' order).

Every agent computes the same from the same claims, so each one knows its own name, and on a
refusal each one says it (none is left waiting for a peer that already gave up).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from typing import Any

from trainguard.cluster import exchange

log = logging.getLogger(__name__)
NODE_NAME_KEY = "trainguard/node-name"  # + /<scope><group rank>: that agent's claim in this round
READ_KEY = "trainguard/node-names-read"  # a count: agents that read every claim (unsigned, only shortens a wait)
POLL_S = 0.1
READ_WAIT_S = 10.0  # how long a refusing agent waits for the others to read the claims (it may host the store)


@dataclass(frozen=True)
class Claim:
    rank: int  # the agent's group rank in this round
    name: str  # the name it goes by now
    host: str  # its host name: where its default names come from
    given: bool  # --node-name or the scheduler's: never changed
    decided: bool  # a default name kept from an earlier round: never changed
    who: str  # "host vm, pid 123, agent 1a2b3c4d", for the refusal's message

    @property
    def fixed(self) -> bool:
        return self.given or self.decided

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, raw: bytes | str) -> Claim:
        d = json.loads(raw)
        return cls(int(d["rank"]), str(d["name"]), str(d["host"]), bool(d["given"]), bool(d["decided"]), str(d["who"]))


@dataclass(frozen=True)
class Collision:
    name: str
    claims: tuple[Claim, ...]

    def message(self) -> str:
        whose = "; ".join(c.who for c in self.claims)
        return f"two agents of this job are named {self.name!r} ({whose}): give each node its own --node-name"


def default_names(host: str) -> Iterator[str]:
    """``<host>``, ``<host>-2``, ``<host>-3``...: the second agent on a host is its second node."""
    yield host
    n = 2
    while True:
        yield f"{host}-{n}"
        n += 1


def assign(claims: list[Claim]) -> tuple[dict[int, str], list[Collision]]:
    """Each agent's name by group rank, and the fixed names that two agents hold (see the module)."""
    fixed: dict[str, list[Claim]] = {}
    for c in sorted(claims, key=lambda c: c.rank):
        if c.fixed:
            fixed.setdefault(c.name, []).append(c)
    collisions = [Collision(name, tuple(cs)) for name, cs in fixed.items() if len(cs) > 1]
    taken = set(fixed)
    names = {c.rank: c.name for c in claims if c.fixed}
    for c in sorted((c for c in claims if not c.fixed), key=lambda c: c.rank):
        name = c.name if c.name not in taken else next(n for n in default_names(c.host) if n not in taken)
        names[c.rank] = name
        taken.add(name)
    return names, collisions


def exchange_claims(signed: Any, raw: Any, mine: Claim, nnodes: int, scope: str, wait_s: float,
                    stopped: Callable[[], None]) -> list[Claim]:  # fmt: skip
    """Write this agent's claim, then read every agent's of the round (waiting up to ``wait_s``:
    ``stopped`` raises when another agent stopped the job meanwhile). Claims that did not come
    (an agent gone) or that no agent of this job signed are left out."""
    keys = [f"{NODE_NAME_KEY}/{scope}{r}" for r in range(nnodes)]
    signed.set(keys[mine.rank], mine.to_json())
    deadline = time.monotonic() + wait_s
    while not all(raw.check([k]) for k in keys) and time.monotonic() < deadline:
        stopped()
        time.sleep(POLL_S)
    claims = []
    for key, value in exchange.get_all(signed, [k for k in keys if raw.check([k])]).items():
        try:
            claims.append(Claim.from_json(value))
        except (ValueError, KeyError, TypeError) as exc:
            log.warning("ignored the node-name claim %s: %s", key, exc)
    raw.add(f"{READ_KEY}/{scope}", 1)
    return claims


def await_readers(raw: Any, nnodes: int, scope: str, wait_s: float = READ_WAIT_S) -> None:
    """Give the other agents up to ``wait_s`` to read every claim before this one exits: it may
    host the store, and an agent that cannot read the claims cannot say why the job is refused."""
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        try:
            if raw.add(f"{READ_KEY}/{scope}", 0) >= nnodes:
                return
        except Exception as exc:  # the store host is gone: nobody is left to wait for
            log.debug("reading the node-name readers' count failed: %s", exc)
            return
        time.sleep(POLL_S)
