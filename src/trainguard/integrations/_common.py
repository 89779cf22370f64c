"""What the integrations share: the callbacks' common state, their lazily built classes, and
spans of framework phases that callbacks only see begin and end.

Outside ``trainguard run`` (no recorder) the spans cost a clock read and record nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from time import perf_counter_ns

from trainguard.worker import hooks, spans
from trainguard.worker import ring as R

EVALUATION = "Evaluation"


class Phases:
    """``mark()`` at every callback that ends something; a phase span runs from the last mark."""

    def __init__(self) -> None:
        self.since: int | None = perf_counter_ns()
        self.saving = False

    def mark(self) -> None:
        self.since = perf_counter_ns()

    def evaluation_done(self) -> None:
        if self.since is not None:
            spans.record_phase(EVALUATION, self.since)
        self.mark()

    def save_ahead(self) -> None:
        """A whole checkpoint save follows: its inner torch.save calls are part of its span."""
        hooks.suppress_saves(True)
        self.saving = True

    def save_done(self) -> None:
        if self.since is not None:
            spans.record_phase("SaveCheckpoint", self.since, kind=R.SAVE_CHECKPOINT)
        if self.saving:
            hooks.suppress_saves(False)
            self.saving = False
        self.mark()


class CallbackBase:
    """State every trainguard callback has; the framework's own callback class is mixed in later."""

    def __init__(self, checkpoint_every: int = 0, resume: bool = True) -> None:
        if checkpoint_every < 0:
            raise ValueError(f"checkpoint_every must be >= 0, got {checkpoint_every}")
        self.checkpoint_every = checkpoint_every
        self.resume = resume
        self.resumed_from: int | None = None  # the step a snapshot was loaded from
        self.phases = Phases()


class LazyCallback:
    """``behaviour`` combined with the framework's callback base class on first use, so that the
    integration module imports without the framework (ImportError only when used)."""

    def __init__(self, behaviour: type, framework_base: Callable[[], type], module: str) -> None:
        self.behaviour, self.framework_base, self.module = behaviour, framework_base, module
        self._cls: type | None = None

    def get(self) -> type:
        if self._cls is None:
            bases = (self.behaviour, self.framework_base())
            self._cls = type("TrainguardCallback", bases, {"__module__": self.module})
        return self._cls
