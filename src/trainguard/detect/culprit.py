"""Which rank hangs the job, from where every rank's main thread is (its Python stack).

In a hung collective job almost every rank waits in the same collective; the culprit is the rank
that is not where the others are: stopped, gone, busy in its own code, stuck reading data, or
waiting in a *different* collective. Pure: takes stacks and process states as data.

The hang causes named in the seed (ModelArts "训练作业卡死检测" common cases) are recognised
when the stacks show them.
"""

from __future__ import annotations

import os
import re
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol


class FrameLike(Protocol):
    name: str
    filename: str
    line: int


@dataclass(frozen=True)
class RankView:
    """What is known about one rank when the job looks hung."""

    rank: int
    state: str  # /proc state letter of the worker ("" = gone)
    frames: Sequence[FrameLike] = ()  # main thread, innermost first; empty when unknown
    busy: bool = False  # on CPU over the judged window (the process and its children)
    error: str | None = None  # why the stack is unknown
    last_step: int | None = None
    other_frames: Sequence[Sequence[FrameLike]] = ()  # other threads, for named causes only


# Where a rank's main thread is, coarsely. "waiting" kinds are where ranks meet each other.
WAITING = ("collective", "backward", "device", "init")
# Most telling first: used to pick one culprit among several odd ranks.
PRIORITY = (
    "stopped", "gone", "user", "serialising", "dataloader", "checkpoint", "eval", "forward", "collective", "backward",
    "device", "init", "exiting", "unknown",
)  # fmt: skip
# c10d's helpers that pickle or unpickle an object collective's payload: a rank in them (or in
# the user's __getstate__/__reduce__ below them) is still preparing its side, not waiting.
_SERIALISE_FUNCS = {"_object_to_tensor", "_tensor_to_object"}

_C10D = "torch/distributed/distributed_c10d.py"
_INIT_FUNCS = {"init_process_group", "new_group", "_new_group_with_tag", "_store_based_barrier", "rendezvous"}
_EVAL_RE = re.compile(
    r"(^|[_.])(eval|evaluate|evaluation|evaluator|validate|validation|valid|val|test|predict|prediction)([_.]|$|\d)",
    re.IGNORECASE,
)
_CKPT_RE = re.compile(r"checkpoint|ckpt|save_model|save_state|save_pretrained|save_file", re.IGNORECASE)
_FORWARD_FUNCS = {"_call_impl", "_wrapped_call_impl"}  # nn.Module.__call__
_LIB_MARKERS = ("site-packages/", "dist-packages/", "<frozen", "/lib/python3")
# trainguard's own wrappers (auto-instrumented collectives, ...) are not the user's code either.
_OWN_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
# py-spy's words when the process is alive but its interpreter is already finalised: it is exiting.
_EXITING_ERRORS = ("failed to find a python interpreter", "interpreter finalised")


@dataclass(frozen=True)
class Position:
    kind: str  # stopped gone exiting collective serialising backward device init dataloader checkpoint eval forward user unknown
    op: str = ""  # collective name (all_reduce, broadcast, ...)
    site: str = ""  # innermost frame of the user's own code: "file:line in func"
    busy: bool = False
    phase: str = ""  # "checkpoint", "eval" or "forward" when the frames show one (even inside a collective)

    @property
    def waiting(self) -> bool:
        return self.kind in WAITING

    @property
    def signature(self) -> tuple[str, str, str]:
        return (self.kind, self.op, self.site)

    def describe(self, plural: bool = False) -> str:
        is_, wait = ("are", "wait") if plural else ("is", "waits")
        what = {
            "stopped": f"{is_} stopped (process state T)",
            "gone": "exited" if plural else "has exited",
            "exiting": f"{is_} exiting (Python already finalised)",
            "collective": f"{wait} in {self.op}",
            "serialising": f"{is_} serialising its side of {self.op} (on CPU)" if self.busy
            else f"{is_} serialising its side of {self.op}",
            "backward": f"{wait} in backward (DDP gradient all-reduce)",
            "device": f"{wait} for the GPU ({self.op}: queued NCCL kernels)",
            "init": f"{wait} in process-group initialisation ({self.op})",
            "dataloader": f"{wait} for the DataLoader",
            "checkpoint": f"{is_} saving a checkpoint",
            "eval": f"{is_} evaluating",
            "forward": f"{is_} running forward passes (evaluation, generation)",
            "user": f"{is_} busy in own code (on CPU)" if self.busy else f"{is_} idle in own code (sleep/blocking call)",
            "unknown": f"{is_} at an unknown place (no stack)",
        }[self.kind]
        return f"{what} at {self.site}" if self.site and self.kind not in ("stopped", "gone", "exiting") else what

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "op": self.op, "site": self.site, "busy": self.busy, "phase": self.phase}


