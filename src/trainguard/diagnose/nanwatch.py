"""NaN/Inf in the training numbers across log records, where no single line says "loss is nan" (pure).

Experts read these from the numbers, not from an error message:
- a gradient norm that stays NaN/Inf for several records (HF Trainer's ``'grad_norm': nan``,
  mmengine's ``grad_norm: nan``, Megatron's ``grad norm: nan``); one NaN followed by finite values is
  a skipped fp16 step and normal, but a NaN in the log's last metric record (nothing finite after it:
  the run ended there) is not (``finish``);
- the loss stuck at exactly 0.0 while the gradient norm is NaN (HF Trainer / LLaMA-Factory);
- the loss jumping from a normal value straight to exactly 0.0 and staying there, where the log
  has no gradient norm (LLaMA-Factory's ``trainer_log.jsonl``): a loss that decays towards 0 over
  several records (over-fitting a tiny set) is not this;
- DeepSpeed's fp16 step counter skipping nearly every step (``step=500, skipped=496``): the loss
  scaler found inf/NaN gradients on each of them, so the model no longer learns (a handful of
  skipped steps while the loss scale settles is normal);
- Megatron's ``lm loss:`` field disappearing from the iteration lines: Megatron prints only finite
  averages, so a NaN loss drops the field while ``number of nan iterations`` may stay 0.

``NanWatch.feed`` returns, once per key (rank or file), a line the ``nan.watch`` rule turns into a
``nan_loss`` hit.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

PERSIST = 3  # records in a row with a non-finite gradient norm, or a loss collapsed to 0.0
JUMP = 0.05  # a loss collapse starts from a loss at least this large
PREFIX = "trainguard nan-watch: "

_NUM = r"(nan|[-+]?inf(?:inity)?|[-+]?\d+(?:\.\d*)?(?:[eE][-+]?\d+)?)"
_GRAD = re.compile(r"(?i)\bgrad[_ ]norm\b['\"]?\s*[:=]\s*['\"]?" + _NUM)
_LOSS = re.compile(r"(?i)(?<![\w/])(?:lm |train[_/])?loss\b(?! scale)['\"]?\s*[:=]?\s*['\"]?" + _NUM)
_MEGATRON = re.compile(r"\biteration\s+(\d+)/\s*\d+\s*\|")
_SKIPPED = re.compile(r"\bstep=(\d+), skipped=(\d+)")
SKIP_MIN_STEPS = 100  # the skip counter is read once this many optimizer steps were taken
SKIP_SHARE = 0.9  # ... and counts as NaN/Inf gradients when this share of them were skipped


def _value(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        return math.nan


def _prev_loss(message: str | None) -> float:
    lo = _LOSS.search(message) if message else None
    return _value(lo.group(1)) if lo is not None else math.nan


@dataclass
class _State:
    nan_grads: int = 0
    zero_losses: int = 0
    had_lm_loss: bool = False
    missing_lm_loss: int = 0
    loss_lines: int = 0  # records that mention a loss
    prev: str | None = None  # the last of them (parsed only when the next one reads 0.0)
    collapsed: int = 0  # records with loss exactly 0.0 since it jumped there
    anchor: str | None = None  # the record where the trouble began
    nan_record: str | None = None  # the record where the gradient norm turned non-finite
    fired: bool = False


class NanWatch:
    def __init__(self) -> None:
        self._state: dict[object, _State] = {}
        self.anchor: str | None = None  # after a verdict: the log record where the trouble began

    def _loss(self, st: _State, message: str, value: float) -> None:
        if value != 0.0:
            st.collapsed = 0
        elif st.collapsed or (st.loss_lines >= PERSIST and _prev_loss(st.prev) >= JUMP):
            st.collapsed += 1
            st.anchor = st.anchor if st.collapsed > 1 else message

    def _skipped(self, st: _State, message: str) -> str | None:
        m = _SKIPPED.search(message)
        if m is None or int(m[1]) < SKIP_MIN_STEPS or int(m[2]) < SKIP_SHARE * int(m[1]):
            return None
        st.fired = True
        return (PREFIX + f"the fp16 loss scaler skipped {m[2]} of {m[1]} steps (inf/NaN gradients on nearly "
                "every step: the model no longer learns)")  # fmt: skip

    def feed(self, key: object, message: str) -> str | None:
        if "rad" not in message and "oss" not in message and "iteration" not in message and "skipped=" not in message:
            return None
        st = self._state.setdefault(key, _State())
        if st.fired:
            return None
        if "skipped=" in message:
            return self._skipped(st, message)
        low = message.lower()
        odd = "nan" in low or "inf" in low  # a non-finite value may be in this line
        it = _MEGATRON.search(message) if "iteration" in message else None
        if it is not None:
            if "lm loss:" in message:
                st.had_lm_loss, st.missing_lm_loss = True, 0
            elif st.had_lm_loss:
                st.missing_lm_loss += 1
        if odd or st.nan_grads:  # gradient values matter only around a non-finite one
            g = _GRAD.search(message) if "norm" in low else None
            if g is not None:
                grad = _value(g.group(1))
                st.nan_grads = st.nan_grads + 1 if not math.isfinite(grad) else 0
                st.nan_record = (st.nan_record or message) if st.nan_grads else None
        if "oss" in message:
            # the loss is parsed only where it may be 0.0 or matters (cheap on a healthy log)
            lo = _LOSS.search(message) if st.nan_grads or st.collapsed or "0.0" in message else None
            if lo is not None:
                loss = _value(lo.group(1))
                if st.nan_grads:
                    st.zero_losses = st.zero_losses + 1 if loss == 0.0 else 0
                self._loss(st, message, loss)
            st.loss_lines += 1
            st.prev = message
        where = f" (iteration {it.group(1)})" if it else ""
        if st.missing_lm_loss >= 2:
            st.fired = True
            return (
                PREFIX + f"loss became NaN: the lm loss field disappeared from the iteration lines{where} "
                "(Megatron prints only finite averages)"
            )
        if st.zero_losses >= 2:
            st.fired = True
            return PREFIX + f"loss became NaN: gradient norm NaN/Inf and the loss stuck at 0.0{where}"
        if st.nan_grads >= PERSIST:
            st.fired = True
            return (
                PREFIX + f"gradient norm became NaN/Inf and stayed so for {st.nan_grads} log records{where}"
            )
        if st.collapsed >= PERSIST:
            st.fired = True
            self.anchor = st.anchor
            return (
                PREFIX
                + f"loss collapsed to exactly 0.0 and stayed there for {st.collapsed} log records{where} "
                "(the sign of NaN gradients where the log has no gradient norm: HF Trainer and "
                "LLaMA-Factory log such steps as loss 0.0, grad_norm nan)"
            )
        return None

    def finish(self) -> list[tuple[object, str, str]]:
        """At the end of the log: (key, record, verdict line) for each key whose last records had a
        non-finite gradient norm and no finite one after it."""
        out = []
        for key, st in self._state.items():
            if st.nan_grads and not st.fired and st.nan_record is not None:
                st.fired = True
                out.append((key, st.nan_record, PREFIX + "gradient norm became NaN/Inf in the last metric "
                            "record(s) of the log, with no finite record after it (not a skipped step)"))  # fmt: skip
        return out
