"""Spans of framework phases that callbacks only see begin and end (shared by the integrations).

Outside ``trainguard run`` (no recorder) everything here costs a clock read and records nothing.
"""

from __future__ import annotations

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
