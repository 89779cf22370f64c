"""The agent's side of the NaN triage: arm a replay, give its workers the gradient
check, gather what the replay shows, and say ``nan_transient`` when it went past the NaN.

The policy decides (``policy.decide_nan_replay``, ``policy.decide_after_nan_replay``); this class
only keeps the state between the failed attempt and its replay:

- a NaN failure arms a replay: the next attempt's workers get ``TRAINGUARD_NAN_CHECK`` (their
  gradient check, worker/nancheck.py, writes ``RUN_DIR/nan-check/attempt-<n>/``) and
  ``TRAINGUARD_CKPT_FINITE_ONLY`` (``checkpoint.load_latest`` skips states holding a NaN/inf);
- the replay is past the NaN once any rank made more optimizer steps than the failed attempt's
  ranks made in all, twice over (the agent's step counts lag by a poll): ``nan_transient``. A job
  without step counts is judged when the replay ends: exit 0 is ``nan_transient`` too;
- the replay failed: the gradient check's records (else the diagnosis, when it says NaN) are the
  replay's evidence for the policy.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainguard.checkpoint.client import ENV_FINITE_ONLY
from trainguard.evidence import Diagnosis, NanEvidence
from trainguard.monitors.api import StepTracker
from trainguard.policy import is_nan_failure
from trainguard.worker.nancheck import ENV_DIR, first_nonfinite, read_records


def last_steps(steps: StepTracker) -> int | None:
    """The most optimizer steps any rank made in this attempt (None: no step counts known)."""
    return max((s[-1].step for s in (steps.recent(r) for r in steps.ranks()) if s), default=None)


@dataclass
class NanTriage:
    run_dir: Path
    node: str
    replays_left: int
    first: NanEvidence | None = None  # the NaN being triaged
    first_steps: int = 0  # optimizer steps the failed attempt's ranks made (agent's count)
    armed: bool = False  # the next attempt is the replay
    replay_attempt: int | None = None

    def check_dir(self, attempt: int) -> Path:
        return self.run_dir / "nan-check" / f"attempt-{attempt}"

    def first_from(self, diagnosis: Diagnosis, attempt: int, local_ranks: set[int]) -> NanEvidence:
        rank = diagnosis.rank
        return NanEvidence(attempt, rank, self.node if rank in local_ranks else "", "diagnosis",
                           detail=diagnosis.summary[:300])  # fmt: skip

    def arm(self, first: NanEvidence, steps: StepTracker) -> None:
        self.first, self.first_steps, self.armed = first, last_steps(steps) or 0, True
        self.replays_left -= 1

    def on_start(self, attempt: int) -> None:
        if self.armed:
            self.armed, self.replay_attempt = False, attempt
        elif self.replay_attempt != attempt:  # the replay ended otherwise (a hang, a lost node): not judged
            self.first, self.replay_attempt = None, None

    def replaying(self, attempt: int) -> bool:
        return self.first is not None and self.replay_attempt == attempt

    def worker_env(self, attempt: int) -> dict[str, str]:
        """The replay's switches; empty values otherwise (an inherited one must not leak in)."""
        if self.armed or self.replaying(attempt):
            return {ENV_DIR: str(self.check_dir(attempt)), ENV_FINITE_ONLY: "1"}
        return {ENV_DIR: "", ENV_FINITE_ONLY: ""}

    def past_the_nan(self, steps: StepTracker) -> bool:
        """The replay's ranks went well past the point where the failed attempt stopped."""
        return self.first_steps > 0 and (last_steps(steps) or 0) > 2 * self.first_steps

    def replay_evidence(self, attempt: int, diagnosis: Diagnosis | None, local_ranks: set[int]) -> NanEvidence | None:
        """The replay's non-finite value: the gradient check's first, else the diagnosis' NaN."""
        found = first_nonfinite(read_records(self.check_dir(attempt)), attempt)
        if found is None and is_nan_failure(diagnosis):
            assert diagnosis is not None
            return self.first_from(diagnosis, attempt, local_ranks)
        return found

    def done(self) -> NanEvidence:
        first, self.first, self.replay_attempt = self.first, None, None
        assert first is not None
        return first

    def transient_evidence(self, first: NanEvidence, attempt: int) -> dict[str, Any]:
        return {"rank": first.rank, "node": first.node, "nan_attempt": first.attempt,
                "replay_attempt": attempt, "first": first.to_dict()}  # fmt: skip
