"""The NaN triage's gradient check: which rank first produced a non-finite gradient.

Only during a NaN replay: the agent sets ``TRAINGUARD_NAN_CHECK`` (a directory of the run dir) in
the workers' environment for that attempt, and the bootstrap installs this check when torch is
imported; otherwise nothing here runs. The check sits on the path every rank's gradients take to
their reduction, without a change to the user's code:

- DDP: trainguard's comm hook (worker/hooks.py) hands each gradient bucket here *before* its
  all-reduce, so the rank whose own gradients went non-finite is seen before the reduction
  spreads the NaN to every rank;
- anything else (no DDP comm hook: FSDP, a single process, a DDP with its own comm path): an
  optimizer step pre-hook looks at the gradients the optimizer is about to apply. Those may be
  reduced already, so every rank then shows the NaN at the same step (``where`` says which).

The first non-finite value of a process is written once, as one JSON file per rank
(``rank-<r>.json``: rank, node, step, time, where); the agent reads them (``first_nonfinite``).
Cost while on: one ``isfinite`` pass over each bucket (a device sync on CUDA), for the replay only.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from trainguard.evidence import NanEvidence

ENV_DIR = "TRAINGUARD_NAN_CHECK"
BEFORE_REDUCTION = "before_reduction"
OPTIMIZER = "optimizer_step"


class GradCheck:
    def __init__(self, out_dir: Path, rank: int, node: str) -> None:
        self.out_dir, self.rank, self.node = out_dir, rank, node
        self.steps = 0  # optimizer steps this process completed
        self.saw_bucket = False  # DDP hands buckets here: the optimizer-side check is not needed
        self.fired = False

    def bucket(self, buffer: Any) -> None:
        self.saw_bucket = True
        if not self.fired and not _finite(buffer):
            self._record(BEFORE_REDUCTION)

    def before_step(self, opt: Any, args: Any, kwargs: Any) -> None:
        if self.fired or self.saw_bucket:
            return
        grads = [p.grad for g in opt.param_groups for p in g["params"] if getattr(p, "grad", None) is not None]
        if any(not _finite(g) for g in grads):
            self._record(OPTIMIZER)

    def after_step(self, opt: Any, args: Any, kwargs: Any) -> None:
        self.steps += 1

    def _record(self, where: str) -> None:
        from trainguard import runfiles

        self.fired = True
        record = {"rank": self.rank, "node": self.node, "step": self.steps + 1, "time": time.time(), "where": where}
        try:
            self.out_dir.mkdir(parents=True, exist_ok=True)
            fd = runfiles.open_fd(self.out_dir / f"rank-{self.rank}.json", os.O_WRONLY | os.O_CREAT | os.O_EXCL)
            with os.fdopen(fd, "w") as f:
                json.dump(record, f)
        except OSError as exc:  # the check must never stop training
            print(f"trainguard: nan check could not record: {exc}", flush=True)
        print(f"trainguard nan-check: rank {self.rank} produced a non-finite gradient at its step "
              f"{record['step']} ({where})", flush=True)  # fmt: skip


def _finite(t: Any) -> bool:
    import torch

    return bool(torch.isfinite(t).all())


def install_torch(_torch: Any = None) -> None:
    """Install the check (the bootstrap calls this once torch is imported, when ``ENV_DIR`` is set)."""
    from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

    from trainguard.worker import hooks

    check = GradCheck(Path(os.environ[ENV_DIR]), int(os.environ.get("RANK", "0")),
                      os.environ.get("TRAINGUARD_NODE", ""))  # fmt: skip
    register_optimizer_step_pre_hook(check.before_step)
    register_optimizer_step_post_hook(check.after_step)
    hooks.bucket_check = check.bucket


# ---- the agent's side (pure but for reading the files) ------------------------------------------


def read_records(out_dir: Path) -> list[dict[str, Any]]:
    """The ranks' records in ``out_dir`` (bad ones skipped: a rank killed while writing)."""
    from trainguard import runfiles

    out = []
    for path in sorted(out_dir.glob("rank-*.json")) if out_dir.is_dir() else []:
        try:
            record = json.loads(runfiles.read_text(path, limit=1 << 16))
        except (OSError, ValueError):
            continue
        if isinstance(record, dict) and isinstance(record.get("rank"), int) and isinstance(record.get("step"), int):
            out.append(record)
    return out


def first_nonfinite(records: list[dict[str, Any]], attempt: int) -> NanEvidence | None:
    """The first rank that went non-finite: the lowest step (the reduction spreads a NaN to every
    rank at the next step), then the earliest time; with every rank non-finite at that step."""
    if not records:
        return None
    first = min(records, key=lambda r: (r["step"], float(r.get("time") or 0.0)))
    same = sorted((r for r in records if r["step"] == first["step"]), key=lambda r: r["rank"])
    return NanEvidence(
        attempt=attempt,
        rank=first["rank"],
        node=str(first.get("node") or ""),
        source="gradient_check",
        step=first["step"],
        ranks=tuple(r["rank"] for r in same),
        nodes=tuple(sorted({str(r.get("node") or "") for r in same})),
        detail=f"first non-finite gradient {first.get('where', '')}",
    )
