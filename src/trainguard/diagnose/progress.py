"""Training progress in a log line, and whether a log that ends without an error had finished (pure).

A log that just stops is a verdict of its own ("the log ends at step N of M with no error and no
completion line"), but only where the log says the work was not done: a counter short of its
total (tqdm ``1577/3942``, Megatron ``iteration 3385/ 8000``, ``[240/735]``,
LLaMA-Factory's ``"current_steps": 610, "total_steps": 3120``), or a framework that always
prints a completion line (HF Trainer's ``train_runtime``, Lightning's ``Trainer.fit stopped``) and
did not. A plain ``step=20`` with nothing after it could be a complete run: no verdict.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

# Frameworks that end a normal run with a line the completion rules know.
ANNOUNCING = {"hf", "lightning", "megatron"}

_TQDM = re.compile(r"(\d{1,3})%\|[^|\n]{0,80}\|\s*(\d+)/(\d+)\s*\[")
_LIGHTNING = re.compile(r"\bEpoch \d+: (?:\s*\d{1,3}%\||: \d+it \[)")
_MEGATRON = re.compile(r"\biteration\s+(\d+)/\s*(\d+)\s*\|")
_BRACKET = re.compile(r"(?:Epoch\(train\)\s*|Epoch: )\[\d+\]\s*\[\s*(\d+)/(\d+)\]")
# LLaMA-Factory's trainer_log.jsonl
_JSONSTEPS = re.compile(r'"current_steps":\s*(\d+),\s*"total_steps":\s*(\d+)')
_HF = re.compile(r"^\{'(?:loss|train_loss|eval_loss)': |\[INFO\|trainer\.py:\d+\]")


# tqdm bars that count data or files, not training steps (dataset maps, shards, downloads)
DATA_BAR = re.compile(r"(?i)examples/s|shards|dataset|split|tokeniz|convert|filter|download|generating|"
                      r"\bmap\b|loading|preprocess|fetching|files/s|ba/s|sanity check|validati|evaluat|testing|predicting")  # fmt: skip


@dataclass(frozen=True)
class Step:
    style: str  # hf | lightning | megatron | tqdm | bracket
    n: int | None
    total: int | None

    @property
    def unfinished(self) -> bool:
        return self.n is not None and self.total is not None and self.n < self.total


def step_of(message: str) -> Step | None:
    if "|" not in message and "[" not in message and "{" not in message:
        return None
    m = _MEGATRON.search(message)
    if m:
        return Step("megatron", int(m[1]), int(m[2]))
    lightning = _LIGHTNING.search(message) is not None
    m = _TQDM.search(message)
    if m:
        style = "lightning" if lightning else "tqdm"
        return Step(style, int(m[2]), int(m[3]))
    if lightning:
        return Step("lightning", None, None)
    m = _BRACKET.search(message)
    if m:
        return Step("bracket", int(m[1]), int(m[2]))
    m = _JSONSTEPS.search(message) if "current_steps" in message else None
    if m:
        return Step("tqdm", int(m[1]), int(m[2]))
    if _HF.search(message):
        return Step("hf", None, None)
    return None


def stopped(last: Step | None, styles: set[str], completed: bool, started: bool) -> str | None:
    """Why a log without errors did not finish, or None when nothing says so."""
    if completed:
        return None
    if last is not None and last.unfinished:
        return f"the log ends at {last.n}/{last.total}"
    announcing = sorted(styles & ANNOUNCING)
    if announcing:
        where = (
            f" at {last.n}" + (f"/{last.total}" if last and last.total else "")
            if last and last.n is not None
            else ""
        )
        return f"the log ends{where} without the completion line {announcing[0]} prints at the end of a run"
    if last is None and started:
        return "the log ends during start-up (after the process group / NCCL communicators were set up)"
    return None
