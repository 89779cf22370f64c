"""What the monitors of several agents share through the rendezvous store, and how one of them
speaks for the job: key scope, batched reads, bounded waits, first-writer-wins claims.

Agents see the store through ``SignedStore`` (cluster/stores.py): every value here is signed
with the job's key, and a forged one reads as absent.

Used by the straggler exchange (the leader merges every node's windows) and the hang exchange (the
first node to find a hang judges it for the job). Keys live in the round's store: a c10d
rendezvous scopes the store to the round (every restart is a new round) and agents that joined at
different times count attempts differently, so no attempt goes into the key there; the static
rendezvous reuses one store for every attempt (all agents restart together), so the attempt does.
"""

from __future__ import annotations

import time
from typing import Any, Protocol

from trainguard.cluster.stores import SignedStore

POLL_S = 0.2  # how often a bounded wait looks at the store again


class Round(Protocol):
    """What a key's scope depends on (a monitor's context has both)."""

    restart_count: int
    rdzv_backend: str


def scope(ctx: Round) -> str:
    """The prefix that keeps one attempt's keys apart from another's (see the module's doc)."""
    return f"a{ctx.restart_count}/" if ctx.rdzv_backend == "static" else ""


def get_all(store: Any, keys: list[str]) -> dict[str, bytes]:
    """The values of keys that exist: one round trip where the store can (multi_get), not one per
    key. Through a ``SignedStore`` (the agents' view of the store) a value no agent of this job
    wrote is left out, as if it were not there."""
    if not keys:
        return {}
    if isinstance(store, SignedStore):
        return store.get_many(keys)
    try:
        values = list(store.multi_get(keys))
    except (AttributeError, NotImplementedError, RuntimeError):
        values = [store.get(k) for k in keys]
    return dict(zip(keys, values, strict=True))


def wait_for(store: Any, keys: list[str], wait_s: float) -> list[str]:
    """The keys that exist, waiting up to ``wait_s`` for all of them (fewer is fine)."""
    deadline = time.monotonic() + wait_s
    while True:
        ready = [k for k in keys if store.check([k])]
        if len(ready) == len(keys) or time.monotonic() >= deadline:
            return ready
        time.sleep(POLL_S)


def first_writer(store: Any, key: str, value: str) -> tuple[bool, bytes]:
    """Write ``value`` under ``key`` unless another agent wrote there first (atomic in the store):
    (whether this value is the one that stands, the value that stands).

    Stores without ``compare_set`` (torch's ``EtcdStore`` of an etcd rendezvous) agree through
    ``add`` instead: the first to count 1 writes, the others wait (bounded by the store's timeout)
    for what it wrote."""
    try:
        stood = store.compare_set(key, "", value)
        return stood == value.encode(), stood
    except RuntimeError as exc:  # torch raises a bare "Not implemented" for a Python store without it
        if "not implemented" not in str(exc).lower():
            raise
    if store.add(f"{key}/claims", 1) == 1:
        store.set(key, value)
        return True, value.encode()
    store.wait([key])  # the claimer writes right after its add
    stood = store.get(key)
    return stood == value.encode(), stood

