"""Two ranks in two different collectives: both calls, with their sequence numbers, and which rank
is out of sequence where the counters allow it. Pure: takes each rank's collective
counters (worker/hooks.py counts every collective a rank starts, always on; probes/ring_reader
reads them) and where its stack shows it waiting.

A process group pairs the ranks' collectives by position: the n-th collective of one rank meets
the n-th of every other. So when ranks wait in different calls:

- at different sequence numbers, the ranks behind have started fewer collectives: they are out of
  sequence (a skipped collective, or one made outside the group's view);
- at one sequence number with three or more ranks, a strict majority in one call leaves the others
  out of sequence;
- at one sequence number with two ranks, the counts per operation decide only when one call is
  an operation both ranks had made before (an established one, e.g. the loop's all_reduce) and the
  other is not: the rank that left the established operation with fewer calls than its peer
  skipped one of them. (Otherwise a skip and an extra call look alike: say so, name no rank.)

The same comparison runs over torch's Flight Recorder (``flight_calls``), where torch numbers the
calls per process group (the numbering that pairs them) and says which call a rank has in flight
even when its Python stack shows none (NCCL: the main thread waits in a stream synchronise).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol


class CountsLike(Protocol):
    seq: int
    calls: Mapping[str, int]


@dataclass(frozen=True)
class Counts:
    seq: int
    calls: Mapping[str, int]


class InFlightLike(Protocol):
    seq: int
    op: str
    state: str


class GroupLike(Protocol):
    """One rank's Flight Recorder view of one process group (probes/flight_recorder.GroupFlight)."""

    pg: str
    desc: str
    in_flight: InFlightLike | None
    history: Sequence[tuple[int, str]]


@dataclass(frozen=True)
class InCall:
    op: str  # the collective the rank waits in (its stack, or its last counted call)
    site: str = ""  # where in the user's code ("train.py:40 in step")


@dataclass(frozen=True)
class SequenceFinding:
    lines: list[str] = field(default_factory=list)  # the report's lines (empty: nothing to say)
    out_of_sequence: list[int] = field(default_factory=list)  # ranks out of sequence ([]: undetermined)
    why: str = ""

    def to_dict(self) -> dict:
        return {"lines": self.lines, "out_of_sequence": self.out_of_sequence, "why": self.why}


def _call_line(rank: int, call: InCall, counts: CountsLike) -> str:
    nth = counts.calls.get(call.op, 0)
    at = f" at {call.site}" if call.site else ""
    return f"rank {rank}: in {call.op}{at}: collective #{counts.seq} of the rank, its {call.op} call #{nth}"


def compare_sequences(calls: Mapping[int, InCall], counts: Mapping[int, CountsLike]) -> SequenceFinding:
    """The sequence finding over the ranks waiting in a collective (``calls``) whose counters are
    known (``counts``); empty when they all wait in one call or fewer than two can be compared."""
    ranks = sorted(r for r in calls if r in counts and counts[r].seq > 0)
    if len(ranks) < 2 or len({calls[r].op for r in ranks}) < 2:
        return SequenceFinding()
    lines = [_call_line(r, calls[r], counts[r]) for r in ranks]
    out, why = _out_of_sequence(ranks, calls, counts)
    if out:
        lines.append(f"out of sequence: rank{'s' if len(out) > 1 else ''} {', '.join(map(str, out))} ({why})")
    else:
        lines.append(f"out of sequence: undetermined ({why})")
    return SequenceFinding(lines, out, why)


def _out_of_sequence(ranks: list[int], calls: Mapping[int, InCall], counts: Mapping[int, CountsLike]
                     ) -> tuple[list[int], str]:  # fmt: skip
    seqs = {r: counts[r].seq for r in ranks}
    top = max(seqs.values())
    if min(seqs.values()) < top:
        behind = [r for r in ranks if seqs[r] < top]
        return behind, f"started fewer collectives than the others ({top}): behind by {top - min(seqs.values())}"
    ops = Counter(calls[r].op for r in ranks)
    op, n = ops.most_common(1)[0]
    if len(ranks) > 2:
        if n * 2 > len(ranks):
            return [r for r in ranks if calls[r].op != op], f"the other ranks are all in {op} #{top}"
        return [], "no majority among the calls at one sequence number"
    return _two_ranks(ranks[0], ranks[1], calls, counts)


def _two_ranks(a: int, b: int, calls: Mapping[int, InCall], counts: Mapping[int, CountsLike]
               ) -> tuple[list[int], str]:  # fmt: skip
    def established(op: str) -> bool:  # both ranks had completed calls of it before
        return all(counts[r].calls.get(op, 0) - (calls[r].op == op) > 0 for r in (a, b))

    op_a, op_b = calls[a].op, calls[b].op
    for x, y, op_x in ((a, b, op_a), (b, a, op_b)):  # y left x's established operation early?
        op_y = calls[y].op
        made_x, made_y = counts[x].calls.get(op_x, 0), counts[y].calls.get(op_x, 0)
        if established(op_x) and not established(op_y) and made_y < made_x:
            return [y], (f"rank {y} made {made_y} {op_x} calls to rank {x}'s {made_x} and went on to {op_y}: "
                         f"it skipped {'one' if made_x - made_y == 1 else made_x - made_y} (or rank {x} made extra)")
    return [], "two ranks at one sequence number: a skipped call and an extra one look alike"


def flight_calls(groups: Mapping[int, Mapping[str, GroupLike]]
                 ) -> tuple[str, dict[int, InCall], dict[int, Counts]]:  # fmt: skip
    """From each rank's Flight Recorder groups (rank -> pg id -> view): the first process group
    whose ranks have different calls in flight (another operation, or another sequence number),
    as (its label, the calls, the counts for ``compare_sequences``); ("", {}, {}) when none.
    Counts cover the calls every compared rank's buffer still holds, up to its call in flight."""
    for pg in sorted({pg for gs in groups.values() for pg in gs}, key=lambda p: (len(p), p)):
        views = {r: gs[pg] for r, gs in groups.items() if pg in gs and gs[pg].in_flight is not None}
        if len(views) < 2 or len({(v.in_flight.seq, v.in_flight.op) for v in views.values()}) < 2:  # type: ignore[union-attr]
            continue
        lo = max((v.history[0][0] for v in views.values() if v.history), default=0)
        calls, counts = {}, {}
        for r, v in sorted(views.items()):
            now = v.in_flight
            assert now is not None
            calls[r] = InCall(now.op)
            counts[r] = Counts(now.seq, Counter(op for seq, op in v.history if lo <= seq <= now.seq))
        desc = next(iter(views.values())).desc
        return f"process group {pg}" + (f" ({desc})" if desc else ""), calls, counts
    return "", {}, {}