def _is_library(filename: str) -> bool:
    f = filename.replace("\\", "/")
    return any(m in f for m in _LIB_MARKERS) or "/torch/" in f or filename.startswith(_OWN_DIR)


is_library = _is_library  # for detect.waits: the user's own code vs libraries, torch and trainguard


def _site(frames: Sequence[FrameLike]) -> str:
    for fr in frames:
        if not _is_library(fr.filename):
            return f"{fr.filename.rsplit('/', 1)[-1]}:{fr.line} in {fr.name}"
    return f"{frames[0].filename.rsplit('/', 1)[-1]}:{frames[0].line} in {frames[0].name}" if frames else ""


def _phase(frames: Sequence[FrameLike]) -> str:
    """The long healthy phase the frames show: "checkpoint", "eval" (by the names of the user's
    functions), else "forward" when a module's forward runs (evaluation or generation through
    ``model.module`` or any module, named or not), else ""."""
    forward = False
    for fr in frames:
        f = fr.filename.replace("\\", "/")
        if (f.endswith("torch/serialization.py") and fr.name == "save") or "torch/distributed/checkpoint/" in f:
            return "checkpoint"
        if f.endswith("torch/nn/modules/module.py") and fr.name in _FORWARD_FUNCS:
            forward = True
        if "/torch/" in f:
            continue  # torch's own names (activation checkpointing, ...) say nothing about phases
        if _CKPT_RE.search(fr.name):
            return "checkpoint"
        if _EVAL_RE.search(fr.name):
            return "eval"
    return "forward" if forward else ""


def _serialising(frames: Sequence[FrameLike], innermost_c10d: FrameLike) -> bool:
    """Inside an object collective but still pickling or unpickling its payload: the innermost
    c10d frame is a serialisation helper, or the user's own code (a ``__getstate__``) runs below it."""
    if innermost_c10d.name in _SERIALISE_FUNCS:
        return True
    deeper = frames[: next(i for i, fr in enumerate(frames) if fr is innermost_c10d)]
    return any(not _is_library(fr.filename) for fr in deeper)


def classify(view: RankView) -> Position:
    """Where one rank is (see Position.kind)."""
    if view.state in ("T", "t"):
        return Position("stopped", site=_site(view.frames), phase=_phase(view.frames))
    if view.state in ("", "Z", "X", "gone"):
        return Position("gone")
    frames = list(view.frames)
    if not frames:
        if view.error and any(e in view.error.lower() for e in _EXITING_ERRORS):
            return Position("exiting")
        return Position("unknown", busy=view.busy)
    site, phase = _site(frames), _phase(frames)
    c10d = [fr for fr in frames if fr.filename.replace("\\", "/").endswith(_C10D)]
    if c10d:
        public = [fr.name for fr in c10d if not fr.name.startswith("_")] or [c10d[-1].name]
        op = public[-1]  # the outermost: what the user called (all_gather_object, not all_gather)
        if any(fr.name in _INIT_FUNCS for fr in c10d):
            return Position("init", op=next(fr.name for fr in reversed(c10d) if fr.name in _INIT_FUNCS), site=site, phase=phase)
        if _serialising(frames, c10d[0]):
            return Position("serialising", op=op, site=site, busy=view.busy, phase=phase)
        return Position("collective", op=op, site=site, busy=view.busy, phase=phase)
    for fr in frames:
        f = fr.filename.replace("\\", "/")
        if "torch/distributed/rendezvous.py" in f or "torch/distributed/elastic/rendezvous" in f:
            return Position("init", op=fr.name, site=site, phase=phase)
        if "torch/utils/data/" in f:
            return Position("dataloader", op=fr.name, site=site, busy=view.busy, phase=phase)
        if ("torch/autograd/" in f or f.endswith("torch/_tensor.py")) and "backward" in fr.name:
            return Position("backward", op="backward", site=site, busy=view.busy, phase=phase)
        if "torch/cuda/" in f and fr.name == "synchronize":
            # NCCL collectives are asynchronous: a rank waits for them where it syncs with the GPU.
            return Position("device", op="cuda synchronize", site=site, busy=view.busy, phase=phase)
    if phase:
        return Position(phase, site=site, busy=view.busy, phase=phase)
    return Position("user", site=site, busy=view.busy, phase=phase)


