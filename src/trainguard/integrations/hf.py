"""Hugging Face ``Trainer`` callback: evaluation and save phases as spans; fast checkpoints.

    from trainguard.integrations.hf import TrainguardCallback

    trainer = Trainer(..., callbacks=[TrainguardCallback(checkpoint_every=50)])
    trainer.train()

- Evaluation: a span named ``Evaluation`` from the end of the step (or of its logging) to
  ``on_evaluate``; SaveCheckpoint: one span for the Trainer's whole save (weights, optimizer,
  scheduler, RNG, state), the ``torch.save`` calls inside it not counted again.
- ``checkpoint_every=N``: every N optimizer steps, this rank's model, optimizer, scheduler, step and
  epoch go to ``trainguard.checkpoint.save`` (shared memory, persisted by the agent). On
  ``on_train_begin`` the newest snapshot every rank has is loaded (``resume=False`` to skip): after
  a restart the Trainer goes on from that step. The data order restarts at the beginning of the
  epoch (the Trainer's own ``resume_from_checkpoint`` also skips the batches already seen), and
  the first logged loss after a resume averages over the resumed steps too.

Step spans need nothing from here: the Trainer's optimizer step is timed zero-code.
"""

from __future__ import annotations

from typing import Any

from trainguard.integrations._common import CallbackBase, LazyCallback


def __getattr__(name: str) -> Any:
    if name == "TrainguardCallback":
        return _lazy.get()
    raise AttributeError(name)


def _framework_base() -> type:
    from transformers import TrainerCallback

    return TrainerCallback


class _TrainguardCallback(CallbackBase):
    """The behaviour; combined with ``transformers.TrainerCallback`` on first use."""

    def __init__(self, checkpoint_every: int = 0, resume: bool = True) -> None:
        super().__init__(checkpoint_every, resume)
        self._evaluating = False  # between the first prediction step and on_evaluate

    # ---- checkpoint ---------------------------------------------------------------------------
    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, optimizer: Any = None,
                       lr_scheduler: Any = None, **kwargs: Any) -> None:  # fmt: skip
        if self.resume and self.checkpoint_every:
            from trainguard import checkpoint

            snap = checkpoint.load_latest()
            if snap is not None:
                model.load_state_dict(snap["model"])
                if optimizer is not None and "optim" in snap:
                    optimizer.load_state_dict(snap["optim"])
                if lr_scheduler is not None and "sched" in snap:
                    lr_scheduler.load_state_dict(snap["sched"])
                state.global_step = int(snap["step"])
                state.epoch = float(snap.get("epoch", 0.0))
                self.resumed_from = state.global_step
        self.phases.mark()

    def on_step_end(self, args: Any, state: Any, control: Any, model: Any = None, optimizer: Any = None,
                    lr_scheduler: Any = None, **kwargs: Any) -> None:  # fmt: skip
        step = state.global_step
        if self.checkpoint_every and step % self.checkpoint_every == 0:
            from trainguard import checkpoint

            snap: dict[str, Any] = {"model": model.state_dict(), "step": step, "epoch": float(state.epoch or 0.0)}
            if optimizer is not None:
                snap["optim"] = optimizer.state_dict()
            if lr_scheduler is not None:
                snap["sched"] = lr_scheduler.state_dict()
            checkpoint.save(snap, step)
        if control.should_save:  # decided by the Trainer's flow callback, which runs first
            self.phases.save_ahead()
        self.phases.mark()

    # ---- phases -------------------------------------------------------------------------------
    def on_log(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if not self._evaluating:  # (evaluate() logs its metrics just before on_evaluate)
            self.phases.mark()  # the training log (a loss all-gather) is done; an evaluation may follow

    def on_prediction_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.phases.since is None:  # trainer.evaluate() outside training: it started here
            self.phases.mark()
        self._evaluating = True

    def on_evaluate(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.phases.evaluation_done()
        self._evaluating = False

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.phases.save_done()

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.phases.since = None


_lazy = LazyCallback(_TrainguardCallback, _framework_base, __name__)
