"""Before a node's workers start on ranks it holds no snapshot of, pull the newest from the other
nodes' agents into its own shared memory.

A standby that takes a lost node's place, or a survivor whose ranks moved in the new round, holds
nothing of its new ranks: their newest snapshots are in another node's memory (that node's own
slots, or the replicas a buddy keeps of the lost node). Through the checkpoint dir they reach it
only when that dir is shared and the holder persisted them in time; pulled over the network they
are in this node's memory before its workers start, and ``load_latest`` finds them there like any
snapshot of its own (each worker agrees with the others on the newest step every rank has, as
always). The agent asks its own server (the replicas it keeps: the lost node's buddy may be the
survivor that now runs its ranks) and every other node of the round what they hold of those ranks
at the round's world size (``replica.list_held``), takes for each rank the newest steps (up to ``PER_RANK``) newer
than any it holds itself, and receives them as slot files of its own, numbered above every slot in
its directory (``replica.fetch``: signed, verified, the snapshot asked for or nothing).

Pure parts (``needed``, ``choose``) decide; ``pull`` does the I/O and never raises: what could not
be pulled is reported (``checkpoint_fetch_failed``) and the workers start with what there is.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainguard.checkpoint.replica import Buddy, Held, fetch, list_held
from trainguard.checkpoint.shm import read_header, slot_files, slot_path

# Steps pulled per rank: the newest and the one before, as a buddy keeps them (the newest step
# every rank holds may be one behind a rank's newest).
PER_RANK = 2
LIST_TIMEOUT_S = 10.0


@dataclass
class Pulled:
    """What ``pull`` did: per rank the steps received (with the node they came from and the
    node whose snapshot it was), the peers that could not be asked or did not send, the bytes."""

    got: dict[int, list[tuple[int, str, str]]] = field(default_factory=dict)  # rank -> [(step, from peer, snapshot's node)]
    failed: dict[str, str] = field(default_factory=dict)  # peer -> why
    nbytes: int = 0
    seconds: float = 0.0


def held_here(shm_dir: Path, world: int) -> dict[int, set[int]]:
    """rank -> steps of the complete snapshots at world size ``world`` in ``shm_dir``."""
    out: dict[int, set[int]] = {}
    for _, rank, hdr in _slots(shm_dir):
        if hdr.complete and hdr.world == world and hdr.rank == rank:
            out.setdefault(rank, set()).add(hdr.step)
    return out


def needed(ranks: Iterable[int], previous: Iterable[int], here: dict[int, set[int]]) -> list[int]:
    """The ranks to look for elsewhere: those this node did not run in its last round (what it
    holds of them may be older than another node's) and those it holds nothing of."""
    before = set(previous)
    return sorted(r for r in ranks if r not in before or not here.get(r))


def choose(offers: list[tuple[Buddy, Held]], here: dict[int, set[int]], per_rank: int = PER_RANK) -> list[tuple[Buddy, Held]]:
    """For each rank offered, the newest ``per_rank`` steps newer than any held here, one holder
    each (the copy saved last; ties by peer name, so every run chooses alike)."""
    best: dict[tuple[int, int], tuple[Buddy, Held]] = {}
    for peer, h in offers:
        if h.step <= max(here.get(h.rank, ()), default=-1):
            continue
        key = (h.rank, h.step)
        cur = best.get(key)
        if cur is None or (h.time, peer.node) > (cur[1].time, cur[0].node):
            best[key] = (peer, h)
    out: list[tuple[Buddy, Held]] = []
    for rank in sorted({r for r, _ in best}):
        steps = sorted((s for r, s in best if r == rank), reverse=True)[:per_rank]
        out += [best[(rank, s)] for s in sorted(steps)]  # oldest first: the newest gets the highest seq
    return out


def pull(shm_dir: Path, ranks: list[int], world: int, here: dict[int, set[int]], peers: list[Buddy], key: bytes,
         nslots: int, emit: Callable[..., Any]) -> Pulled:
    """Ask ``peers`` what they hold of ``ranks`` at ``world`` and pull what ``choose`` picks (given
    ``here``, ``held_here(shm_dir, world)``) into slot files of ``shm_dir`` (at most ``nslots`` per
    rank). Never raises."""
    result = Pulled()
    start = time.monotonic()
    offers: list[tuple[Buddy, Held]] = []
    with ThreadPoolExecutor(max_workers=min(8, max(1, len(peers)))) as pool:
        for peer, listed in zip(peers, pool.map(lambda p: _listing(p, key, ranks, world), peers), strict=True):
            if isinstance(listed, str):
                result.failed[peer.node] = listed
            else:
                offers += [(peer, h) for h in listed]
    chosen = choose(offers, here)
    seq = _max_seq(shm_dir)
    by_peer: dict[Buddy, list[Held]] = {}
    for peer, h in chosen:
        by_peer.setdefault(peer, []).append(h)
    for peer, items in by_peer.items():
        seqs = list(range(seq + 1, seq + 1 + len(items)))
        seq += len(items)
        got, why = fetch(peer, key, items, shm_dir, seqs)
        if why is not None:
            result.failed[peer.node] = why
        for h, path in got:
            _place(shm_dir, h.rank, path, nslots)
            result.got.setdefault(h.rank, []).append((h.step, peer.node, h.node))
            result.nbytes += h.nbytes
    result.seconds = time.monotonic() - start
    _report(result, ranks, emit)
    return result


def _listing(peer: Buddy, key: bytes, ranks: list[int], world: int) -> list[Held] | str:
    try:
        return list_held(peer, key, ranks, world, timeout_s=LIST_TIMEOUT_S)
    except (OSError, ValueError) as exc:
        return f"{type(exc).__name__}: {exc}"


def _slots(shm_dir: Path) -> list[tuple[Path, int, Any]]:
    """(path, rank, header) of every readable slot file in ``shm_dir``."""
    return [(path, rank, hdr) for path, rank in slot_files(shm_dir) if (hdr := read_header(path)) is not None]


def _max_seq(shm_dir: Path) -> int:
    # Above every slot of the directory, whichever rank: the worker numbers its saves on from the
    # highest (client._adopt_existing_slots), and the persister takes the highest as the newest.
    return max((hdr.seq for _, _, hdr in _slots(shm_dir)), default=0)


def _place(shm_dir: Path, rank: int, received: Path, nslots: int) -> Path:
    """Give a received snapshot a slot name of ``rank``: a free one, else the one holding the
    oldest snapshot (older than what was pulled: ``choose`` takes only newer steps)."""
    seqs = {}
    for i in range(nslots):
        path = slot_path(shm_dir, rank, i)
        if not path.exists():
            dest = path
            break
        hdr = read_header(path)
        seqs[i] = hdr.seq if hdr is not None and hdr.complete else -1
    else:
        dest = slot_path(shm_dir, rank, min(seqs, key=lambda i: seqs[i]))
    os.replace(received, dest)  # the persister and sender reopen a replaced file (SlotCache)
    return dest


def _report(result: Pulled, ranks: list[int], emit: Callable[..., Any]) -> None:
    for rank, got in sorted(result.got.items()):
        steps = [s for s, _, _ in got]
        step, peer, node = got[-1]
        whose = "its own snapshot" if peer == node else f"its replica of node {node}"
        emit("checkpoint_fetched",
             f"rank {rank}: step(s) {steps} pulled from node {peer} ({whose}) into this node's memory before its workers start",
             rank=rank, evidence={"rank": rank, "steps": steps, "from_node": peer, "of_node": node,
                                  "bytes": result.nbytes, "seconds": round(result.seconds, 3)})
    for peer, why in sorted(result.failed.items()):
        emit("checkpoint_fetch_failed",
             f"could not pull snapshots of rank(s) {ranks} from node {peer}: {why}; the workers start with what this node holds",
             severity="warning", evidence={"peer": peer, "ranks": ranks, "error": why})