@dataclass
class CulpritVerdict:
    rank: int | None  # the culprit; None when the local stacks do not single one out
    reason: str
    positions: dict[int, Position]
    candidates: list[int] = field(default_factory=list)  # all odd ranks, most telling first
    causes: list[dict[str, str]] = field(default_factory=list)  # known causes (seed cases) shown by the evidence
    phase: str = ""  # "checkpoint", "eval", "forward" or "exit": what the ranks' frames show

    def to_dict(self) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "reason": self.reason,
            "candidates": self.candidates,
            "causes": self.causes,
            "phase": self.phase,
            "positions": {str(r): p.to_dict() | {"summary": p.describe()} for r, p in sorted(self.positions.items())},
        }


def _ranks(rs: Sequence[int]) -> str:
    return ("rank " if len(rs) == 1 else "ranks ") + ",".join(str(r) for r in sorted(rs))


def _order(ranks: Sequence[int], pos: Mapping[int, Position]) -> list[int]:
    def key(r: int) -> tuple[int, int, int]:
        p = pos[r]
        return (PRIORITY.index(p.kind), 0 if p.busy else 1, r)

    return sorted(ranks, key=key)


def _group_text(ranks: Sequence[int], pos: Mapping[int, Position]) -> str:
    return f"{_ranks(ranks)} {pos[ranks[0]].describe(plural=len(ranks) > 1)}"


def find_culprit(views: Mapping[int, RankView], nnodes: int = 1) -> CulpritVerdict:
    pos = {r: classify(v) for r, v in sorted(views.items())}
    ranks = list(pos)
    waiting = [r for r in ranks if pos[r].waiting]
    odd = [r for r in ranks if not pos[r].waiting]
    culprits: list[int] = []
    if len(ranks) == 1 and waiting and nnodes > 1:
        reason = f"rank {ranks[0]} {pos[ranks[0]].describe()}: a rank on another node does not arrive"
    elif len(ranks) == 1:
        culprits = ranks
        reason = f"rank {ranks[0]} {pos[ranks[0]].describe()}"
    elif waiting and odd:
        culprits = _order(odd, pos)
        first = culprits[0]
        by_sig = Counter(pos[r].signature for r in waiting)
        common = [r for r in waiting if pos[r].signature == by_sig.most_common(1)[0][0]]
        reason = f"rank {first} {pos[first].describe()} while {_group_text(common, pos)}"
        if len(culprits) > 1:
            reason += f" (also odd: {_ranks(culprits[1:])})"
    elif waiting and (p2p := _p2p_mismatch(waiting, pos)):
        culprits, reason = p2p
    elif waiting:
        by_sig = Counter(pos[r].signature for r in waiting)
        (top, n_top), *rest = by_sig.most_common()
        common = [r for r in waiting if pos[r].signature == top]
        if not rest:
            where = "a rank on another node does not arrive" if nnodes > 1 else "no local rank is behind"
            reason = f"all {_group_text(common, pos)}: {where}"
        elif n_top > rest[0][1]:
            culprits = _order([r for r in waiting if pos[r].signature != top], pos)
            first = culprits[0]
            reason = f"rank {first} {pos[first].describe()} while {_group_text(common, pos)}: mismatched collectives"
        else:
            tied = [sig for sig, n in by_sig.items() if n == n_top]
            groups = [[r for r in waiting if pos[r].signature == sig] for sig in tied]
            reason = "mismatched collectives, no majority: " + "; ".join(_group_text(g, pos) for g in groups)
            return _verdict(None, reason, pos, views, candidates=sorted(waiting))
    else:
        # Nobody waits for anybody: all stuck on their own (e.g. all in the DataLoader).
        by_sig = Counter(pos[r].signature for r in odd)
        (top, n_top), *rest = by_sig.most_common()
        if rest and n_top > rest[0][1]:
            culprits = _order([r for r in odd if pos[r].signature != top], pos)
            common = [r for r in odd if pos[r].signature == top]
            reason = f"rank {culprits[0]} {pos[culprits[0]].describe()} while {_group_text(common, pos)}"
        else:
            reason = "; ".join(_group_text([r for r in odd if pos[r].signature == sig], pos) for sig in by_sig)
            return _verdict(None, reason, pos, views, candidates=_order(odd, pos))
    return _verdict(culprits[0] if culprits else None, reason, pos, views, candidates=culprits)


P2P_RECV = ("recv",)  # blocking point-to-point receives (c10d's public names)
P2P_SEND = ("send", "isend", "batch_isend_irecv")


def _p2p_mismatch(waiting: Sequence[int], pos: Mapping[int, Position]) -> tuple[list[int], str] | None:
    """Ranks blocked in a point-to-point receive while no rank sends and the others wait in
    another call: the receive can never be matched, its rank is the culprit."""
    recv = [r for r in waiting if pos[r].kind == "collective" and pos[r].op in P2P_RECV]
    if not recv or len(recv) == len(waiting) or any(pos[r].op in P2P_SEND for r in waiting):
        return None
    others = [r for r in waiting if r not in recv]
    by_sig = Counter(pos[r].signature for r in others)
    common = [r for r in others if pos[r].signature == by_sig.most_common(1)[0][0]]
    first = _order(recv, pos)[0]
    reason = (f"rank {first} {pos[first].describe()} (point-to-point) while {_group_text(common, pos)}: no rank is "
              "sending to it, the receive can never complete")  # fmt: skip
    return _order(recv, pos), reason


def _verdict(
    rank: int | None, reason: str, pos: dict[int, Position], views: Mapping[int, RankView], candidates: list[int]
) -> CulpritVerdict:
    phases = [p.phase for p in pos.values() if p.phase]
    if pos and all(p.kind in ("gone", "exiting") for p in pos.values()):
        phases = ["exit"]  # training is over and the processes are shutting down (slow under load)
    return CulpritVerdict(
        rank=rank,
        reason=reason,
        positions=pos,
        candidates=candidates,
        causes=known_causes(pos, views, rank),
        phase=phases[0] if phases else "",
    )


# --------------------------------------------------------------------------------------------
# Named causes (seed 000 "常见案例"), each shown only when the evidence is there.


def _any_frame(views: Mapping[int, RankView], pred) -> bool:
    for v in views.values():
        for frames in (v.frames, *v.other_frames):
            if any(pred(fr) for fr in frames):
                return True
    return False


def known_causes(pos: Mapping[int, Position], views: Mapping[int, RankView], culprit: int | None) -> list[dict[str, str]]:
    causes: list[dict[str, str]] = []

    def add(key: str, text: str) -> None:
        causes.append({"cause": key, "advice": text})

    kinds = {p.kind for p in pos.values()}
    culprit_kind = pos[culprit].kind if culprit is not None else ""
    if "stopped" in kinds:
        add("process_stopped", "a worker was stopped (SIGSTOP, a debugger or job control) and never continued")
    if culprit_kind == "user" and pos[culprit].busy:
        add("busy_loop", "the culprit stays busy in its own code (a loop or a call that never returns) while the "
            "others wait in a collective")
    if "dataloader" in kinds:
        add("dataloader", "training hangs while reading data with the DataLoader: lower num_workers (seed: 训练中途卡死, case 4)")
    if "init" in kinds:
        add(
            "init_hang",
            "hang before training, in process-group initialisation: check that the master address/port, rank and "
            "world size are passed (seed: 训练前卡死); set NCCL_DEBUG=INFO to see NCCL's progress",
        )
    collective_ops = {p.op for p in pos.values() if p.kind in ("collective", "backward", "device")}
    steps = {v.last_step for v in views.values() if v.last_step is not None}
    left = "gone" in kinds or "exiting" in kinds
    if len(collective_ops) > 1 or (left and collective_ops) or len(steps) > 1:
        add(
            "collective_mismatch",
            "ranks run different collectives or different numbers of steps — e.g. last-epoch misalignment where data "
            "shards are not aligned and some ranks finish first (seed: 训练最后一个epoch卡死): align the data splits",
        )
    if _any_frame(views, lambda fr: "sync_batch_norm" in fr.name.lower() or "syncbatchnorm" in fr.name.lower()):
        add("sync_batchnorm", "stuck in SyncBatchNorm synchronisation: disable sync-batch-norm or upgrade PyTorch (seed)")
    if _any_frame(views, lambda fr: "tensorboard" in fr.filename.lower()):
        add("tensorboard", "stuck in a TensorBoard writer: write event files to a local path, not object storage (seed)")
    if _any_frame(views, lambda fr: "moxing" in fr.filename.lower() or fr.name == "copy_parallel"):
        add("data_copy", "stuck copying data (mox.file.copy_parallel): use threads=0, is_processing=False (seed)")
    if kinds == {"exiting"} or kinds == {"exiting", "gone"}:
        add("stuck_at_exit", "training ended but the processes do not exit (stuck in teardown: process-group "
            "destruction, native threads, atexit handlers)")
    if culprit_kind == "checkpoint":
        add("checkpoint", "stuck saving a checkpoint: storage slow, full or unreachable")
    return causes
